"""Check cloudckpt's CUDA paths on a machine with a GPU, and measure staging there.

    python benchmarks/check_cuda.py --size 2GiB --world-size 2 --dir /tmp/ck --json out.json

Not a test (CI has no GPU, and the suite never depends on one): a script to run by hand
where a GPU is present. It exits 2 without CUDA, 1 if a check failed, and prints one JSON
document of checks and figures. Every rank of ``--world-size`` processes (gloo) holds the
bench's synthetic GPT-like state (``cloudckpt.bench.workload``) on ``cuda:0`` (the ranks
share the one GPU), and then:

* ``sync_<backend>``: a save of the device state and a load into empty device tensors,
  every tensor equal (torch_dist and zarr);
* ``async``: three async torch_dist saves, each timed until ``save`` returns (what blocks
  training) against the two ways to copy the same tensors to host memory: a plain
  ``tensor.to("cpu")`` and copies into pinned buffers allocated beforehand. The pinned
  host buffers must be reused across saves: the second and third stage into the buffers
  of the first (when the state fits ``HostCopies``' limit), and every kept buffer is
  pinned;
* ``mutation``: after an async save has returned, every device tensor is changed in place
  (as the next training step would) before the upload runs; the checkpoint must hold the
  values of the save's time;
* ``overlap``: a training-like GPU step (12 bf16 matrix products) timed alone, then every
  step while an async save uploads in the background, driven as Megatron's loop drives it
  (``AsyncCallsQueue.schedule_async_request``, then ``maybe_finalize_async_calls`` every
  step), then after it. The ranks share the one GPU, so every rank's steps start together
  in all three (a barrier before each alone or after): ``slowdown`` is during / alone;
  ``slowdown_vs_after`` compares with the steps right after the save;
* ``blocking_profile`` (in ``async``): cProfile of a repeated async save's blocking part
  on rank 0 (with ``cached_metadata=True``, Megatron's ``ckpt_assume_constant_structure``);
* ``nccl_world1``: (rank 0 alone, after the gloo run) a save and load with a one-rank NCCL
  group, so object collectives go through CUDA tensors, with the fully parallel wrappers.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cloudckpt
from cloudckpt.bench.workload import build_state, plan_workload
from cloudckpt.config import parse_size
from cloudckpt.formats.host_copies import HOST_COPIES
from cloudckpt.mapping import ShardedTensor, is_main_replica
from cloudckpt.strategies.async_utils import AsyncCallsQueue
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

#: ``--dry-run-on-cpu`` runs every check with CPU tensors (to try this script without a GPU:
#: the figures then mean nothing, and the pinned-buffer checks are not made)
DEVICE = os.environ.get("CLOUDCKPT_CHECK_DEVICE", "cuda:0")
CUDA = DEVICE.startswith("cuda")


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _tensors(state: Any) -> list[ShardedTensor]:
    found: list[ShardedTensor] = []
    for group in ("model", "optimizer"):
        found += [v for v in state[group].values() if isinstance(v, ShardedTensor)]
    return found


def _to_device(state: Any) -> Any:
    for sh in _tensors(state):
        assert sh.data is not None
        sh.data = sh.data.to(DEVICE)
    _sync()
    return state


def _equal(loaded: Any, expected: dict[str, torch.Tensor]) -> None:
    for group in ("model", "optimizer"):
        for key, value in loaded[group].items():
            want = expected[f"{group}/{key}"]
            if not isinstance(value, torch.Tensor):
                raise AssertionError(f"{key!r} loaded as {type(value).__name__}")
            if value.device.type != torch.device(DEVICE).type:
                raise AssertionError(f"{key!r} loaded to {value.device}, not the GPU")
            if not torch.equal(value.cpu(), want):
                raise AssertionError(f"{key!r} differs from the saved values")


def _snapshot(state: Any) -> dict[str, torch.Tensor]:
    out = {}
    for group in ("model", "optimizer"):
        for key, sh in state[group].items():
            out[f"{group}/{key}"] = sh.data.detach().cpu().clone()
    return out


def _timed(fn: Callable[[], object]) -> float:
    _sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _best(fn: Callable[[], object], repeat: int = 3) -> float:
    return min(_timed(fn) for _ in range(repeat))


def _copy_pageable(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.to("cpu")


def _copy_pinned(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
    for t, b in zip(tensors, buffers, strict=True):
        b.copy_(t, non_blocking=True)
    _sync()


class _Checks:
    def __init__(self, rank: int, root: str) -> None:
        self.rank = rank
        self.root = root
        self.results: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        try:
            self.results[name] = {"ok": True, **fn()}
        except Exception as exc:  # noqa: BLE001 - a check's failure is reported, the others still run
            self.results[name] = {"ok": False, "error": traceback.format_exc(limit=8)}
            print(f"rank {self.rank}: {name} FAILED: {exc!r}", file=sys.stderr, flush=True)
        print(f"rank {self.rank}: {name}: {self.results[name]}", flush=True)
        dist.barrier()
        if self.rank == 0:  # each check's checkpoints removed: the disk holds one at a time
            shutil.rmtree(self.root, ignore_errors=True)
        dist.barrier()


def _sync_check(spec: Any, rank: int, root: str, backend: str) -> dict[str, Any]:
    state = _to_device(build_state(spec, rank))
    expected = _snapshot(state)
    uri = f"{root}/sync_{backend}"
    save_s = _timed(lambda: cloudckpt.save(state, uri, (backend, 1)))
    target = _to_device(build_state(spec, rank, empty=True))
    loaded: dict[str, Any] = {}
    load_s = _timed(lambda: loaded.update(cloudckpt.load(target, uri)))
    _equal(loaded, expected)
    return {"save_s": round(save_s, 4), "load_s": round(load_s, 4)}


def _kept_pinned() -> bool:
    buffers = HOST_COPIES.kept_buffers()
    return bool(buffers) and all(b.is_pinned() for b in buffers)


def _kept_ptrs() -> set[int]:
    return {b.data_ptr() for b in HOST_COPIES.kept_buffers()}


def _allocator_bytes() -> int | None:
    """Bytes of PyTorch's caching pinned-host allocator (active and cached), if it says."""
    if not CUDA:
        return None
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return None


def _empty_allocator_cache() -> None:
    if CUDA and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def _async_check(spec: Any, rank: int, root: str) -> dict[str, Any]:
    state = _to_device(build_state(spec, rank))
    tensors = [sh.data for sh in _tensors(state) if is_main_replica(sh.replica_id)]
    tensors = [t for t in tensors if t is not None]
    sizes = [t.numel() * t.element_size() for t in tensors]
    nbytes = sum(sizes)
    start = time.perf_counter()
    buffers = [torch.empty_like(t, device="cpu", pin_memory=CUDA) for t in tensors]
    pin_alloc = time.perf_counter() - start
    pageable = _best(lambda: _copy_pageable(tensors))
    pinned = _best(lambda: _copy_pinned(tensors, buffers))
    buffers.clear()
    _empty_allocator_cache()
    HOST_COPIES.clear()
    rss_before = _rss()
    plain, reused = _async_saves(state, f"{root}/plain", None)
    cached = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    constant, _ = _async_saves(state, f"{root}/constant", cached)
    profile = _blocking_profile(state, f"{root}/profiled", cached)  # collective
    figures = {
        "main_replica_bytes": nbytes,
        "hostcopies_pin": HOST_COPIES.pin,
        "kept_bytes": HOST_COPIES.kept_bytes,
        "registered_bytes": HOST_COPIES.registered_bytes,
        "allocator_bytes": _allocator_bytes(),
        "rss_growth_bytes": _rss() - rss_before,
        "limit_bytes": HOST_COPIES.limit_bytes,
        "kept_all_pinned": _kept_pinned(),
        "reused_on_saves_2_3": reused[1:],
        "copy_pageable_s": round(pageable, 4),
        "copy_pinned_s": round(pinned, 4),
        "pinned_GBps": round(nbytes / pinned / 1e9, 2),
        "pinned_alloc_s": round(pin_alloc, 4),
        "blocking_s": [round(b, 4) for b in plain],
        "blocking_over_pinned_copy": [round(b / pinned, 2) for b in plain],
        "blocking_over_pageable_copy": [round(b / pageable, 2) for b in plain],
        "constant_structure_blocking_s": [round(b, 4) for b in constant],
        "constant_structure_over_pinned_copy": [round(b / pinned, 2) for b in constant],
        "blocking_profile": profile if rank == 0 else "",
    }
    figures["allocator_mode"] = _allocator_mode(state, root, sizes)
    return figures


def _allocator_mode(state: Any, root: str, sizes: list[int]) -> dict[str, Any]:
    """The same async saves with every buffer from PyTorch's caching pinned allocator
    (what ``pin_memory=True`` gives), for comparison: its pinned bytes and blocking."""
    HOST_COPIES.clear()
    _empty_allocator_cache()
    rss_before = _rss()
    threshold = HOST_COPIES.register_min_bytes
    HOST_COPIES.register_min_bytes = 1 << 62
    try:
        blocking, reused = _async_saves(state, f"{root}/allocator", None)
        return {
            "blocking_s": [round(b, 4) for b in blocking],
            "reused_on_saves_2_3": reused[1:],
            "allocator_bytes": _allocator_bytes(),
            "rss_growth_bytes": _rss() - rss_before,
            "power_of_two_rounded_bytes": sum(_power_of_two(n) for n in sizes),
        }
    finally:
        HOST_COPIES.clear()
        HOST_COPIES.register_min_bytes = threshold


def _async_saves(state: Any, root: str, strategy: Any) -> tuple[list[float], list[bool]]:
    """Three async saves, run to the end one after another: the time each blocked, and
    whether it staged into the kept buffers of the one before."""
    blocking: list[float] = []
    reused: list[bool] = []
    for i in range(3):
        before = _kept_ptrs()
        request: list[Any] = []
        save = functools.partial(_async_save, state, f"{root}_{i}", request, strategy)
        blocking.append(_timed(save))
        request[0].execute_sync()
        dist.barrier()
        reused.append(bool(before) and before <= _kept_ptrs())
    return blocking, reused


def _blocking_profile(state: Any, root: str, strategy: Any) -> str:
    """cProfile of an async save's blocking part (a repeated, cached-plan one), top 15."""
    request: list[Any] = []
    profiler = cProfile.Profile()
    profiler.enable()
    _async_save(state, root, request, strategy)
    profiler.disable()
    request[0].execute_sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(15)
    return text.getvalue()


def _async_save(state: Any, uri: str, into: list[Any], strategy: Any = None) -> None:
    into.append(cloudckpt.save(state, uri, strategy, async_sharded_save=True))


def _mutation_check(spec: Any, rank: int, root: str) -> dict[str, Any]:
    state = _to_device(build_state(spec, rank))
    expected = _snapshot(state)
    uri = f"{root}/mutation"
    request = cloudckpt.save(state, uri, async_sharded_save=True)
    for sh in _tensors(state):
        sh.data.add_(1)  # the next training step, before the upload ran
    _sync()
    request.execute_sync()
    dist.barrier()
    loaded = cloudckpt.load(_to_device(build_state(spec, rank, empty=True)), uri)
    _equal(loaded, expected)
    return {"tensors": len(expected)}


def _overlap_check(spec: Any, rank: int, root: str) -> dict[str, Any]:
    """Training steps while an async save uploads in the background, driven as Megatron's
    loop drives it: ``schedule_async_request`` after the save, then every step
    ``maybe_finalize_async_calls`` (a collective) until the save is finalized."""
    state = _to_device(build_state(spec, rank))
    steps = _Steps()
    alone = _lockstep(steps, 8)[2:]  # the ranks share the GPU: their steps run together
    queue = AsyncCallsQueue()
    dist.barrier()
    start = time.perf_counter()
    queue.schedule_async_request(cloudckpt.save(state, f"{root}/overlap", async_sharded_save=True))
    blocked = time.perf_counter() - start
    during: list[float] = []
    while queue.get_num_unfinalized_calls():
        during.append(steps.one())
        queue.maybe_finalize_async_calls()
    upload = time.perf_counter() - start
    after = _lockstep(steps, 6)
    mean_alone, mean_during = statistics.mean(alone), statistics.mean(during)
    return {
        "step_alone_s": round(mean_alone, 5),
        "steps_during_upload": len(during),
        "step_during_upload_mean_s": round(mean_during, 5),
        "step_after_s": round(statistics.mean(after), 5),
        "slowdown": round(mean_during / mean_alone, 3),
        "slowdown_vs_after": round(mean_during / statistics.mean(after), 3),
        "save_blocked_s": round(blocked, 4),
        "save_to_finalized_s": round(upload, 4),
    }


def _lockstep(steps: _Steps, count: int) -> list[float]:
    """``count`` steps, every rank's started together (as the save's collectives make
    them during the upload): each step's time."""
    times = []
    for _ in range(count):
        dist.barrier()
        times.append(steps.one())
    return times


class _Steps:
    """A training-like GPU step: 12 chained bf16 matrix products (4096^3), then a wait."""

    def __init__(self, n: int = 4096) -> None:
        n = n if CUDA else 256
        self.a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)

    def one(self) -> float:
        start = time.perf_counter()
        a = self.a
        for _ in range(12):
            a = (a @ self.b).clamp_(-1, 1)
        _sync()
        return time.perf_counter() - start


def _rank_main(rank: int, world: int, port: int, size: int, root: str, out: str) -> None:
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    spec = plan_workload(size, world)
    checks = _Checks(rank, root)
    for backend in ("torch_dist", "zarr"):
        checks.run(f"sync_{backend}", lambda b=backend: _sync_check(spec, rank, root, b))
    checks.run("async", lambda: _async_check(spec, rank, root))
    checks.run("mutation", lambda: _mutation_check(spec, rank, root))
    checks.run("overlap", lambda: _overlap_check(spec, rank, root))
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(checks.results))


def _nccl_main(rank: int, port: int, size: int, root: str, out: str) -> None:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    spec = plan_workload(size, 1)
    checks = _Checks(0, root)

    def check() -> dict[str, Any]:
        state = _to_device(build_state(spec, 0))
        expected = _snapshot(state)
        uri = f"{root}/nccl"
        save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))
        save_s = _timed(lambda: cloudckpt.save(state, uri, save))
        load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
        loaded: dict[str, Any] = {}
        target = _to_device(build_state(spec, 0, empty=True))
        load_s = _timed(lambda: loaded.update(cloudckpt.load(target, uri, load)))
        _equal(loaded, expected)
        return {"save_s": round(save_s, 4), "load_s": round(load_s, 4)}

    checks.run("nccl_world1", check)
    dist.destroy_process_group()
    Path(out, "nccl.json").write_text(json.dumps(checks.results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB", help="state size over all ranks")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dir", default=None, help="a local directory to write under")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--dry-run-on-cpu",
        action="store_true",
        help="CPU tensors, gloo only: try the script without a GPU",
    )
    args = parser.parse_args(argv)
    if args.dry_run_on_cpu:
        os.environ["CLOUDCKPT_CHECK_DEVICE"] = "cpu"  # the spawned ranks read it
    elif not torch.cuda.is_available():
        print("check_cuda: no CUDA device here", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    root = tempfile.mkdtemp(prefix="cloudckpt-cuda-", dir=args.dir)
    out = tempfile.mkdtemp(prefix="cloudckpt-cuda-results-")
    try:
        mp.start_processes(
            _rank_main,
            (args.world_size, _free_port(), size, f"{root}/gloo", out),
            nprocs=args.world_size,
            start_method="spawn",
        )
        if not args.dry_run_on_cpu:
            mp.start_processes(
                _nccl_main,
                (_free_port(), size // args.world_size, f"{root}/nccl", out),
                nprocs=1,
                start_method="spawn",
            )
        results = {
            "device": torch.cuda.get_device_name(0) if not args.dry_run_on_cpu else "cpu",
            "torch": torch.__version__,
            "size": size,
            "world_size": args.world_size,
            "ranks": [
                json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world_size)
            ],
            "nccl": json.loads(Path(out, "nccl.json").read_text())
            if not args.dry_run_on_cpu
            else {},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    checks = [c for rank in results["ranks"] for c in rank.values()] + list(
        results["nccl"].values()
    )
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
