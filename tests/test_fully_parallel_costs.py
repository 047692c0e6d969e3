"""What the fully parallel wrappers cost beyond a plain save and load.

On 4 real gloo ranks (TP 2 x DP 2, the wrappers over the data-parallel groups): the
collectives each adds (check-ins of cloudckpt's guard, counted by name), the calls of
the wrapped load strategy; and, without processes, the balance of a distribution (the
bytes a rank must write anyway count) and the checks a save distribution makes on the
group's gathered metadata.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.errors import CheckpointingException
from cloudckpt.exchange_utils import _distribution_of
from cloudckpt.replicas import check_group_replicas
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from cloudckpt.utils import _sharded_tensor_shard_id


def _costs_scenario(rank: int, world: int, base: str) -> dict[str, Any]:
    """Plain save and load, then two fully parallel ones with a cached distribution:
    the check-ins of each, and the wrapped load strategy's calls."""
    from cloudckpt import dist_guard  # noqa: PLC0415
    from tests.test_fully_parallel import _check_loaded, _dp_group, build_state  # noqa: PLC0415

    group = _dp_group(rank, "tp2dp2")
    original_load_from = TorchDistLoadShardedStrategy.load_from
    calls: list[int] = []

    def counting_load_from(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original_load_from(self, *args, **kwargs)

    save = FullyParallelSaveStrategyWrapper(
        TorchDistSaveShardedStrategy(), group, do_cache_distribution=True
    )
    load = FullyParallelLoadStrategyWrapper(
        TorchDistLoadShardedStrategy(), group, do_cache_distribution=True
    )
    out: dict[str, Any] = {}
    TorchDistLoadShardedStrategy.load_from = counting_load_from  # type: ignore[method-assign]
    try:
        for label, saver, loader in [
            ("plain", None, None),
            ("first", save, load),
            ("later", save, load),
        ]:
            uri = os.path.join(base, label)
            with dist_guard.recorded_check_ins() as names:
                cloudckpt.save(build_state(rank, "tp2dp2"), uri, sharded_strategy=saver)
            out[f"{label}_save"] = [n.replace(uri, "URI") for n in names]
            calls.clear()
            request = build_state(rank, "tp2dp2", empty=True)
            with dist_guard.recorded_check_ins() as names:
                loaded = cloudckpt.load(request, uri, loader)
            out[f"{label}_load"] = [n.replace(uri, "URI") for n in names]
            out[f"{label}_load_calls"] = len(calls)
            _check_loaded(loaded, rank, "tp2dp2")
    finally:
        TorchDistLoadShardedStrategy.load_from = original_load_from  # type: ignore[method-assign]
    return out


def _extra(out: dict[str, Any], label: str, phase: str) -> Counter[str]:
    """The check-ins of a fully parallel phase that the plain one does not make."""
    return Counter(out[f"{label}_{phase}"]) - Counter(out[f"plain_{phase}"])


def test_fully_parallel_collectives_and_calls(rank_pool: Any, tmp_path: Any) -> None:
    """Save: one collective of its own, the metadata gather of the first save (no
    second gather across the world to validate it again) or the cache's integer
    all-reduce of a later one. Load: the distribution's collective, and the agreement
    on the reads, which carries the objects read (no check-in before the broadcasts,
    no separate all-gather of the objects); the wrapped strategy called once."""
    outs = rank_pool.run(_costs_scenario, str(tmp_path))
    for out in outs:
        assert _extra(out, "first", "save") == {"all_gather_object": 1}, out["first_save"]
        assert _extra(out, "later", "save") == {"all_reduce_int": 1}, out["later_save"]
        assert len(out["first_save"]) == len(out["later_save"]) == len(out["plain_save"]) + 1
        reads = "agreeing on reading this rank's share of a fully parallel load"
        for label, distribution in (("first", "all_gather_object"), ("later", "all_reduce_int")):
            assert _extra(out, label, "load") == {distribution: 1, reads: 1}, out[f"{label}_load"]
            assert len(out[f"{label}_load"]) == len(out["plain_load"]) + 2
            assert out[f"{label}_load_calls"] == out["plain_load_calls"] == 1


# -- without processes: the distribution's balance and checks -----------------------------


def _shard(key: str, numel: int, replica_id: int, dtype: torch.dtype = torch.float32) -> Any:
    return ShardedTensor.from_rank_offsets(
        key, torch.empty(numel, dtype=dtype), replica_id=replica_id
    ).without_data()


def test_the_rank_with_most_bytes_of_its_own_gets_fewest_replicated_bytes() -> None:
    """Rank 0 must write a 1,000-element tensor of its own; the four 100-element
    tensors that ranks 0-2 all hold go to ranks 1 and 2 (main replicas on rank 0
    before); rank 2's own 150 elements make rank 1 take one more."""
    replicated = [f"r{i}" for i in range(4)]
    gathered = [
        [_shard("own0", 1000, 0)] + [_shard(k, 100, 0) for k in replicated],
        [_shard(k, 100, 1) for k in replicated],
        [_shard("own2", 150, 0)] + [_shard(k, 100, 2) for k in replicated],
    ]
    distribution = _distribution_of(gathered)
    by_rank = Counter(distribution.main_rank_for_shard.values())
    assert distribution.main_rank_for_shard[("own0", (0,), None)] == 0
    assert distribution.main_rank_for_shard[("own2", (0,), None)] == 2
    assert by_rank == {0: 1, 1: 3, 2: 2}, distribution.main_rank_for_shard
    replicated_on = [r for k, r in distribution.main_rank_for_shard.items() if k[0] in replicated]
    assert 0 not in replicated_on  # balanced over all three, rank 0 would take one


def test_a_save_distribution_checks_the_groups_replicas() -> None:
    """Two main replicas of a shard in the group, or a shard held with two shapes or
    dtypes, are refused before any replica id changes (the same verdict on every rank)."""
    check_group_replicas([[_shard("w", 8, 0)], [_shard("w", 8, 1)]])  # fine
    with pytest.raises(CheckpointingException, match="several main replicas"):
        check_group_replicas([[_shard("w", 8, 0)], [_shard("w", 8, 0)]])
    with pytest.raises(CheckpointingException, match=r"torch\.float32.*torch\.bfloat16"):
        check_group_replicas([[_shard("w", 8, 0)], [_shard("w", 8, 1, torch.bfloat16)]])
    with pytest.raises(CheckpointingException, match=r"\(8,\).*\(4,\)"):
        check_group_replicas([[_shard("w", 8, 0)], [_shard("w", 4, 1)]])


# -- the broadcast exchange: large shards alone, straight into the requested tensors -----


def _broadcast_scenario(rank: int, world: int) -> dict[str, Any]:
    """Every rank requests 'big' (1,024 bytes) and 'small' (64 bytes) tensors held by
    all; with shards of 512 bytes or more broadcast alone, the big ones are received
    into the requested tensors without a bucket, the small ones through buckets."""
    from cloudckpt import exchange_utils as ex  # noqa: PLC0415

    def truth(key: str, numel: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.float32) + sum(map(ord, key))

    sizes = {f"big{i}": 256 for i in range(4)} | {f"small{i}": 16 for i in range(6)}
    state = {
        key: ShardedTensor.from_rank_offsets(key, torch.zeros(n), replica_id=rank)
        for key, n in sizes.items()
    }
    scattered: list[str] = []
    original_scatter, original_alone = ex._scatter_bucket, ex.BROADCAST_ALONE_BYTES

    def recording(payload: Any, bucket: Any, needed: Any, result: Any) -> None:
        scattered.extend(shard_id[0] for shard_id, _ in bucket if shard_id in needed)
        original_scatter(payload, bucket, needed, result)

    ex._scatter_bucket, ex.BROADCAST_ALONE_BYTES = recording, 512
    try:
        distribution = ex.determine_main_replica_uniform_distribution(state, None, True)
        assert distribution is not None
        ids = {_sharded_tensor_shard_id(sh): sh for sh in state.values()}
        mine = {sid for sid, r in distribution.main_rank_for_shard.items() if r == rank}
        loaded = {sid: truth(sid[0], sizes[sid[0]]) for sid in mine}
        unloaded = {sid: sh for sid, sh in ids.items() if sid not in mine}
        buckets = ex._broadcast_buckets(distribution)
        out = ex.exchange_loaded_tensors_broadcast(loaded, unloaded, distribution)
    finally:
        ex._scatter_bucket, ex.BROADCAST_ALONE_BYTES = original_scatter, original_alone
    for sid, sh in ids.items():
        assert torch.equal(out[sid], truth(sid[0], sizes[sid[0]])), sid
        if sid in unloaded:
            assert out[sid] is sh.data
    return {
        "scattered": sorted(scattered),
        "buckets": [(r, [sid[0] for sid, _ in b]) for r, b in buckets],
    }


def test_large_shards_are_broadcast_alone_into_the_requested_tensors(rank_pool: Any) -> None:
    outs = rank_pool.run(_broadcast_scenario)
    assert all(out["buckets"] == outs[0]["buckets"] for out in outs)  # the same everywhere
    alone = [keys for _, keys in outs[0]["buckets"] if keys[0].startswith("big")]
    assert sorted(k for keys in alone for k in keys) == [f"big{i}" for i in range(4)]
    assert all(len(keys) == 1 for keys in alone)
    small = [keys for _, keys in outs[0]["buckets"] if keys[0].startswith("small")]
    assert sum(map(len, small)) == 6 and max(map(len, small)) > 1
    for out in outs:  # every rank received some small shards through a bucket, no big one
        assert out["scattered"] and all(k.startswith("small") for k in out["scattered"])
