"""Client CPU per GB of a torch_dist save to SeaweedFS, against the raw multipart PUT.

The S3 save target (>= 0.9x the raw concurrent PUTs of the same bytes) is set on
a 2-core machine where SeaweedFS runs beside the ranks: every CPU-second the client
spends per GB is taken from the server. This script measures that cost, for one
process (a world of 1) saving ``--size`` bytes of the bench's synthetic state:

* ``save``: ``cloudckpt.save(..., backend torch_dist)`` to a fresh SeaweedFS bucket;
* ``buffered``: the same save with each ``.distcp`` object assembled in memory and
  uploaded whole (the path of async saves and of stores without upload streams), for
  an A/B of :class:`~cloudckpt.storage.streams.UploadStream`;
* ``raw``: the bench's raw baseline (``cloudckpt.bench.raw``, setting ``boto3 x16``):
  one boto3 multipart upload of the same tensors' bytes.

Each phase runs in a child process of its own (``--repeat`` times after an untimed
warm-up), measuring the client's CPU (``time.process_time``: every thread), the
server's (``weed``'s utime + stime from ``/proc``) and the wall time, per GB. With
``--profile`` one more run is profiled: a ``cProfile`` per thread (the threads started
by the phase included) with each thread's CPU clock as timer, so that waits cost
nothing; self times are summed into buckets (:data:`BUCKETS`): serialization, CRC-32C,
SHA-256 of payloads, signing, the body reads that feed them, HTTP sending and the rest
("python"). The profiler's own overhead inflates Python-heavy buckets: the totals to
compare are the unprofiled CPU-s/GB; the buckets say where they go.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_s3_save.py --size 512MiB --profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import patch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

GB = 1e9
PHASES = ("save", "buffered", "raw")

# (bucket, tests on a profile entry's (filename, function name)), first match wins
BUCKETS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("crc32c / crc32", lambda f, n: "crc32" in n or f.endswith("storage/blocks.py")),
    ("sha256 payload", lambda f, n: "_hashlib" in n or "sha256" in n or "hexdigest" in n),
    (
        "body reads (copies)",
        lambda f, n: f.endswith("storage/buffers.py") or "tobytes" in n or "_io.BytesIO" in n,
    ),
    (
        "serialization",
        lambda f, n: (
            any(
                part in f
                for part in (
                    "torch/serialization.py",
                    "_append_buffer.py",
                    "_dcp_objects.py",
                    "_item_templates.py",
                    "_host_copies.py",
                    "_torch_zip.py",
                    "_dcp_ranges.py",
                    "torch/_tensor.py",
                    "torch/storage.py",
                    "torch/_utils.py",
                )
            )
            or any(m in n for m in ("PyTorchFileWriter", "copy_", "untyped_storage", "'numpy'"))
        ),
    ),
    ("signing", lambda f, n: "botocore/auth.py" in f or "botocore/signers.py" in f or "hmac" in f),
    (
        "http (botocore/aiohttp/asyncio/socket)",
        lambda f, n: (
            any(
                part in f
                for part in (
                    "botocore",
                    "aiohttp",
                    "asyncio",
                    "s3fs",
                    "s3transfer",
                    "boto3",
                    "urllib3",
                    "fsspec",
                    "ssl.py",
                    "socket.py",
                    "selectors.py",
                    "multidict",
                    "yarl",
                )
            )
            or any(m in n for m in ("socket", "send", "select", "poll", "_ssl"))
        ),
    ),
)


def bucket_of(filename: str, name: str) -> str:
    for bucket, test in BUCKETS:
        if test(filename, name):
            return bucket
    return "python (other)"


# -- profiling every thread ---------------------------------------------------------------

_PROFILERS: list[cProfile.Profile] = []
_PROFILING = threading.Event()
_LOCK = threading.Lock()


def _new_profiler() -> cProfile.Profile:
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
    with _LOCK:
        _PROFILERS.append(profiler)
    return profiler


def _thread_hook(frame: Any, event: str, arg: Any) -> None:
    """``threading.setprofile`` hook: a thread starts its own profiler once profiling is on
    (cProfile's C hook then replaces this one for the thread)."""
    if _PROFILING.is_set():
        _new_profiler().enable()


def _profile_stats() -> pstats.Stats:
    with _LOCK:
        profilers = list(_PROFILERS)
    for profiler in profilers:
        profiler.disable()  # the calling thread's only; the others are idle now
    stats = pstats.Stats(profilers[0])
    for profiler in profilers[1:]:
        try:
            stats.add(profiler)
        except TypeError:  # a thread that recorded nothing
            continue
    return stats


# calls that block: they cost next to no CPU, but a thread still inside one when the
# profilers are read (an idle worker waiting for work) is closed with the reading
# thread's clock, which makes nonsense of its time
BLOCKING = ("SimpleQueue' objects", "'poll' of 'select.epoll'", "acquire", "'wait'")


def buckets_of(stats: pstats.Stats) -> dict[str, float]:
    """Self CPU seconds by bucket (blocking calls left out: see :data:`BLOCKING`)."""
    out: dict[str, float] = {}
    for (filename, _, name), (_, _, self_s, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if any(mark in name for mark in BLOCKING):
            continue
        bucket = bucket_of(filename, name)
        out[bucket] = out.get(bucket, 0.0) + self_s
    return out


# -- the server's CPU -----------------------------------------------------------------------


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the phases (child processes) -------------------------------------------------------------


def _state(size: int) -> tuple[Any, Any]:
    from cloudckpt.bench.workload import build_state, plan_workload, rank_share  # noqa: PLC0415

    spec = plan_workload(size, 1)
    state = build_state(spec, 0)
    return state, rank_share(state, spec, 0)


def _save_runner(args: argparse.Namespace, options: dict[str, Any]) -> Callable[[bool], int]:
    import cloudckpt  # noqa: PLC0415
    from cloudckpt.config import CheckpointConfig  # noqa: PLC0415
    from cloudckpt.tracker import remove_checkpoint  # noqa: PLC0415

    state, share = _state(args.size)
    nbytes = sum(t.numel() * t.element_size() for t in share.values())
    small, _ = _state(8 * 2**20)
    config = CheckpointConfig(backend="torch_dist")

    def run(warm: bool) -> int:
        uri = f"{args.uri}/save-{uuid.uuid4().hex[:8]}"
        with _buffered(args.phase == "buffered"):
            cloudckpt.save(small if warm else state, uri, storage_options=options, config=config)
        started = time.process_time()
        remove_checkpoint(uri, storage_options=options)
        run.cleanup_s += time.process_time() - started  # type: ignore[attr-defined]
        return nbytes

    run.cleanup_s = 0.0  # type: ignore[attr-defined]
    return run


def _buffered(on: bool) -> contextlib.AbstractContextManager[Any]:
    """Within the block, S3 storages open no upload streams (``buffered``)."""
    from cloudckpt.storage import CheckpointStorage  # noqa: PLC0415

    if not on:
        return contextlib.nullcontext()
    return patch.object(CheckpointStorage, "streams_uploads", property(lambda self: False))


def _raw_runner(args: argparse.Namespace, options: dict[str, Any]) -> Callable[[bool], int]:
    from cloudckpt.bench import raw  # noqa: PLC0415
    from cloudckpt.config import CheckpointConfig  # noqa: PLC0415

    _, share = _state(args.size)
    payload = raw.payload_of(share)
    setting = raw.S3_SETTINGS[0]
    client = raw.s3_client(options, setting)
    config = raw.transfer_config(setting, CheckpointConfig().part_size)
    bucket, prefix = raw.split_s3(args.uri)

    def run(warm: bool) -> int:
        key = f"{prefix}/raw-{uuid.uuid4().hex[:8]}.bin".lstrip("/")
        body = payload[: 40 * 2**20] if warm else payload
        raw.s3_put(client, bucket, key, body, config)
        started = time.process_time()
        raw.s3_delete_prefix(client, bucket, [key])
        run.cleanup_s += time.process_time() - started  # type: ignore[attr-defined]
        return len(body)

    run.cleanup_s = 0.0  # type: ignore[attr-defined]
    return run


def child(args: argparse.Namespace) -> None:
    """One phase: warm-up, ``repeat`` timed runs, one profiled run; JSON on stdout."""
    threading.setprofile(_thread_hook)
    options = json.loads(args.options)
    runner = (_raw_runner if args.phase == "raw" else _save_runner)(args, options)
    runner(True)
    runs = []
    for _ in range(args.repeat):
        runner.cleanup_s = 0.0  # type: ignore[attr-defined]
        cpu, server, wall = time.process_time(), cpu_of(args.server_pid), time.perf_counter()
        nbytes = runner(False)
        cpu = time.process_time() - cpu - runner.cleanup_s  # type: ignore[attr-defined]
        runs.append(
            {
                "bytes": nbytes,
                "client_cpu_s_per_gb": cpu / (nbytes / GB),
                "server_cpu_s_per_gb": (cpu_of(args.server_pid) - server) / (nbytes / GB),
                "mb_per_s": nbytes / 1e6 / (time.perf_counter() - wall),
            }
        )
    result: dict[str, Any] = {"phase": args.phase, "runs": runs}
    if args.profile:
        main = _new_profiler()
        _PROFILING.set()
        cpu = time.process_time()
        main.enable()
        nbytes = runner(False)
        main.disable()
        _PROFILING.clear()
        result["profiled_cpu_s_per_gb"] = (time.process_time() - cpu) / (nbytes / GB)
        stats = _profile_stats()
        result["buckets_s_per_gb"] = {
            k: v / (nbytes / GB) for k, v in sorted(buckets_of(stats).items())
        }
        if args.dump:
            stats.dump_stats(f"{args.dump}.{args.phase}.prof")
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: a server, then each phase in a child --------------------------------------------


def _table(results: list[dict[str, Any]]) -> str:
    lines = []
    for result in results:
        runs = result["runs"]
        med = sorted(runs, key=lambda r: r["client_cpu_s_per_gb"])[len(runs) // 2]
        lines.append(
            f"{result['phase']:>8}: client {min(r['client_cpu_s_per_gb'] for r in runs):.2f}"
            f" (median {med['client_cpu_s_per_gb']:.2f}) CPU-s/GB, server "
            f"{med['server_cpu_s_per_gb']:.2f} CPU-s/GB, {med['mb_per_s']:.0f} MB/s "
            f"(runs: {', '.join(format(r['client_cpu_s_per_gb'], '.2f') for r in runs)})"
        )
        if "buckets_s_per_gb" in result:
            lines.append(f"          profiled: {result['profiled_cpu_s_per_gb']:.2f} CPU-s/GB")
            for bucket, value in sorted(result["buckets_s_per_gb"].items(), key=lambda kv: -kv[1]):
                lines.append(f"         {bucket:<40} {value:6.3f}")
    return "\n".join(lines)


def parent(args: argparse.Namespace) -> None:
    from cloudckpt.bench.servers import (  # noqa: PLC0415
        SEAWEEDFS_BENCH_MEMORY_LIMIT,
        seaweedfs_s3,
    )
    from cloudckpt.config import parse_size  # noqa: PLC0415

    size = parse_size(args.size)
    results = []
    with seaweedfs_s3(SEAWEEDFS_BENCH_MEMORY_LIMIT) as server:
        import boto3  # type: ignore[import-untyped]  # noqa: PLC0415

        from cloudckpt.bench.servers import (  # noqa: PLC0415
            SEAWEEDFS_KEY,
            SEAWEEDFS_REGION,
            SEAWEEDFS_SECRET,
        )

        bucket = f"cloudckpt-profile-{uuid.uuid4().hex[:8]}"
        options = {
            "endpoint_url": server.endpoint,
            "key": SEAWEEDFS_KEY,
            "secret": SEAWEEDFS_SECRET,
            "client_kwargs": {"region_name": SEAWEEDFS_REGION},
        }
        boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=SEAWEEDFS_KEY,
            aws_secret_access_key=SEAWEEDFS_SECRET,
            region_name=SEAWEEDFS_REGION,
        ).create_bucket(Bucket=bucket)
        for phase in args.phases:
            argv = [
                sys.executable,
                __file__,
                "--child",
                "--phase",
                phase,
                "--size",
                str(size),
                "--repeat",
                str(args.repeat),
                "--uri",
                f"s3://{bucket}",
                "--options",
                json.dumps(options),
                "--server-pid",
                str(server.process.pid),
                *(["--profile"] if args.profile else []),
                *(["--dump", args.dump] if args.dump else []),
            ]
            out = subprocess.run(argv, capture_output=True, text=True, check=False)
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode or not line:
                raise SystemExit(f"{phase} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
            results.append(json.loads(line[0][len("RESULT ") :]))
    print(f"size {size / 2**20:.0f} MiB, one process, SeaweedFS on loopback")
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--phases", nargs="+", default=["save", "buffered", "raw"], choices=PHASES)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dump", help="write the profiles to DUMP.<phase>.prof")
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.size = int(args.size)
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
