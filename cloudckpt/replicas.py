"""The shards several ranks hold: a fully parallel save's distribution of their main
replicas over a group (computed once, cached while every rank's structure stays the same,
checked, applied in place), and a fully parallel load's split of what a rank reads from
what it receives (:mod:`cloudckpt.strategies.fully_parallel` uses both)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from cloudckpt import dist
from cloudckpt.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.exchange_utils import ShardDistribution
from cloudckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from cloudckpt.utils import _sharded_tensor_shard_id, _ShardId

T = TypeVar("T", ShardedObject, ShardedTensor)

Structure = tuple[Hashable, ...]
"""What a cached distribution depends on: this rank's shards, sorted."""


def default_group(group: Any) -> Any:
    """``group``, or the world's group (None before a process group exists)."""
    if group is None and dist.is_distributed():
        return torch.distributed.group.WORLD
    return group


def local_structure(sharded_state_dict: ShardedStateDict) -> Structure:
    """This rank's ShardedTensors as the distribution sees them (ids, sizes, main flag)."""
    entries = [
        (
            _sharded_tensor_shard_id(sh),
            tuple(sh.local_shape),
            str(sh.dtype),
            is_main_replica(sh.replica_id),
        )
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedTensor)
    ]
    return tuple(sorted(entries, key=repr))


class DistributionCache:
    """A distribution reused while every rank's structure is the one it was computed for.

    A distribution set from outside (``wrapper.cached_distribution = d``, as Megatron-Core
    allows) has no recorded structure and is trusted as it is, without the check.
    """

    def __init__(self) -> None:
        self.distribution: ShardDistribution | None = None
        self.structure: Structure | None = None

    def reusable(self, structure: Structure, group: Any) -> bool:
        """Whether the cached distribution fits ``structure`` on every rank of ``group``.
        Collective over ``group`` once something is cached (one integer all-reduce)."""
        if self.distribution is None:
            return False
        if self.structure is None:
            return True
        changed = int(structure != self.structure)
        return dist.all_reduce_int(changed, op="max", group=group) == 0

    def store(self, distribution: ShardDistribution | None, structure: Structure | None) -> None:
        self.distribution, self.structure = distribution, structure


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Any,
    precomputed_distribution: ShardDistribution | None,
) -> None:
    """Apply a distribution: the ShardedTensors this rank was given get ``replica_id``
    0, every other ShardedTensor ``replica_id`` 1 (in place).

    Args:
        sharded_state_dict: this rank's state dict.
        parallelization_group: the group the distribution was computed in (None: the
            world); in a group of one rank nothing changes.
        precomputed_distribution: from :func:`determine_main_replica_uniform_distribution`
            over the same group.

    Raises:
        ValueError: the group has several ranks but no distribution was given.

    Example, tensors A, B, C replicated on three ranks (replica ids before: rank r
    holds ``(0, 0, r)`` for each)::

        rank 0: A 0, B 1, C 1
        rank 1: A 1, B 0, C 1
        rank 2: A 1, B 1, C 0
    """
    group = default_group(parallelization_group)
    if dist.get_world_size(group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError(
            "precomputed_distribution must be given for a parallelization group of "
            f"{dist.get_world_size(group)} ranks"
        )
    me = dist.get_rank(group)
    main_rank = precomputed_distribution.main_rank_for_shard
    in_group = precomputed_distribution.shards_in_this_group
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            shard_id = _sharded_tensor_shard_id(sh)
            mine = shard_id in in_group and main_rank.get(shard_id) == me
            sh.replica_id = 0 if mine else 1


def check_group_replicas(gathered: list[list[ShardedTensor]]) -> None:
    """Check the group's gathered shards before a save distribution moves their main
    replicas: the ranks holding a shard agree on its dtype and shape, and at most one
    of them holds its main replica. The same verdict on every rank (the same input).

    Raises:
        CheckpointingException: a shard held with different dtypes or shapes, or with
            several main replicas, in the group.
    """
    seen: dict[_ShardId, tuple[str, tuple[int, ...], int]] = {}
    mains: dict[_ShardId, list[int]] = {}
    for rank, shards in enumerate(gathered):
        for sh in shards:
            shard_id = _sharded_tensor_shard_id(sh)
            described = (str(sh.dtype), tuple(sh.local_shape), rank)
            first = seen.setdefault(shard_id, described)
            if first[:2] != described[:2]:
                raise CheckpointingException(
                    f"fully parallel save: shard {shard_id} is {first[0]} {first[1]} on "
                    f"group rank {first[2]} but {described[0]} {described[1]} on group "
                    f"rank {rank}"
                )
            if is_main_replica(sh.replica_id):
                mains.setdefault(shard_id, []).append(rank)
    several = {k: v for k, v in mains.items() if len(v) > 1}
    if several:
        shown = sorted((str(k), v) for k, v in several.items())[:5]
        raise CheckpointingException(
            f"fully parallel save: {len(several)} shard(s) have several main replicas "
            f"in the parallelization group (shard, group ranks): {shown}"
        )


def require_received(
    expected: dict[_ShardId, Any], received: dict[_ShardId, Any], what: str
) -> None:
    missing = set(expected) - set(received)
    if missing:
        raise CheckpointingException(
            f"rank {dist.get_rank()}: {len(missing)} {what} shard(s) missing after the fully "
            f"parallel load: {sorted(map(str, missing))[:10]}"
        )


def defer_loading_sharded_items(
    sharded_state_dict: ShardedStateDict,
    item_type: type[T],
    shard_id_func: Callable[[T], _ShardId],
) -> tuple[ShardedStateDict, ShardedStateDict, dict[_ShardId, T], dict[_ShardId, T]]:
    """Split off the items of ``item_type``, sorted into those this rank reads (main
    replicas) and those it receives.

    Returns:
        (the items, as a nested dict; everything else; ``{shard id: item}`` this rank
        reads; ``{shard id: item}`` other ranks read).
    """
    to_load: dict[_ShardId, T] = {}
    unloaded: dict[_ShardId, T] = {}
    items, remaining = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, item_type)
    )

    def sort_item(x: Any) -> Any:
        if isinstance(x, item_type):
            target = to_load if is_main_replica(x.replica_id) else unloaded
            target[shard_id_func(x)] = x
        return x

    dict_list_map_inplace(sort_item, items)
    return items, remaining, to_load, unloaded


def fill_in_deferred_sharded_items(
    sharded_state_dict: ShardedStateDict,
    loaded_items: dict[_ShardId, Any],
    item_type: type[T],
    shard_id_func: Callable[[T], _ShardId],
) -> None:
    """Replace every item of ``item_type`` by its value in ``loaded_items`` (in place)."""

    def fill_in(x: Any) -> Any:
        if isinstance(x, item_type):
            shard_id = shard_id_func(x)
            try:
                return loaded_items[shard_id]
            except KeyError as exc:
                raise CheckpointingException(
                    f"rank {dist.get_rank()}: no loaded value for {item_type.__name__} "
                    f"shard {shard_id}"
                ) from exc
        return x

    dict_list_map_inplace(fill_in, sharded_state_dict)
