"""The phases of cloudckpt that each rank of ``cloudckpt bench`` times in a round: a
save and a load of it (checked against the state), the same through the fully parallel
wrappers (``fully_parallel``), the host copy staging must at least make, an async save,
and with ``constant_structure`` (torch_dist) two more async saves through one save
strategy kept for the whole run, with ``cached_metadata=True``; plus the untimed warm-up
before the first round. Every phase starts and ends with a barrier."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import cloudckpt
from cloudckpt.bench.measure import RankFigures, _measured, peak_rss, reset_peak_rss
from cloudckpt.bench.options import BenchOptions, _config
from cloudckpt.bench.workload import WorkloadSpec, load_target, local_tensors
from cloudckpt.dict_utils import nested_values
from cloudckpt.mapping import ShardedTensor, StateDict
from cloudckpt.serialization import get_default_save_sharded_strategy
from cloudckpt.storage import open_checkpoint
from cloudckpt.storage.pool import process_stats
from cloudckpt.strategies.base import LoadShardedStrategy, StrategyAction, get_default_strategy
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy
from cloudckpt.tracker import remove_checkpoint


def _barrier() -> None:
    torch.distributed.barrier()


def _save(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    strategy: Any = None,
    validate: bool = True,
    *,
    asynchronous: bool = False,
) -> Any:
    """``cloudckpt.save`` as the bench runs it; the request of an async save."""
    return cloudckpt.save(
        state,
        uri,
        sharded_strategy=strategy,
        validate_access_integrity=validate,
        async_sharded_save=asynchronous,
        storage_options=options.storage_options,
        config=_config(options),
    )


def _load(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    into: list[StateDict],
    strategy: LoadShardedStrategy | None = None,
) -> None:
    loaded = cloudckpt.load(
        state,
        uri,
        strategy,
        storage_options=options.storage_options,
        config=_config(options),
    )
    assert isinstance(loaded, dict)
    into.append(loaded)


def _copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What staging must at least do: one copy of every local tensor."""
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _async_save(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    strategy: Any = None,
    validate: bool = True,
) -> tuple[float, float]:
    """An async save: its blocking time (until ``save`` returns on this rank), then the
    whole of it (until the request ran and committed on every rank)."""
    _barrier()
    start = time.perf_counter()
    request = _save(state, uri, options, strategy, validate, asynchronous=True)
    blocking = time.perf_counter() - start
    assert request is not None
    request.execute_sync()
    _barrier()
    return blocking, time.perf_counter() - start


def _count_objects(uri: str, options: BenchOptions) -> int:
    storage = open_checkpoint(uri, storage_options=options.storage_options)
    return len(storage.list())


def _remove(uri: str, options: BenchOptions, rank: int) -> None:
    _barrier()
    if rank == 0:
        remove_checkpoint(uri, storage_options=options.storage_options)
    _barrier()


def _check_loaded(loaded: StateDict, saved: StateDict) -> None:
    """Every tensor loaded equals the one saved (the load really happened, and a fully
    parallel load received what the other ranks read)."""
    for group in ("model", "optimizer"):
        section = saved[group]
        assert isinstance(section, dict)
        for key, item in section.items():
            got = loaded[group][key]
            if not isinstance(got, torch.Tensor) or not torch.equal(got, _data(item)):
                raise AssertionError(
                    f"cloudckpt bench: tensor {key!r} loaded differs from the one saved"
                )


def _data(item: Any) -> torch.Tensor:
    assert isinstance(item, ShardedTensor) and item.data is not None
    return item.data


@dataclass(frozen=True)
class _Strategies:
    """The save and load strategies of a round's second save and load (None: defaults).

    Attributes:
        suffix: the phases' suffix (``""`` for plain, ``"_fully_parallel"``).
    """

    suffix: str
    save: Any = None
    load: LoadShardedStrategy | None = None


def _dp_group(spec: WorkloadSpec, rank: int) -> Any:
    """This rank's data-parallel group (every rank creates every group, in order)."""
    groups = [
        torch.distributed.new_group([r for r in range(spec.world_size) if r % spec.tp == t])
        for t in range(spec.tp)
    ]
    return groups[rank % spec.tp]


def fully_parallel_strategies(
    spec: WorkloadSpec, rank: int, backend: str, cache: bool = False
) -> _Strategies:
    """The backend's default strategies wrapped to spread over the data-parallel group;
    ``cache``: ``do_cache_distribution`` (Megatron-LM passes its
    ``ckpt_assume_constant_structure``). Collective (it creates the groups)."""
    group = _dp_group(spec, rank)
    save = get_default_save_sharded_strategy(backend)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, backend, 1)
    return _Strategies(
        "_fully_parallel",
        FullyParallelSaveStrategyWrapper(save, group, do_cache_distribution=cache),
        FullyParallelLoadStrategyWrapper(load, group, do_cache_distribution=cache),
    )


@contextlib.contextmanager
def _replicas_kept(state: StateDict) -> Iterator[None]:
    """Restore every ShardedTensor's ``replica_id`` after the block (the fully parallel
    save rewrites them in place; the next plain save must see the workload's own)."""
    shards = [sh for sh in nested_values(state) if isinstance(sh, ShardedTensor)]
    kept = [sh.replica_id for sh in shards]
    try:
        yield
    finally:
        for sh, replica_id in zip(shards, kept, strict=True):
            sh.replica_id = replica_id


def _save_and_load(
    figures: RankFigures,
    spec: WorkloadSpec,
    state: StateDict,
    rank: int,
    ckpt: str,
    options: BenchOptions,
    strategies: _Strategies,
) -> None:
    """A save, then a load of it checked against the state; the checkpoint removed."""
    save_phase, load_phase = f"save{strategies.suffix}", f"load{strategies.suffix}"
    with _replicas_kept(state):
        _measured(figures, save_phase, lambda: _save(state, ckpt, options, strategies.save))
    if rank == 0:
        figures.objects[save_phase] = _count_objects(ckpt, options)
    loaded: list[StateDict] = []
    target = load_target(spec, rank)
    _measured(figures, load_phase, lambda: _load(target, ckpt, options, loaded, strategies.load))
    _check_loaded(loaded[0], state)
    target.clear()  # the loaded copy is not kept through the next phase
    loaded.clear()
    _remove(ckpt, options, rank)


def _cloudckpt_round(
    figures: RankFigures,
    spec: WorkloadSpec,
    state: StateDict,
    rank: int,
    run: str,
    options: BenchOptions,
    extra: RankExtras,
) -> None:
    ckpt = f"{run}/ckpt-{uuid.uuid4().hex[:6]}" if rank == 0 else ""
    ckpt = _broadcast(ckpt)
    _save_and_load(figures, spec, state, rank, ckpt, options, _Strategies(""))
    if extra.parallel is not None:
        _save_and_load(figures, spec, state, rank, f"{ckpt}-fp", options, extra.parallel)
    async_ckpt = f"{ckpt}-async"
    figures.timed("copy_to_host", lambda: _copy_to_host(local_tensors(state)))
    figures.rss_reset = reset_peak_rss()
    before = process_stats().requests
    blocking, total = _async_save(state, async_ckpt, options)
    figures.record("async_blocking", blocking)
    figures.record("async_total", total)
    figures.requests["async_total"] = process_stats().requests - before
    figures.peak_rss["async_save"] = max(peak_rss(), figures.peak_rss.get("async_save", 0))
    _remove(async_ckpt, options, rank)
    if extra.constant is not None:
        for number in range(2):
            _constant_structure_save(figures, state, f"{async_ckpt}-cs{number}", options, extra)


def _constant_structure_save(
    figures: RankFigures, state: StateDict, uri: str, options: BenchOptions, extra: RankExtras
) -> None:
    """An async save through the run's one cached-plan strategy: the run's first
    validates and plans; the later ones skip the validation, as Megatron-LM does."""
    first = extra.constant_saves == 0
    blocking, _ = _async_save(state, uri, options, extra.constant, validate=first)
    extra.constant_saves += 1
    figures.record("async_blocking_first" if first else "async_blocking_later", blocking)
    _remove(uri, options, rank=torch.distributed.get_rank())


@dataclass
class RankExtras:
    """What a rank keeps across rounds for the optional phases.

    Attributes:
        parallel: the fully parallel strategies (None: not measured).
        constant: the one cached-plan save strategy (None: not measured).
        constant_saves: async saves it made so far.
    """

    parallel: _Strategies | None = None
    constant: TorchDistSaveShardedStrategy | None = None
    constant_saves: int = 0


def _warm_up(rank: int, run: str, options: BenchOptions) -> None:
    """An untimed save and load of a tiny state: imports, the first collectives and the
    store's connections are not charged to the first round."""
    uri = f"{run}/warm-up"
    tensor = torch.arange(1024, dtype=torch.float32) + rank
    state: StateDict = {
        "w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, options.world_size))
    }
    _save(state, uri, options)
    _load(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", torch.empty_like(tensor), (0, rank, options.world_size)
            )
        },
        uri,
        options,
        [],
    )
    _remove(uri, options, rank)


def _broadcast(value: str) -> str:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return str(box[0])
