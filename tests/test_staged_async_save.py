"""Async torch_dist saves that block only for the copy to host memory and the planning
(``TorchDistSaveShardedStrategy.stage_to``), and the plan cache of ``cached_metadata=True``
(Megatron-Core's ``ckpt_assume_constant_structure``), on 4 real gloo ranks.

The saves go through ``cloudckpt.save(..., async_sharded_save=True)``; every checkpoint is
loaded back and compared with what the ranks held when ``save`` returned.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.save import DcpPlannedWrite
from cloudckpt.strategies.async_utils import AsyncCallsQueue
from cloudckpt.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy

ROWS, COLS = 8, 6


def _state(rank: int, world: int, step: int, extra: bool = False) -> dict[str, Any]:
    """A row-sharded weight, a replicated bias (main replica on rank 0), a per-rank
    ShardedObject; ``extra`` adds a tensor of rank 3's own (a changed structure)."""
    weight = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 100 * step
    bias = torch.full((COLS,), float(step))
    state: dict[str, Any] = {
        "weight": ShardedTensor.from_rank_offsets(
            "weight", weight.chunk(world)[rank].clone(), (0, rank, world)
        ),
        "bias": ShardedTensor.from_rank_offsets("bias", bias.clone(), replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "iteration": step,
    }
    if extra and rank == 3:
        state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(5) * step)
    return state


def _check(uri: str, rank: int, world: int, step: int, extra: bool = False) -> None:
    expected = _state(rank, world, step, extra)
    request = _state(rank, world, 0, extra)
    for key in ("weight", "bias", "extra"):
        if key in request:
            request[key].data.zero_()
    loaded = cloudckpt.load(request, uri)
    assert isinstance(loaded, dict)
    for key in ("weight", "bias", "extra"):
        if key in expected:
            assert torch.equal(loaded[key], expected[key].data), (key, rank, step)
    assert loaded["rng"] == {"rank": rank, "step": step}
    assert loaded["iteration"] == step


def _async_save(state: dict[str, Any], uri: str, strategy: Any, validate: bool) -> None:
    """Save asynchronously, change every tensor once ``save`` returned (the training
    step), then finish the request."""
    request = cloudckpt.save(
        state,
        uri,
        sharded_strategy=strategy,
        validate_access_integrity=validate,
        async_sharded_save=True,
    )
    assert request is not None
    assert not cloudckpt.check_is_distributed_checkpoint(uri)  # nothing committed yet
    for value in state.values():
        if isinstance(value, ShardedTensor):
            value.data.fill_(-7.0)
    request.execute_sync()


def _cached_plans_scenario(rank: int, world: int, base: str) -> list[int]:
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    reused = []
    for step in (1, 2):  # the first plans, the second reuses
        uri = os.path.join(base, f"async{step}")
        _async_save(_state(rank, world, step), uri, strategy, validate=step == 1)
        _check(uri, rank, world, step)
        reused.append(strategy.plan_cache.reused)
    uri = os.path.join(base, "sync3")  # a synchronous save reuses them too
    cloudckpt.save(_state(rank, world, 3), uri, sharded_strategy=strategy)
    _check(uri, rank, world, 3)
    reused.append(strategy.plan_cache.reused)
    uri = os.path.join(base, "changed4")  # rank 3 alone holds one more tensor: replanned
    _async_save(_state(rank, world, 4, extra=True), uri, strategy, validate=True)
    _check(uri, rank, world, 4, extra=True)
    reused.append(strategy.plan_cache.reused)
    uri = os.path.join(base, "same5")  # the new structure's plans are reused
    _async_save(_state(rank, world, 5, extra=True), uri, strategy, validate=False)
    _check(uri, rank, world, 5, extra=True)
    reused.append(strategy.plan_cache.reused)
    return reused


def test_cached_plans_are_reused_while_no_rank_changes_its_structure(
    rank_pool: Any, tmp_path: Any
) -> None:
    results = rank_pool.run(_cached_plans_scenario, str(tmp_path))
    assert results == [[0, 1, 2, 2, 3]] * 4


def _staged_only_scenario(rank: int, world: int, base: str) -> bool:
    """The default strategy (no plan cache) stages too: the state changed after
    ``save`` returned does not reach the checkpoint."""
    uri = os.path.join(base, "plain")
    _async_save(_state(rank, world, 6), uri, None, validate=True)
    _check(uri, rank, world, 6)
    return cloudckpt.check_is_distributed_checkpoint(uri)


def test_async_torch_dist_save_serializes_the_host_copies_in_the_background(
    rank_pool: Any, tmp_path: Any
) -> None:
    assert rank_pool.run(_staged_only_scenario, str(tmp_path)) == [True] * 4


def _failed_upload_scenario(rank: int, world: int, base: str) -> str:
    original = DcpPlannedWrite.write

    def write(self: DcpPlannedWrite) -> Any:
        if rank == 2:
            raise OSError("disk full on rank 2")
        return original(self)

    DcpPlannedWrite.write = write  # type: ignore[method-assign]
    uri = os.path.join(base, "failed")
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    try:
        calls = AsyncCallsQueue()
        request = cloudckpt.save(_state(rank, world, 1), uri, strategy, async_sharded_save=True)
        assert request is not None
        calls.schedule_async_request(request)
        with pytest.raises(CheckpointingException) as raised:
            calls.maybe_finalize_async_calls(blocking=True)
        calls.close()
    finally:
        DcpPlannedWrite.write = original  # type: ignore[method-assign]
    assert not cloudckpt.check_is_distributed_checkpoint(uri)
    return str(raised.value)


def test_a_failed_background_upload_is_raised_at_finalize_on_every_rank(
    rank_pool: Any, tmp_path: Any
) -> None:
    messages = rank_pool.run(_failed_upload_scenario, str(tmp_path))
    assert all("disk full on rank 2" in m or "rank 2" in m for m in messages), messages


def _fully_parallel_scenario(rank: int, world: int, base: str) -> int:
    """Megatron's usual setup: a fully parallel wrapper over a cached-plan torch_dist
    strategy, saving asynchronously, twice (the second reuses the plans)."""
    strategy = TorchDistSaveShardedStrategy(cached_metadata=True)
    wrapper = FullyParallelSaveStrategyWrapper(strategy, do_cache_distribution=True)
    for step in (1, 2):
        uri = os.path.join(base, f"fp{step}")
        _async_save(_state(rank, world, step), uri, wrapper, validate=step == 1)
        _check(uri, rank, world, step)
    return strategy.plan_cache.reused


def test_fully_parallel_async_save_stages_through_the_wrapped_strategy(
    rank_pool: Any, tmp_path: Any
) -> None:
    assert rank_pool.run(_fully_parallel_scenario, str(tmp_path)) == [1] * 4


def _broadcast_scenario(rank: int, world: int, base: str) -> list[str]:
    """The types of what every collective broadcasts during an async save and a sync
    save through the strategy itself."""
    from cloudckpt import dist  # noqa: PLC0415

    original = dist.broadcast_object
    seen: list[str] = []

    def broadcast_object(obj: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(obj, *args, **kwargs)
        seen.append(type(out).__name__)
        return out

    dist.broadcast_object = broadcast_object  # type: ignore[assignment]
    strategy = TorchDistSaveShardedStrategy()
    try:
        _async_save(_state(rank, world, 7), os.path.join(base, "async"), None, validate=True)
        strategy.save(_state(rank, world, 8), os.path.join(base, "sync"))
    finally:
        dist.broadcast_object = original  # type: ignore[assignment]
    _check(os.path.join(base, "async"), rank, world, 7)
    return seen


def test_a_torch_dist_save_broadcasts_its_verdict_not_the_global_metadata(
    rank_pool: Any, tmp_path: Any
) -> None:
    """The coordinator writes ``.metadata``; the other ranks learn only that it did (the
    global metadata, every chunk of every tensor, would grow with the world on each),
    whether the save is asynchronous or synchronous through the strategy itself: the
    verdicts (None when every rank succeeded) and the plan updates are all that is
    broadcast."""
    seen = rank_pool.run(_broadcast_scenario, str(tmp_path))
    for types in seen:
        assert types == seen[0], seen
        assert "Metadata" not in types and "MCoreMetadata" not in types, types
    # the async save: the checks' verdict, the commit's; the strategy's save: its finish's
    assert seen[0].count("ClaimVerdict") == 1 and seen[0][-1] == "NoneType", seen[0]
