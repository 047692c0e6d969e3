"""A write that fails on a real filesystem keeps its cause, whatever the backend.

A full disk (a small tmpfs mounted for the test: ENOSPC), a read-only one (EROFS), a
file-size limit (``RLIMIT_FSIZE``: EFBIG) and a directory the process may not write
(EACCES, a save run as an unprivileged user): every rank raises a ``StorageError``
(an ``OSError``) whose ``errno`` is the file's, whose message names the errno's symbol,
the object's path and the rank that failed - for torch_dist's streamed ``.distcp``
objects (where ``torch.save``'s zip writer used to replace the cause by its own
``unexpected pos`` error), zarr chunks, ``common.pt``, sharded objects and the claim
(written as the manifest is, create-only). Nothing is committed, the previous
checkpoint still loads, ``gc`` removes what the failed save left and a small save
then commits.

The mounts need root (CI runs as root, as here): ``mount -t tmpfs``, undone by the
fixture.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import StorageError
from cloudckpt.launch import RankPool
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from cloudckpt.tracker import collect_garbage, latest

MiB = 2**20
DISK = 12 * MiB  # the tmpfs: smaller than one rank's big tensor
BIG_ROW = 16 * MiB // 4  # float32 elements of one rank's row: 16 MiB, more than DISK
SMALL_ROW = 16 * 1024  # 64 KiB a rank
BACKENDS = ["torch_dist", "zarr"]


class Disk:
    """A tmpfs of ``size`` bytes mounted at ``path`` (see :func:`disk`)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        path.mkdir()
        _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))

    def remount(self, options: str) -> None:
        _run("mount", "-o", f"remount,{options}", str(self.path))

    def fill(self, leave: int) -> None:
        """Fill the disk but ``leave`` bytes (whole pages) with a file of its own."""
        free = shutil.disk_usage(self.path).free
        with open(self.path / "filler", "wb") as out:
            out.write(b"\0" * max(0, free - leave))

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert done.returncode == 0, (
        f"{' '.join(argv)} failed ({done.stderr.strip()}): these tests mount a small tmpfs "
        f"and need root (CI runs as root), uid {os.geteuid()}"
    )


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    mounted = Disk(tmp_path / "disk", DISK)
    try:
        yield mounted
    finally:
        mounted.unmount()


def row_state(rank: int, world: int, row: int, empty: bool = False) -> dict:
    """One (world, row) float32 tensor, a row per rank, and a plain value."""
    data = torch.empty(1, row) if empty else torch.arange(row, dtype=torch.float32)[None] + rank
    return {"big": ShardedTensor.from_rank_offsets("big", data, (0, rank, world)), "step": 7}


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> dict:
    """What ``fn`` raised: its kinds, errno, message and the ranks it names."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {
            "raised": True,
            "kinds": [c.__name__ for c in type(exc).__mro__],
            "errno": getattr(exc, "errno", None),
            "message": str(exc),
            "failed_ranks": sorted(getattr(exc, "failures", {})),
        }
    return {"raised": False}


def _full_disk_round(rank: int, world: int, root: str, backend: str) -> dict:
    """On every rank: a small save, a save of more than the disk holds, what it raised,
    the small checkpoint loaded back, gc, and a small save after it."""
    strategy = (backend, 1)
    good, failed, after = (os.path.join(root, f"iter_000000{i}") for i in (1, 2, 3))
    cloudckpt.save(row_state(rank, world, SMALL_ROW), good, sharded_strategy=strategy)
    out = _outcome(
        cloudckpt.save, row_state(rank, world, BIG_ROW), failed, sharded_strategy=strategy
    )
    loaded = cloudckpt.load(row_state(rank, world, SMALL_ROW, empty=True), good)
    out["previous_loads"] = bool(
        torch.equal(loaded["big"], row_state(rank, world, SMALL_ROW)["big"].data)
        and loaded["step"] == 7
    )
    out["latest_after_failure"] = latest(root, collective=world > 1)
    out["failed_files"] = sorted(os.listdir(failed)) if os.path.isdir(failed) else []
    if world > 1:  # every rank has listed it before gc removes it (its tombstone included)
        from cloudckpt import dist  # noqa: PLC0415 - torch.distributed only here

        dist.all_gather_object(rank)
    if rank == 0:
        out["gc_removed"] = [a.uri for a in collect_garbage(root, 1, grace_s=0).actions]
    if world > 1:
        from cloudckpt import dist  # noqa: PLC0415 - torch.distributed only here

        dist.all_gather_object(rank)  # gc is done
    cloudckpt.save(row_state(rank, world, SMALL_ROW), after, sharded_strategy=strategy)
    out["latest_at_end"] = latest(root, collective=world > 1)
    return out


def _assert_full_disk(outcomes: list[dict], root: str, disk: Disk) -> None:
    world = len(outcomes)
    failed = os.path.join(root, "iter_0000002")
    for rank, out in enumerate(outcomes):
        assert out["raised"], (rank, out)
        assert "StorageError" in out["kinds"] and "OSError" in out["kinds"], (rank, out)
        assert out["errno"] == errno.ENOSPC, (rank, out)
        message = out["message"]
        assert "ENOSPC" in message and "No space left on device" in message, message
        assert f"failed to write {failed}/" in message, message  # the object's path
        # every rank's own object is larger than the disk: every rank failed, and is named
        named = range(world) if world > 1 else [0]
        assert all(f"(ENOSPC, rank {r})" in message for r in named), message
        if world > 1:
            assert out["failed_ranks"] == list(range(world)), (rank, out)
        assert "enforce fail" not in message and "unexpected pos" not in message, message
        assert out["previous_loads"], (rank, out)
        assert out["latest_after_failure"] == os.path.join(root, "iter_0000001"), out
        assert not {"manifest.json", "metadata.json"} & set(out["failed_files"]), out
        assert out["latest_at_end"] == os.path.join(root, "iter_0000003"), out
    assert outcomes[0]["gc_removed"] == [failed], outcomes[0]
    assert not os.path.exists(failed)
    assert shutil.disk_usage(disk.path).used < DISK // 2  # nothing of the failed save is left


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_disk_raises_enospc_naming_the_object_and_rank(disk: Disk, backend: str) -> None:
    root = str(disk.path / "run")
    _assert_full_disk([_full_disk_round(0, 1, root, backend)], root, disk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_disk_raises_enospc_on_every_rank(
    rank_pool: RankPool, disk: Disk, backend: str
) -> None:
    root = str(disk.path / "run")
    _assert_full_disk(rank_pool.run(_full_disk_round, root, backend), root, disk)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_async_save_to_a_full_disk_raises_enospc_at_finalize(disk: Disk, backend: str) -> None:
    """The upload runs in the queue's thread; its error, raised at finalization, keeps
    its kind and errno."""
    uri = str(disk.path / "ckpt")
    request = cloudckpt.save(
        row_state(0, 1, BIG_ROW), uri, sharded_strategy=(backend, 1), async_sharded_save=True
    )
    assert isinstance(request, AsyncRequest)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    with pytest.raises(StorageError) as raised:
        queue.maybe_finalize_async_calls(blocking=True)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert f"failed to write {uri}/" in str(raised.value), raised.value
    assert "(ENOSPC, rank 0)" in str(raised.value), raised.value
    assert not (Path(uri) / "metadata.json").exists()
    assert shutil.disk_usage(disk.path).used < DISK // 2  # the failed object was removed


# -- each kind of object, one rank --------------------------------------------------------

LARGE = 256 * 1024  # the object that does not fit: larger than what the disk has left
LEFT = 64 * 1024  # what the disk has left: the claim and the small objects fit


def _tensor(row: int) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets("t", torch.arange(row, dtype=torch.float32))


OBJECT_CASES = [
    # (what, backend, state, the object whose write fails)
    ("torch_dist data", "torch_dist", lambda: {"t": _tensor(LARGE // 4)}, "__0_0.distcp"),
    ("zarr chunk", "zarr", lambda: {"t": _tensor(LARGE // 4)}, "t/0"),
    ("common.pt", "zarr", lambda: {"t": _tensor(4), "blob": b"x" * LARGE}, "common.pt"),
    (
        "sharded object",
        "zarr",
        lambda: {"t": _tensor(4), "o": ShardedObject("o", b"x" * LARGE, (1,), (0,))},
        "o/shard_0_1",
    ),
]


@pytest.mark.parametrize(
    ("backend", "make_state", "culprit"),
    [pytest.param(*case[1:], id=case[0]) for case in OBJECT_CASES],
)
def test_every_kind_of_object_keeps_enospc(
    disk: Disk, backend: str, make_state: Any, culprit: str
) -> None:
    uri = str(disk.path / "ckpt")
    disk.fill(leave=LEFT)
    with pytest.raises(StorageError) as raised:
        cloudckpt.save(make_state(), uri, sharded_strategy=(backend, 1))
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert f"failed to write {uri}/{culprit}" in str(raised.value), raised.value
    assert "(ENOSPC, rank 0)" in str(raised.value), raised.value
    assert not (Path(uri) / "metadata.json").exists()
    os.remove(disk.path / "filler")
    shutil.rmtree(uri)  # a save to it again works
    cloudckpt.save(make_state(), uri, sharded_strategy=(backend, 1))
    assert latest(str(disk.path)) == uri


def test_a_full_disk_at_the_claim_keeps_enospc(disk: Disk) -> None:
    """The claim is written create-only, as the manifest is: the same path."""
    uri = str(disk.path / "ckpt")
    disk.fill(leave=0)
    with pytest.raises(StorageError) as raised:
        cloudckpt.save({"t": _tensor(4)}, uri)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert f"{uri}/.cloudckpt-claim.json" in str(raised.value), raised.value
    assert "(ENOSPC, rank 0)" in str(raised.value), raised.value
    # the claim cut short is not left behind: once there is room, the retry commits
    assert not os.path.exists(f"{uri}/.cloudckpt-claim.json")
    os.remove(disk.path / "filler")
    cloudckpt.save({"t": _tensor(4)}, uri)
    assert cloudckpt.verify(uri).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_only_disk_raises_erofs(disk: Disk, backend: str) -> None:
    uri = str(disk.path / "ckpt")
    os.mkdir(uri)
    disk.remount("ro")
    with pytest.raises(StorageError) as raised:
        cloudckpt.save(row_state(0, 1, 16), uri, sharded_strategy=(backend, 1))
    assert raised.value.errno == errno.EROFS, raised.value
    assert uri in str(raised.value) and "(EROFS, rank 0)" in str(raised.value), raised.value
    disk.remount("rw")
    assert os.listdir(uri) == []


@contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Files of this process grow to ``nbytes`` at most (further writes: EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_size_limit_raises_efbig(tmp_path: Path, backend: str) -> None:
    uri = str(tmp_path / "ckpt")
    with file_size_limit(1 * MiB), pytest.raises(StorageError) as raised:
        cloudckpt.save(row_state(0, 1, 2 * MiB // 4), uri, sharded_strategy=(backend, 1))
    assert raised.value.errno == errno.EFBIG, raised.value
    assert f"failed to write {uri}/" in str(raised.value), raised.value
    assert "(EFBIG, rank 0)" in str(raised.value), raised.value
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


UNPRIVILEGED_SAVE = textwrap.dedent(
    """
    import errno, sys, torch, cloudckpt
    from cloudckpt import ShardedTensor
    from cloudckpt.errors import StorageAccessDeniedError
    state = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(4))}
    try:
        cloudckpt.save(state, sys.argv[1])
    except StorageAccessDeniedError as exc:
        assert isinstance(exc, PermissionError) and exc.errno == errno.EACCES, exc
        print("raised:", exc)
    """
)

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _without_dac_override() -> None:
    """In the child, before it execs: drop the capabilities that let root write where
    the permission bits say no (from the bounding set: the new program has neither)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_directory_the_process_may_not_write_raises_eacces(tmp_path: Path) -> None:
    """Root without CAP_DAC_OVERRIDE, below a directory whose mode has no write bit:
    the existing permission error type, ``StorageAccessDeniedError``, a
    ``PermissionError`` with errno EACCES (the claim, the first write, fails)."""
    uri = tmp_path / "ckpt"
    tmp_path.chmod(0o555)
    try:
        done = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED_SAVE, str(uri)],
            capture_output=True,
            text=True,
            preexec_fn=_without_dac_override,
            timeout=120,
            check=False,
        )
    finally:
        tmp_path.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert f"failed to create {uri}/.cloudckpt-claim.json" in done.stdout, done.stdout
    assert "Permission denied" in done.stdout and "(EACCES, rank 0)" in done.stdout, done.stdout
    assert not uri.exists()


def test_gc_frees_a_full_disk(disk: Disk) -> None:
    """gc works when it is needed most: on a disk full of committed checkpoints (the
    tombstone of a committed one replaces its manifest, freeing its pages first)."""
    run = disk.path / "run"
    for step in (1, 2):
        cloudckpt.save(row_state(0, 1, SMALL_ROW), str(run / f"iter_{step:07d}"))
    disk.fill(leave=0)
    assert shutil.disk_usage(disk.path).free < 4096  # not a page left
    report = collect_garbage(str(run), 1)
    assert [a.reason for a in report.actions] == ["older than the newest 1"]
    assert not (run / "iter_0000001").exists()
    assert latest(str(run)) == str(run / "iter_0000002")
