"""What each rank of ``cloudckpt bench`` measures, and the run that gathers it.

Every rank builds its part of the workload (:mod:`.workload`), then, ``repeat`` times
and interleaved (raw, cloudckpt, raw, cloudckpt), times: the raw write, cloudckpt's
save, the raw read, cloudckpt's load, and an async save (the time until
``cloudckpt.save(..., async_sharded_save=True)`` returns, then until the request has
run and committed). Each phase starts and ends with a barrier; its time is the slowest
rank's, with the CPU time each rank process spent in it and, when the store runs on this
host (``server_pid``), the store process's (:mod:`.clock`). Around cloudckpt's phases
each rank records its peak resident memory (Linux: ``VmHWM`` reset through
``/proc/self/clear_refs``; else ``ru_maxrss``, the peak so far) and the storage requests
it issued (cloudckpt's own counters: S3 data requests; local files are not counted), and
for loads the reads and bytes read (on every store).

With ``fully_parallel``, each round also saves with Megatron-Core's
``FullyParallelSaveStrategyWrapper`` and loads with ``FullyParallelLoadStrategyWrapper``
over the workload's data-parallel group, right after the plain save and load of the same
round (plain, fully parallel, plain, ...): phases ``save_fully_parallel`` and
``load_fully_parallel``. With ``constant_structure`` (torch_dist), each round makes two
more async saves through one save strategy kept for the whole run, with
``cached_metadata=True`` (Megatron-Core's ``ckpt_assume_constant_structure``): the
run's first such save plans and validates (``async_blocking_first``); the later ones
reuse the plan and skip the validation of the sharding, as Megatron-LM does
(``async_blocking_later``).

The parts: :mod:`.options` (the run's options), :mod:`.measure` (a rank's figures and how
a phase is measured), :mod:`.phases` (cloudckpt's phases), :mod:`.raw_rounds` (the raw
baselines); this module runs them on every rank and gathers the figures.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import traceback
import uuid
from dataclasses import asdict
from typing import Any

from cloudckpt.bench import raw
from cloudckpt.bench.measure import RankFigures
from cloudckpt.bench.options import BenchOptions
from cloudckpt.bench.phases import RankExtras, _cloudckpt_round, _warm_up, fully_parallel_strategies
from cloudckpt.bench.raw_rounds import _raw_local_round, _raw_s3_round
from cloudckpt.bench.workload import (
    WorkloadSpec,
    build_state,
    local_tensors,
    plan_workload,
    rank_share,
)
from cloudckpt.launch import run_on_ranks
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy

logger = logging.getLogger(__name__)

MB = 1e6


# -- a rank ----------------------------------------------------------------------------------


def bench_rank(rank: int, world_size: int, options: BenchOptions, run: str) -> dict[str, Any]:
    """Run every phase on this rank; return its :class:`RankFigures` as a dict.

    A rank that fails prints its traceback and exits: the others wait for it in a
    barrier, and the pool fails the run as soon as it sees a rank process gone."""
    try:
        return _bench_rank(rank, world_size, options, run)
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _bench_rank(rank: int, world_size: int, options: BenchOptions, run: str) -> dict[str, Any]:
    spec = plan_workload(options.size_bytes, world_size)
    figures = RankFigures(server_pid=options.server_pid)
    state = build_state(spec, rank)
    figures.state_bytes = sum(t.numel() * t.element_size() for t in local_tensors(state))
    share = rank_share(state, spec, rank)
    figures.share_bytes = sum(t.numel() * t.element_size() for t in share.values())
    _warm_up(rank, run, options)
    extra = RankExtras()
    if options.fully_parallel:
        extra.parallel = fully_parallel_strategies(
            spec, rank, options.backend, cache=options.constant_structure
        )
    if options.constant_structure:
        extra.constant = TorchDistSaveShardedStrategy(cached_metadata=True)
    for _ in range(options.repeat):
        if options.is_s3:
            _raw_s3_round(figures, share, rank, run, options)
        else:
            _raw_local_round(figures, share, rank, run)
        _cloudckpt_round(figures, spec, state, rank, run, options, extra)
    figures.peak_rss["run"] = max(_run_peak(), *figures.peak_rss.values())
    return asdict(figures)


def _run_peak() -> int:
    """The peak RSS of the whole run (ru_maxrss is never reset by clear_refs)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_bench(options: BenchOptions) -> tuple[WorkloadSpec, list[dict[str, Any]], str]:
    """Run the benchmark on ``options.world_size`` fresh rank processes.

    Returns:
        The workload, every rank's figures, and the run's URI (removed after).
    """
    spec = plan_workload(options.size_bytes, options.world_size)
    run = f"{options.uri.rstrip('/')}/cloudckpt-bench-{uuid.uuid4().hex[:8]}"
    logger.info("cloudckpt bench: %s on %d ranks under %s", spec, options.world_size, run)
    try:
        figures = run_on_ranks(
            bench_rank, options.world_size, (options, run), timeout_s=options.timeout_s
        )
    finally:
        if not options.is_s3:
            import shutil  # noqa: PLC0415

            shutil.rmtree(raw.local_path(run), ignore_errors=True)
    return spec, figures, run
