"""Peak host memory of a cloudckpt save to S3, against the bound the issue sets.

The bound: a save holds at most ``2 x part size x requests in flight`` bytes on top of
the state it writes (parts go up straight from the tensors' memory, so in practice far
less). The measured save runs in a fresh child process, so neither this parent nor the
S3 server (moto runs as its own process) shows up in its RSS:

1. the child builds ``--tensors`` float32 ShardedTensors totalling ``--gib`` GiB, filled
   with random values so their pages are resident;
2. unless ``--cold``, it saves a 1 MiB warm-up checkpoint first, so one-time costs
   (imports, the S3 client and its service model) are not counted as per-save memory;
3. baseline RSS: VmRSS after the state is built (interpreter + torch + state), with
   freed heap handed back to the OS (``malloc_trim``) so no slack hides new memory;
4. the peak: VmHWM of the save, reset through ``/proc/self/clear_refs`` beforehand
   (or, where that is refused, the highest VmRSS sampled every 5 ms);
5. the checkpoint is verified: tensor metadata, and every tensor read back and
   compared with the original;
6. a second save with ``tracemalloc`` on gives the Python heap peak (Python objects
   and numpy buffers only; tensor memory and C libraries are invisible to it), and
   with ``--top N`` a third save prints the allocation sites (file:line) at the
   Python heap's high-water mark;
7. baseline in the same run: the same bytes cut into part-size objects and uploaded
   with plain boto3 ``put_object`` in a pool of ``--in-flight`` threads.

PASS means peak RSS <= baseline RSS + 2 x part size x in-flight, i.e. the memory the
save adds on top of the process and its state stays within the bound. The script exits
0 either way (1 on FAIL with ``--strict``). Against moto, started here by default:

    .venv/bin/python benchmarks/bench_memory_s3.py [--gib 1] [--part-mib 32] [--in-flight 16]

or against an existing endpoint (credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY):

    .venv/bin/python benchmarks/bench_memory_s3.py --endpoint http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3  # type: ignore[import-untyped]
import botocore.config  # type: ignore[import-untyped]
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PART_SIZE,
    CheckpointConfig,
    GiB,
    MiB,
)
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.storage.buffers import plan_parts

REPO_ROOT = Path(__file__).resolve().parents[1]
REGION = "us-east-1"
MOTO_KEY, MOTO_SECRET = "testing-key", "testing-secret"
SAMPLE_INTERVAL_S = 0.005
SNAPSHOT_POLL_S = 0.01
SNAPSHOT_GROWTH = 1.25  # a new snapshot when the Python heap grew by this factor
SNAPSHOT_MIN_BYTES = 4 * MiB
WARMUP_BYTES = MiB


# -- memory probes --------------------------------------------------------------


def _status_kib(field_name: str) -> int:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        match = re.search(rf"^{field_name}:\s+(\d+)\s+kB", status.read(), re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field_name}")
    return int(match.group(1))


def rss() -> int:
    """This process's resident set size in bytes."""
    return _status_kib("VmRSS") * 1024


def trim_heap() -> None:
    """Collect garbage and return free heap pages to the OS (glibc), so the baseline
    holds no slack the save could reuse unseen."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS; True where the kernel did."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    # VmHWM never lags RSS; after a reset it sits at (about) the current RSS.
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 1024


@dataclass
class PeakMeter:
    """The peak RSS of a stretch of code: VmHWM after a reset, or 5 ms RSS samples."""

    method: str = ""
    _peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        if _reset_hwm():
            self.method = "VmHWM after a reset through /proc/self/clear_refs"
            return
        self.method = f"max VmRSS sampled every {SAMPLE_INTERVAL_S * 1000:.0f} ms"
        self._peak = rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._peak = max(self._peak, rss())

    def stop(self) -> int:
        """The peak RSS in bytes since :meth:`start`."""
        if self._thread is None:
            return _status_kib("VmHWM") * 1024
        self._stop.set()
        self._thread.join()
        return max(self._peak, rss())


@dataclass
class HeapSnapshots:
    """Snapshots of the Python heap whenever it reaches a new high (a polling thread)."""

    top: int
    best: tracemalloc.Snapshot | None = None
    best_bytes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HeapSnapshots:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(SNAPSHOT_POLL_S):
            current, _ = tracemalloc.get_traced_memory()
            if current >= max(SNAPSHOT_MIN_BYTES, self.best_bytes * SNAPSHOT_GROWTH):
                self.best, self.best_bytes = None, current  # drop the old one first
                self.best = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)]
                )

    def lines(self) -> list[str]:
        if self.best is None:
            return [f"  (the Python heap never exceeded {SNAPSHOT_MIN_BYTES / MiB:.0f} MiB)"]
        stats = self.best.statistics("lineno")[: self.top]
        head = f"  snapshot at {self.best_bytes / MiB:.1f} MiB traced; top {len(stats)} sites:"
        return [head] + [
            f"    {s.size / MiB:9.2f} MiB in {s.count:6d} blocks  "
            f"{s.traceback[0].filename}:{s.traceback[0].lineno}"
            for s in stats
        ]


# -- the child: build, save, measure, verify ------------------------------------------


def build_state(gib: float, count: int) -> dict[str, ShardedTensor]:
    """``count`` float32 tensors of ``(rows, 1024)`` totalling about ``gib`` GiB."""
    rows = max(int(gib * GiB) // 4 // count // 1024, 1)
    return {
        f"layer{i}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", torch.randn(rows, 1024)
        )
        for i in range(count)
    }


def state_nbytes(state: dict[str, ShardedTensor]) -> int:
    return sum(len(tensor_bytes(data)) for data in _tensors(state).values())


def _tensors(state: dict[str, ShardedTensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, sh in state.items():
        if sh.data is None:
            raise RuntimeError(f"{key}: no data")
        out[key] = sh.data
    return out


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Target:
    """Where the child writes and how it signs in."""

    endpoint: str
    bucket: str
    key: str
    secret: str

    def storage_options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"region_name": REGION},
        }

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/bench/{name}"

    def boto3_client(self, pool: int) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name=REGION,
            config=botocore.config.Config(max_pool_connections=max(10, pool)),
        )


def save(state: dict[str, ShardedTensor], target: Target, name: str, cfg: CheckpointConfig) -> None:
    cloudckpt.save(state, target.uri(name), storage_options=target.storage_options(), config=cfg)


def warm_up(target: Target, cfg: CheckpointConfig) -> None:
    small = torch.randn(WARMUP_BYTES // 4)
    save({"warmup": ShardedTensor.from_rank_offsets("warmup", small)}, target, "warmup", cfg)


def verify(state: dict[str, ShardedTensor], target: Target, name: str) -> str:
    """Check the saved checkpoint: metadata of every tensor, then each tensor's data."""
    uri, options = target.uri(name), target.storage_options()
    meta = cloudckpt.load_tensors_metadata(uri, storage_options=options)
    if set(meta) != set(state):
        raise RuntimeError(f"checkpoint holds {sorted(meta)}, expected {sorted(state)}")
    for key, original in _tensors(state).items():
        if tuple(meta[key].global_shape) != tuple(original.shape):
            raise RuntimeError(f"{key}: stored shape {meta[key].global_shape}")
        request = {key: ShardedTensor.from_rank_offsets(key, torch.empty_like(original))}
        loaded = cloudckpt.load(request, uri, storage_options=options)
        if not isinstance(loaded, dict) or not torch.equal(loaded[key], original):
            raise RuntimeError(f"{key}: the tensor read back differs from the one saved")
        del loaded, request
    return f"OK ({len(state)} tensors: metadata, and every tensor read back equal)"


def delete_prefix(target: Target, name: str) -> None:
    """Remove a saved checkpoint (keeps moto's memory down between passes)."""
    client = target.boto3_client(1)
    prefix = f"bench/{name}/"
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=target.bucket, Prefix=prefix
    ):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=target.bucket, Delete={"Objects": keys, "Quiet": True})
    client.close()


def raw_put(state: dict[str, ShardedTensor], target: Target, part: int, workers: int) -> float:
    """Seconds to upload the state's bytes, as part-size objects, with plain boto3."""
    pieces = [
        (f"bench/raw/{key}/{n}", bytes(view[a:b]))
        for key, data in _tensors(state).items()
        for view in (tensor_bytes(data),)
        for n, (a, b) in enumerate(plan_parts(view.nbytes, part))
    ]
    client = target.boto3_client(workers)

    def put(item: tuple[str, bytes]) -> None:
        client.put_object(Bucket=target.bucket, Key=item[0], Body=item[1])

    with ThreadPoolExecutor(workers) as pool:
        seconds = timed(lambda: list(pool.map(put, pieces)))
    client.close()
    return seconds


@dataclass
class Measurement:
    baseline: int = 0
    peak: int = 0
    method: str = ""
    save_s: float = 0.0
    heap_peak: int | None = None
    verified: str = ""
    sites: list[str] = field(default_factory=list)


def measure_rss(
    state: dict[str, ShardedTensor], target: Target, cfg: CheckpointConfig
) -> Measurement:
    trim_heap()
    result = Measurement(baseline=rss())
    meter = PeakMeter()
    meter.start()
    result.save_s = timed(lambda: save(state, target, "iter_1", cfg))
    result.peak = meter.stop()
    result.method = meter.method
    return result


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def heap_peak(state: dict[str, ShardedTensor], target: Target, cfg: CheckpointConfig) -> int:
    """Python heap peak (tracemalloc) of a second save."""
    trim_heap()
    with tracing():
        save(state, target, "iter_2", cfg)
        _, peak = tracemalloc.get_traced_memory()
    delete_prefix(target, "iter_2")
    return peak


def heap_sites(
    state: dict[str, ShardedTensor], target: Target, cfg: CheckpointConfig, top: int
) -> list[str]:
    """Top allocation sites at the Python heap's high-water mark of a third save."""
    trim_heap()
    with tracing(), HeapSnapshots(top) as snapshots:
        save(state, target, "iter_3", cfg)
    delete_prefix(target, "iter_3")
    return snapshots.lines()


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:9.1f} MiB"


def report(
    args: argparse.Namespace, cfg: CheckpointConfig, nbytes: int, m: Measurement, raw_s: float
) -> bool:
    bound = 2 * cfg.part_size * cfg.max_in_flight
    extra = m.peak - m.baseline
    ok = extra <= bound
    mb = nbytes / 1e6
    chunk = "None (one object per shard)" if cfg.chunk_size is None else _mib(cfg.chunk_size)
    lines = [
        f"state: {args.tensors} float32 tensors, {_mib(nbytes).strip()} ({mb:.0f} MB)",
        f"config: part_size {_mib(cfg.part_size).strip()}, max_in_flight {cfg.max_in_flight}, "
        f"chunk_size {chunk.strip()}",
        f"warm-up: {'none (--cold)' if args.cold else '1 MiB save before measuring'}",
        f"peak measured as: {m.method}",
        f"  baseline RSS (process + state): {_mib(m.baseline)}",
        f"    of which process overhead:   {_mib(m.baseline - nbytes)}",
        f"  peak RSS during save:           {_mib(m.peak)}",
        f"  extra memory during save:       {_mib(extra)}",
        f"  bound 2 x part x in-flight:     {_mib(bound)}",
        f"  extra / bound:                  {extra / bound:9.3f}",
        f"  extra / (part x in-flight):     {extra / (bound / 2):9.3f}",
    ]
    if m.heap_peak is not None:
        lines.append(f"  Python heap peak (tracemalloc): {_mib(m.heap_peak)}")
    lines += [
        f"  cloudckpt save: {m.save_s:7.3f} s  {mb / m.save_s:9.1f} MB/s",
        f"  raw put:        {raw_s:7.3f} s  {mb / raw_s:9.1f} MB/s  "
        f"(boto3 put_object of part-size bytes, {cfg.max_in_flight} threads)",
        f"  save / raw put throughput ratio: {raw_s / m.save_s:.2f}",
        f"  verify: {m.verified}",
    ]
    if m.sites:
        lines += ["Python heap allocation sites at its high-water mark:", *m.sites]
    verdict = "PASS" if ok else "FAIL"
    lines.append(
        f"check peak RSS <= baseline + 2 x part x in-flight "
        f"({_mib(m.peak).strip()} <= {_mib(m.baseline + bound).strip()}): {verdict}"
    )
    print("\n".join(lines), flush=True)
    return ok


def make_config(args: argparse.Namespace) -> CheckpointConfig:
    return CheckpointConfig(
        part_size=args.part_mib * MiB,
        max_in_flight=args.in_flight,
        chunk_size=args.chunk_mib * MiB if args.chunk_mib else None,
    )


def run_child(args: argparse.Namespace) -> int:
    target = Target(
        args.endpoint,
        args.bucket,
        os.environ["AWS_ACCESS_KEY_ID"],
        os.environ["AWS_SECRET_ACCESS_KEY"],
    )
    cfg = make_config(args)
    state = build_state(args.gib, args.tensors)
    if not args.cold:
        warm_up(target, cfg)
    measurement = measure_rss(state, target, cfg)
    measurement.verified = verify(state, target, "iter_1")
    delete_prefix(target, "iter_1")
    if not args.no_tracemalloc:
        measurement.heap_peak = heap_peak(state, target, cfg)
    if args.top:
        measurement.sites = heap_sites(state, target, cfg, args.top)
    raw_s = raw_put(state, target, cfg.part_size, cfg.max_in_flight)
    ok = report(args, cfg, state_nbytes(state), measurement, raw_s)
    return 1 if args.strict and not ok else 0


# -- the parent: server, bucket, child -------------------------------------------------


def _empty_bucket(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )


def _child_argv(args: argparse.Namespace, endpoint: str, bucket: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child"]
    argv += ["--endpoint", endpoint, "--bucket", bucket, "--gib", str(args.gib)]
    argv += ["--part-mib", str(args.part_mib), "--in-flight", str(args.in_flight)]
    argv += ["--tensors", str(args.tensors), "--chunk-mib", str(args.chunk_mib)]
    argv += ["--top", str(args.top)]
    flags = {"--cold": args.cold, "--strict": args.strict, "--no-tracemalloc": args.no_tracemalloc}
    return argv + [flag for flag, on in flags.items() if on]


def _run_against(args: argparse.Namespace, endpoint: str, key: str, secret: str) -> int:
    target = Target(endpoint, f"cloudckpt-bench-{uuid.uuid4().hex[:12]}", key, secret)
    client = target.boto3_client(1)
    client.create_bucket(Bucket=target.bucket)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    print(
        f"S3 endpoint {endpoint}, bucket {target.bucket}; measuring in a child process", flush=True
    )
    try:
        return subprocess.run(
            _child_argv(args, endpoint, target.bucket), env=env, check=False
        ).returncode
    finally:
        _empty_bucket(client, target.bucket)
        client.delete_bucket(Bucket=target.bucket)
        client.close()


def run_parent(args: argparse.Namespace) -> int:
    if args.endpoint:
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            sys.exit("--endpoint needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return _run_against(args, args.endpoint, key, secret)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests.servers import start_moto_s3  # noqa: PLC0415 - needs the repo root on sys.path

    server = start_moto_s3()
    try:
        return _run_against(args, server.endpoint, MOTO_KEY, MOTO_SECRET)
    finally:
        server.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    parser.add_argument("--part-mib", type=int, default=DEFAULT_PART_SIZE // MiB)
    parser.add_argument("--in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument(
        "--chunk-mib", type=int, default=DEFAULT_CHUNK_SIZE // MiB, help="zarr chunk size; 0: None"
    )
    parser.add_argument("--endpoint", default=None, help="an existing S3 endpoint (default: moto)")
    parser.add_argument("--cold", action="store_true", help="no warm-up save before measuring")
    parser.add_argument("--no-tracemalloc", action="store_true", help="skip the tracemalloc save")
    parser.add_argument(
        "--top", type=int, default=0, help="also print the top N Python allocation sites"
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when the check fails")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    sys.exit(run_child(args) if args.child else run_parent(args))


if __name__ == "__main__":
    main()
