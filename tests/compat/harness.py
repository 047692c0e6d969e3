"""Run a function on N CPU ranks of a gloo group inside a Megatron-Core environment.

Megatron-Core's checkpointing calls ``torch.cuda.synchronize()`` (zarr save) and
allocates small flags on ``torch.cuda.current_device()`` (torch_dist save); on a CPU
build of torch both raise. :func:`make_cuda_harmless` replaces them in the rank
processes: synchronising is a no-op (nothing runs asynchronously on CPU) and the
"current device" is the CPU. This belongs to the test harness only, never to cloudckpt.

Ranks are ``spawn``ed processes (callers need an ``if __name__ == "__main__":`` guard),
rendezvous goes through a file store, and each rank's return value (JSON-able) comes
back to the parent; a rank's failure is reported with its traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch


def make_cuda_harmless() -> None:
    """Make the CUDA calls Megatron-Core's checkpointing makes work on a CPU-only torch."""
    if torch.cuda.is_available():
        return

    def synchronize(device: Any = None) -> None:
        return None

    def current_device() -> str:
        return "cpu"

    torch.cuda.synchronize = synchronize  # type: ignore[assignment]
    torch.cuda.current_device = current_device  # type: ignore[assignment]


def _rank_main(
    rank: int,
    world: int,
    store: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore")
    make_cuda_harmless()
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world
        )
        try:
            results.put((rank, True, fn(rank, world, *args)))
        finally:
            torch.distributed.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _collect(procs: list[Any], results: Any, timeout_s: float) -> dict[int, tuple[bool, Any]]:
    """Every rank's (ok, payload); a rank that died or hung without reporting fails."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    dead_seen: dict[int, float] = {}
    while len(outcomes) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.5)
            outcomes[rank] = (ok, payload)
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            # a rank that exited: give the queue a moment to deliver what it put first
            if (
                r not in outcomes
                and p.exitcode is not None
                and now - dead_seen.setdefault(r, now) > 3
            ):
                outcomes[r] = (False, f"rank process exited with code {p.exitcode}")
        if now > deadline:
            for r in range(len(procs)):
                outcomes.setdefault(r, (False, f"timed out after {timeout_s:.0f} s"))
    return outcomes


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 240.0
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return results by rank.

    Raises:
        RuntimeError: a rank failed (with every failed rank's traceback) or timed out.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="mcore-compat-rdzv-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store, fn, args, results))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        try:
            outcomes = _collect(procs, results, timeout_s)
        finally:
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = {r: out for r, (ok, out) in outcomes.items() if not ok}
    if failed:
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failed)}:\n{detail}"
        )
    return [outcomes[r][1] for r in range(world)]


def log(message: str) -> None:
    """Progress on stderr (stdout is kept for the caller)."""
    print(f"[mcore-compat] {message}", file=sys.stderr, flush=True)
