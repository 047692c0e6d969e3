"""Megatron-Core's side of ``benchmarks/compare.py``: run in the compat environment.

    <compat python> benchmarks/_compare_mcore.py --size BYTES --world-size N --dir DIR

Saves ``cloudckpt bench``'s workload, built with Megatron-Core's ShardedTensor and
ShardedObject, with ``dist_checkpointing.save`` (torch_dist, its default) to DIR and
loads it back; prints ``{"save": seconds, "load": seconds}`` (the slowest rank's, each
between two barriers) as the last line of stdout. Needs the repository root on
``PYTHONPATH`` (cloudckpt's workload) and ``tests/compat/harness.py`` (CPU ranks).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "compat"))

import harness  # noqa: E402 - tests/compat, after the path set-up
import torch  # noqa: E402

from cloudckpt.bench.workload import build_state, load_target, plan_workload  # noqa: E402


def _timed(fn: Callable[[], object]) -> float:
    torch.distributed.barrier()
    start = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - start


def _rank(rank: int, world: int, size: int, directory: str) -> tuple[float, float]:
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    from megatron.core.dist_checkpointing.mapping import (  # noqa: PLC0415
        ShardedObject,
        ShardedTensor,
    )

    spec = plan_workload(size, world)
    classes: dict[str, Any] = {"tensor_cls": ShardedTensor, "object_cls": ShardedObject}
    state = build_state(spec, rank, **classes)
    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
    save = _timed(lambda: dist_checkpointing.save(state, directory))
    target = load_target(spec, rank, **classes)
    load = _timed(lambda: dist_checkpointing.load(target, directory))
    return save, load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    times = harness.run_ranks(_rank, args.world_size, args.size, args.dir, timeout_s=1800)
    print(json.dumps({"save": max(t[0] for t in times), "load": max(t[1] for t in times)}))


if __name__ == "__main__":
    main()
