"""The commit protocol: manifest, create-only writes, claim, load checks, two committers."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import commit as commit_mod
from cloudckpt import commit_state
from cloudckpt.core import CheckpointingConfig
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointRemovedError,
    CommitConflictError,
    CorruptObjectError,
    ObjectExistsError,
    StorageError,
    UncommittedCheckpointError,
)
from cloudckpt.manifest import (
    CLAIM_FNAME,
    MANIFEST_FNAME,
    Manifest,
    ManifestEntry,
    ManifestError,
    TensorEntry,
    common_key_paths,
    merge_entries,
)
from cloudckpt.mapping import ShardedTensor
from cloudckpt.storage import CheckpointStorage, WriteResult
from cloudckpt.tracker import collect_garbage, latest
from tests.fixtures_object_stores import (
    GS_CASES,
    STORE_CASES,
    S3Endpoint,
    StoreLocation,
    bucket_location,
    server_for,
)

# --- manifest ------------------------------------------------------------------------------


ZARR = ("zarr", 1)  # these tests look at the zarr layout (chunk objects)


def _manifest() -> Manifest:
    return Manifest(
        objects=(ManifestEntry("w/0", 8, 123), ManifestEntry("a/.zarray", 50, 7)),
        tensors=(TensorEntry("w", (4, 2), "float32", (2, 2)), TensorEntry("b", (3,), "bfloat16")),
        common_keys=("optimizer.lr", "iteration"),
        world_size=4,
        created="2026-11-21T00:00:00Z",
        backends={"sharded_backend": "zarr", "sharded_backend_version": 1},
    )


def test_manifest_json_round_trip_is_canonical() -> None:
    manifest = _manifest()
    raw = manifest.to_json()
    again = Manifest.from_json(raw)
    assert again == manifest
    assert again.to_json() == raw
    assert [e.path for e in again.objects] == ["a/.zarray", "w/0"]
    assert [t.key for t in again.tensors] == ["b", "w"]
    assert again.tensors[0].chunks is None and again.tensors[1].chunks == (2, 2)
    assert again.total_size == 58
    assert again.digest() == manifest.digest() and len(manifest.digest()) == 64
    assert json.loads(raw)["objects"] == [["a/.zarray", 50, 7], ["w/0", 8, 123]]


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"not json", "malformed"),
        (b'{"format": "other"}', "not a cloudckpt manifest"),
        (b'{"format": "cloudckpt-manifest", "version": 99}', "version 99"),
        (b'{"format": "cloudckpt-manifest", "version": 1}', "malformed"),
    ],
)
def test_bad_manifests_are_refused(raw: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(raw, "s3://b/ckpt/manifest.json")


def test_manifest_refuses_duplicate_paths_and_merge_refuses_two_writers() -> None:
    with pytest.raises(ManifestError, match="more than once"):
        Manifest(objects=(ManifestEntry("x", 1, 1), ManifestEntry("x", 1, 1)))
    same = merge_entries([[ManifestEntry("x", 1, 1)], [ManifestEntry("x", 1, 1)]])
    assert same == [ManifestEntry("x", 1, 1)]
    with pytest.raises(ManifestError, match="written twice"):
        merge_entries([[ManifestEntry("x", 1, 1)], [ManifestEntry("x", 1, 2)]])


def test_common_key_paths_flattens_nested_dicts() -> None:
    state = {"iteration": 3, "args": {"lr": 0.1, "sched": {"warmup": 5}}, "empty": {}}
    assert sorted(common_key_paths(state)) == [
        "args.lr",
        "args.sched.warmup",
        "empty",
        "iteration",
    ]


# --- create-only writes ---------------------------------------------------------------------


def _refuses_second_create(request: pytest.FixtureRequest, case: str) -> bool:
    """Whether the store of ``case`` refuses a second create-only write (probed once per
    server by the fixtures; local disks and memory:// always do)."""
    return server_for(request, case).create_only if case in STORE_CASES else True


def test_exclusive_write_on_every_backend(checkpoint_uri: StoreLocation, request) -> None:
    case = request.node.callspec.params["checkpoint_uri"]
    uri, options = checkpoint_uri
    storage = CheckpointStorage(uri, storage_options=options)
    first = storage.write("claim.json", b"first", exclusive=True)
    assert first == WriteResult("claim.json", 5, cloudckpt.storage.crc32c(b"first"))
    # cloudckpt cannot tell GCS emulators apart: it does not claim enforcement there
    assert storage.enforces_exclusive_writes is (None if case in GS_CASES else True)
    if not _refuses_second_create(request, case):
        # gcp-storage-emulator ignores ifGenerationMatch=0 (real GCS answers 412)
        storage.write("claim.json", b"second", exclusive=True)
        assert storage.read("claim.json") == b"second"
        return
    with pytest.raises(ObjectExistsError, match=r"claim\.json already exists"):
        storage.write("claim.json", b"second", exclusive=True)
    assert storage.read("claim.json") == b"first"


def test_claim_warns_where_create_only_is_not_known_to_be_enforced(
    gcs_bucket: StoreLocation, caplog: pytest.LogCaptureFixture
) -> None:
    uri, options = gcs_bucket
    caplog.set_level(logging.WARNING, logger="cloudckpt.commit")
    storage = CheckpointStorage(f"{uri}/ckpt", storage_options=options)
    commit_mod.claim(storage)
    assert any("may not enforce create-only" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("case", STORE_CASES)
def test_second_claim_and_manifest_are_refused_where_the_store_enforces_it(
    case: str, request: pytest.FixtureRequest
) -> None:
    """The commit protocol's two create-only writes against every server: refused where
    the probe found create-only enforced (SeaweedFS, moto, fake-gcs-server), overwritten
    where not (gcp-storage-emulator; cloudckpt warns there, see above)."""
    bucket_uri, options = bucket_location(request, case)
    storage = CheckpointStorage(f"{bucket_uri}/run/iter_1", storage_options=options)
    claimed = commit_mod.claim(storage)
    result = storage.write("x", b"data")
    backends = CheckpointingConfig("zarr")
    first = commit_mod.commit(storage, [result], backends, claimed=claimed)
    assert first is not None
    # another job's manifest differs (an identical one would count as a retry of ours)
    other = storage.write("y", b"another job's data")
    if _refuses_second_create(request, case):
        with pytest.raises(CommitConflictError, match="another job"):
            commit_mod.claim(storage)
        with pytest.raises(CommitConflictError, match="committed by another job"):
            commit_mod.commit(storage, [other], backends)
        assert commit_state.read_manifest(storage) == first
    else:
        commit_mod.claim(storage)  # replaces the claim: nothing stops a second job
        second = commit_mod.commit(storage, [other], backends)
        assert second is not None and commit_state.read_manifest(storage) == second


def test_create_only_writes_on_gcs_are_simple_uploads_whatever_their_size(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fake-gcs-server (like real GCS for simple uploads) refuses a second create of an
    object larger than gcsfs's resumable-upload threshold (50 MiB) too: cloudckpt never
    sends a create-only write as a resumable upload, whose precondition a server may
    ignore (fake-gcs-server does)."""
    import gcsfs.core  # noqa: PLC0415

    bucket_uri, options = bucket_location(request, "gs-fakegcs")
    assert server_for(request, "gs-fakegcs").create_only
    resumable: list[str] = []
    original = gcsfs.core.initiate_upload

    async def initiate_upload(fs: Any, bucket: str, key: str, *args: Any, **kwargs: Any) -> Any:
        resumable.append(key)
        return await original(fs, bucket, key, *args, **kwargs)

    monkeypatch.setattr(gcsfs.core, "initiate_upload", initiate_upload)
    storage = CheckpointStorage(f"{bucket_uri}/ckpt", storage_options=options)
    big = bytes(50 * 2**20 + 1)
    storage.write(MANIFEST_FNAME, big, exclusive=True)
    with pytest.raises(ObjectExistsError, match="already exists"):
        storage.write(MANIFEST_FNAME, b"x" * len(big), exclusive=True)
    assert storage.read(MANIFEST_FNAME) == big
    assert resumable == []
    storage.write("data", big)  # a plain write of that size is resumable (the control)
    assert resumable == ["ckpt/data"]


# --- save and load ----------------------------------------------------------------------------


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(64, 32, generator=gen)),
        "b": ShardedTensor.from_rank_offsets("b", torch.randn(16, generator=gen)),
        "iteration": seed,
        "args": {"lr": 0.1},
    }


def _request() -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 32)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(16)),
    }


def test_save_writes_claim_manifest_and_metadata_last(
    s3_server: S3Endpoint, s3_bucket: StoreLocation
) -> None:
    uri, options = s3_bucket
    ckpt = f"{uri}/iter_0000001"
    storage = CheckpointStorage(ckpt, storage_options=options)
    puts: list[str] = []
    calls: list[str] = []
    storage.fs.connect()

    def record(params: dict[str, Any], model: Any, **_: Any) -> None:
        calls.append(f"{model.name} {params.get('Key', '').rsplit('/', 1)[-1]}")
        if model.name in ("PutObject", "CreateMultipartUpload"):
            puts.append(params["Key"].rsplit("iter_0000001/", 1)[1])

    storage.fs.s3.meta.events.register("before-parameter-build.s3", record)
    cloudckpt.save(
        _state(), ckpt, sharded_strategy=_zarr_with(storage), common_strategy=_common_with(storage)
    )
    assert puts[0] == CLAIM_FNAME
    assert puts[-2:] == [MANIFEST_FNAME, "metadata.json"]
    # the manifest comes from the ranks' write results: no data object is read back,
    # only the small claim (to check that it is still this save's) and, after
    # metadata.json, the first bytes of the manifest (that no removal replaced it)
    gets = [c for c in calls if c.startswith("GetObject")]
    assert gets == [f"GetObject {CLAIM_FNAME}", f"GetObject {MANIFEST_FNAME}"]
    manifest = commit_state.read_manifest(storage)
    assert manifest is not None
    listed = storage.list_sizes()
    assert {e.path: e.size for e in manifest.objects} == {
        p: n for p, n in listed.items() if p not in (MANIFEST_FNAME, "metadata.json")
    }
    assert manifest.world_size == 1
    assert manifest.common_keys == ("args.lr", "iteration")
    assert {t.key: (t.global_shape, t.dtype, t.chunks) for t in manifest.tensors} == {
        "w": ((64, 32), "float32", (64, 32)),
        "b": ((16,), "float32", (16,)),
    }
    assert manifest.backends == {
        "sharded_backend": "zarr",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert json.loads(storage.read("metadata.json")) == manifest.backends


def _zarr_with(storage: CheckpointStorage) -> Any:
    from cloudckpt.strategies.zarr import ZarrSaveShardedStrategy  # noqa: PLC0415

    return ZarrSaveShardedStrategy(fs=storage.fs)


def _common_with(storage: CheckpointStorage) -> Any:
    from cloudckpt.strategies.common import TorchCommonSaveStrategy  # noqa: PLC0415

    return TorchCommonSaveStrategy(fs=storage.fs)


@pytest.mark.parametrize("missing", [MANIFEST_FNAME, "metadata.json"])
def test_load_refuses_uncommitted_naming_what_is_missing(tmp_path, missing: str) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(), uri, sharded_strategy=ZARR)
    CheckpointStorage(uri).delete(missing)
    assert not cloudckpt.check_is_distributed_checkpoint(uri)
    with pytest.raises(UncommittedCheckpointError, match=missing.replace(".", r"\.")):
        cloudckpt.load(_request(), uri)


def test_a_checkpoint_without_claim_or_manifest_is_foreign_and_loads(tmp_path) -> None:
    """What Megatron-Core writes: metadata.json and data, no cloudckpt objects."""
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(3), uri, sharded_strategy=ZARR)
    storage = CheckpointStorage(uri)
    storage.delete(MANIFEST_FNAME)
    storage.delete(CLAIM_FNAME)
    state = commit_state.read_commit_state(storage)
    assert state.committed and state.foreign
    loaded = cloudckpt.load(_request(), uri)
    assert torch.equal(loaded["w"], _state(3)["w"].data)


def _rewrite(storage: CheckpointStorage, path: str, change: str) -> None:
    data = bytearray(storage.read(path))
    if change == "truncate":
        data = data[:-4]
    else:
        data[len(data) // 2] ^= 0x01
    storage.write(path, bytes(data))


@pytest.mark.parametrize("change", ["truncate", "flip"])
def test_load_checks_objects_against_the_manifest(tmp_path, change: str) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(), uri, sharded_strategy=ZARR)
    _rewrite(CheckpointStorage(uri), "w/0.0", change)
    with pytest.raises(CorruptObjectError, match=r"w/0\.0"):
        cloudckpt.load(_request(), uri)


def test_partial_reads_are_crc_checked(tmp_path) -> None:
    uri = str(tmp_path / "ckpt")
    full = _state()
    cloudckpt.save(full, uri, sharded_strategy=ZARR)
    storage = CheckpointStorage(uri)
    halves = {
        f"w{i}": ShardedTensor.from_rank_offsets("w", torch.empty(32, 32), (0, i, 2))
        for i in range(2)
    }
    checked = cloudckpt.load(halves, uri, verify_checksums=True)  # one object, read once
    assert torch.equal(torch.cat([checked["w0"], checked["w1"]]), full["w"].data)
    data = bytearray(storage.read("w/0.0"))
    data[-1] ^= 0x01  # corrupt the last row only
    storage.write("w/0.0", bytes(data))
    top_rows = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(32, 32), (0, 0, 2))}
    # rows 0-31 only: the object is one block (8 KiB), read and checked whole
    # (tests/test_block_crc.py covers objects of several blocks)
    with pytest.raises(CorruptObjectError, match="CRC-32C"):
        cloudckpt.load(top_rows, uri, validate_access_integrity=False)
    with pytest.raises(CorruptObjectError, match="CRC-32C"):
        cloudckpt.load(top_rows, uri, validate_access_integrity=False, verify_checksums=True)


def test_second_commit_of_one_uri_is_a_conflict(tmp_path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    result = storage.write("x", b"data")
    backends = CheckpointingConfig("zarr")
    first = commit_mod.commit(storage, [result], backends)
    assert first is not None and first.objects == (ManifestEntry("x", 4, result.crc32c),)
    with pytest.raises(CommitConflictError, match="committed by another job"):
        commit_mod.commit(storage, [result], backends)
    assert commit_state.read_manifest(storage) == first


# --- two jobs, one URI --------------------------------------------------------------------------


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _racing_save(uri: str, options: dict[str, Any], seed: int, start: Any, out: Any) -> None:
    warnings = _Warnings()
    logging.getLogger("cloudckpt.commit").addHandler(warnings)
    start.wait(timeout=60)
    try:
        cloudckpt.save(_state(seed), uri, storage_options=options, sharded_strategy=ZARR)
        out.put((seed, "ok", "", warnings.messages))
    except CheckpointingException as exc:
        out.put((seed, type(exc).__name__, str(exc), warnings.messages))


@pytest.mark.parametrize("store", ["local", *STORE_CASES])
def test_two_jobs_saving_one_uri_exactly_one_commits(
    store: str, tmp_path, request: pytest.FixtureRequest
) -> None:
    """Exactly one of two racing jobs commits where the store enforces create-only
    writes; where it does not (gcp-storage-emulator), every job that claims warns."""
    if store in STORE_CASES:
        bucket_uri, options = bucket_location(request, store)
        uri = f"{bucket_uri}/run/iter_0000001"
    else:
        uri, options = str(tmp_path / "ckpt"), {}
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    jobs = [ctx.Process(target=_racing_save, args=(uri, options, s, start, out)) for s in (1, 2)]
    for job in jobs:
        job.start()
    start.set()
    outcomes = sorted(out.get(timeout=120) for _ in jobs)
    for job in jobs:
        job.join(timeout=60)
    if not _refuses_second_create(request, store):
        # nothing stops the second job: no outcome is guaranteed but the warning, which
        # every job that claimed logged first (a job that found the other's claim or
        # commit before claiming stopped without one)
        warned = [any("may not enforce create-only" in w for w in o[3]) for o in outcomes]
        assert any(warned), outcomes
        assert all(w for w, o in zip(warned, outcomes, strict=True) if o[1] == "ok"), outcomes
        return
    outcomes = [o[:3] for o in outcomes]
    winners = [seed for seed, status, _ in outcomes if status == "ok"]
    losers = [(name, msg) for _, name, msg in outcomes if name != "ok"]
    assert len(winners) == 1, outcomes
    assert len(losers) == 1 and losers[0][0] == "CommitConflictError", outcomes
    # which message depends on how far the winner got when the loser looked
    assert any(
        reason in losers[0][1]
        for reason in ("another save claimed it", "another job", "holds a committed checkpoint")
    ), losers
    assert uri.split("://")[-1] in losers[0][1]
    loaded = cloudckpt.load(_request(), uri, storage_options=options, verify_checksums=True)
    assert torch.equal(loaded["w"], _state(winners[0])["w"].data)
    from cloudckpt.checker import verify  # noqa: PLC0415

    report = verify(uri, deep=True, storage_options=options)
    assert report.ok, report.problems


def test_local_create_only_writes_have_exactly_one_winner(tmp_path) -> None:
    """O_EXCL, not check-then-write: racing threads never both create the object."""
    import threading  # noqa: PLC0415

    for trial in range(30):
        storage = CheckpointStorage(str(tmp_path / f"t{trial}"))
        start, wins = threading.Barrier(6), []

        def race(n: int, storage: CheckpointStorage = storage, start=start, wins=wins) -> None:
            start.wait()
            try:
                storage.write("claim.json", f"writer {n}".encode(), exclusive=True)
                wins.append(n)
            except ObjectExistsError:
                pass

        threads = [threading.Thread(target=race, args=(n,)) for n in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(wins) == 1, (trial, wins)
        assert storage.read("claim.json") == f"writer {wins[0]}".encode()


def test_commit_refuses_when_the_claim_was_replaced(tmp_path) -> None:
    """gc (or another job) replaced this save's claim while it wrote: no commit."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    claimed = commit_mod.claim(storage)
    assert claimed is not None
    storage.delete(CLAIM_FNAME)
    storage.write(CLAIM_FNAME, b'{"job": "someone else"}')
    with pytest.raises(CommitConflictError, match="was replaced while it wrote") as info:
        commit_mod.commit(storage, [claimed], CheckpointingConfig("zarr"), claimed=claimed)
    assert not isinstance(info.value, CheckpointRemovedError)  # the other job's objects stay
    assert not storage.exists(MANIFEST_FNAME) and not storage.exists("metadata.json")
    assert storage.exists(CLAIM_FNAME)


def test_a_failure_before_the_first_collective_reaches_every_rank(rank_pool, tmp_path) -> None:
    """A bad key on one rank is raised on every rank, naming that rank (no hang)."""
    outcomes = rank_pool.run(_bad_key_on_rank_1, str(tmp_path / "ckpt"))
    assert all("rank 1" in text and "invalid key" in text for text in outcomes), outcomes


def _bad_key_on_rank_1(rank: int, world: int, uri: str) -> str:
    key = "bad//key" if rank == 1 else "good"
    state = {"x": ShardedTensor.from_rank_offsets(key, torch.ones(2), (0, rank, world))}
    try:
        cloudckpt.save(state, uri, sharded_strategy=ZARR)
    except CheckpointingException as exc:
        return str(exc)
    return "no error"


def test_a_failed_metadata_json_write_leaves_no_manifest(tmp_path, monkeypatch) -> None:
    """The commit writes manifest.json, then metadata.json: when the second write fails
    (a full disk), the manifest is taken back, so that the checkpoint is not committed
    and the next save, latest and gc see it so."""
    root = tmp_path / "run"
    good, failed = str(root / "iter_0000001"), str(root / "iter_0000002")
    cloudckpt.save(_state(), good, sharded_strategy=ZARR)

    def no_space(_backends: Any, storage: CheckpointStorage) -> None:
        raise StorageError(28, f"failed to write {storage.uri}/metadata.json: No space left")

    monkeypatch.setattr(commit_mod, "save_config", no_space)
    with pytest.raises(StorageError, match=r"metadata\.json"):
        cloudckpt.save(_state(), failed, sharded_strategy=ZARR)
    monkeypatch.undo()
    left = set(CheckpointStorage(failed).list_sizes())
    assert MANIFEST_FNAME not in left and "metadata.json" not in left, left
    assert CLAIM_FNAME in left  # the claim stays, for gc to find the uncommitted save
    assert latest(str(root)) == good
    assert not cloudckpt.check_is_distributed_checkpoint(failed)
    removed = [a.uri for a in collect_garbage(str(root), 1, grace_s=0).actions]
    assert removed == [failed]
