"""Exchanging loaded shards between ranks (Megatron-Core's ``dist_checkpointing.exchange_utils``).

A fully parallel load splits the reading of replicated shards among the ranks that
need them (:func:`determine_main_replica_uniform_distribution` picks, for every shard,
one rank to read it, balancing bytes), and then hands every shard to the ranks that
need it (:func:`exchange_by_distribution`, with one of three algorithms:
``"broadcast"``, ``"gather_rounds"`` or ``"gather_object"``).

Everything runs over ``torch.distributed`` and works on CPU with gloo: tensors travel
as raw bytes on the device the group's backend needs (CUDA under NCCL, else the CPU),
so every dtype (bfloat16, bool, float8) crosses every backend, and the results land
on the device of the requested tensor. Without a process group the world is one rank
and nothing is exchanged.

Shard ids are :func:`cloudckpt.utils._sharded_tensor_shard_id` tuples; every rank must
call these functions with the same distribution, in the same order.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from functools import reduce
from itertools import zip_longest
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as torch_dist

from cloudckpt import dist
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from cloudckpt.utils import _sharded_tensor_shard_id, _ShardId, debug_time, is_float8tensor

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=Hashable)
ExchangeAlgo = str  # "broadcast" | "gather_rounds" | "gather_object"


class ShardDistribution(NamedTuple):
    """Which rank handles each shard, within one (implicit) process group.

    Attributes:
        main_rank_for_shard: the rank that reads (or writes) each shard.
        shards_in_this_group: the shards whose main replica is in this group.
        shard_to_metadata: a ShardedTensor (without data) describing each shard.
        all_ranks_for_shard: the ranks of the group that hold / need each shard.
    """

    main_rank_for_shard: dict[_ShardId, int]
    shards_in_this_group: set[_ShardId]
    shard_to_metadata: dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: dict[_ShardId, list[int]]


def _shard_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
    rng = sh_ten.flattened_range
    return tuple(sh_ten.local_shape) if rng is None else (rng.stop - rng.start,)


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of the shard's data."""
    return math.prod(_shard_shape(sh_ten)) * sh_ten.dtype.itemsize


def _comm_device(group: Any = None) -> torch.device:
    """The device collectives of ``group`` need: CUDA under NCCL, else the CPU."""
    if dist.is_distributed() and torch_dist.get_backend(group) == "nccl":  # pragma: no cover
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor (dequantized first if it is FP8)."""
    if is_float8tensor(tensor):
        tensor = tensor.dequantize()
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: Mapping[_ShardId, ShardedTensor],
    unneeded_shards: Mapping[_ShardId, ShardedTensor],
    loaded_tensors: dict[_ShardId, torch.Tensor],
) -> tuple[torch.Tensor, torch.device | None]:
    """The tensor a shard is received into, and the device of the requested tensor
    (None when this rank does not need the shard), as Megatron-Core's.

    A needed shard is received into the requested tensor's own data (allocated on the
    CPU when it has none), which is recorded in ``loaded_tensors``; an unneeded one into
    an empty tensor of its shape and dtype (discarded after the exchange; where the
    shard has data, on that data's device). Megatron-Core allocates CUDA tensors here;
    cloudckpt receives on the requested tensor's device and copies there when the
    collective's device differs (:func:`_direct_target`)."""
    sh_ten = needed_shards.get(shard_id)
    if sh_ten is None:
        other = unneeded_shards[shard_id]
        device = other.data.device if other.data is not None else torch.device("cpu")
        return torch.empty(_shard_shape(other), dtype=other.dtype, device=device), None
    if sh_ten.data is None:
        sh_ten.init_data(device="cpu")
    assert sh_ten.data is not None
    loaded_tensors[shard_id] = sh_ten.data
    return sh_ten.data, sh_ten.data.device


def _fill(target: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """Copy raw bytes into ``target`` (made contiguous first if needed); return it."""
    if not target.is_contiguous():
        target = target.contiguous()
    target.reshape(-1).view(torch.uint8).copy_(payload[: target.numel() * target.element_size()])
    return target


def distribute_shards_to_ranks(
    shard_to_ranks: Mapping[T, Iterable[int]],
    shard_to_size: Mapping[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: AbstractSet[T] = frozenset(),
) -> dict[T, int]:
    """Assign each shard to one of the ranks that have it, balancing the bytes per rank.

    Greedy and deterministic (the same result on every rank): shards whose main replica
    is in this group before those of ``cross_parallelization_group_loads`` (so a load
    distributes like the save did), then shards available on the fewest ranks, then
    larger shards, then by shard id; each goes to the least loaded of its ranks (the
    lowest rank on a tie).

    Returns:
        ``{shard: rank}``.
    """
    candidates = {shard: tuple(ranks) for shard, ranks in shard_to_ranks.items()}
    load = [0] * num_ranks
    assignment: dict[T, int] = {}
    order = sorted(
        candidates.items(),
        key=lambda item: (
            item[0] in cross_parallelization_group_loads,
            len(item[1]),
            -shard_to_size[item[0]],
            item[0],
        ),
    )
    for shard, ranks in order:
        if not ranks:
            raise CheckpointingException(f"shard {shard} is on no rank")
        rank = min(ranks, key=lambda r: (load[r], r))
        assignment[shard] = rank
        load[rank] += shard_to_size[shard]
    logger.debug("distribute_shards_to_ranks: bytes per rank %s", load)
    return assignment


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Any,
    ignore_groups: bool = False,
) -> ShardDistribution | None:
    """Pick, for every shard of the group, the rank that handles it (a collective).

    Gathers the ShardedTensors (metadata only) of every rank in the group, keeps the
    shards whose main replica is in the group (every shard with ``ignore_groups``, as
    a load needs), and balances them with :func:`distribute_shards_to_ranks`.

    Returns:
        The distribution, or None for a group of one rank.
    """
    if dist.get_world_size(parallelization_group) <= 1:
        return None
    gathered = _gather_shard_metadata(sharded_state_dict, parallelization_group)
    return _distribution_of(gathered, ignore_groups)


def _gather_shard_metadata(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any
) -> list[list[ShardedTensor]]:
    """Every rank's ShardedTensors of the group, without data, indexed by group rank
    (one ``all_gather_object``; the only collective of a distribution)."""
    local = [
        v.without_data() for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)
    ]
    return dist.all_gather_object(local, group=parallelization_group)


def _distribution_of(
    gathered: list[list[ShardedTensor]], ignore_groups: bool = False
) -> ShardDistribution:
    """The distribution of the group whose ranks hold ``gathered`` (no collective: the
    same on every rank given the same input; see
    :func:`determine_main_replica_uniform_distribution`).

    Every shard whose main replica is in the group is balanced by bytes over the ranks
    that hold it, the shards a single rank holds (which it must write anyway) first: a
    rank with more bytes of its own gets fewer replicated bytes."""
    shard_to_ranks: dict[_ShardId, list[int]] = defaultdict(list)
    shard_to_size: dict[_ShardId, int] = {}
    shard_to_metadata: dict[_ShardId, ShardedTensor] = {}
    has_main: set[_ShardId] = set()
    for rank, shards in enumerate(gathered):
        for sh_ten in shards:
            shard_id = _sharded_tensor_shard_id(sh_ten)
            shard_to_ranks[shard_id].append(rank)
            if shard_id not in shard_to_metadata:
                shard_to_metadata[shard_id] = sh_ten
                shard_to_size[shard_id] = _shard_size(sh_ten)
            if is_main_replica(sh_ten.replica_id):
                has_main.add(shard_id)
    in_group = set(shard_to_ranks) if ignore_groups else has_main
    ranks_in_group = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    cross_loads = in_group - has_main  # main replica in another group: last
    main_rank = distribute_shards_to_ranks(
        ranks_in_group, shard_to_size, len(gathered), cross_loads
    )
    return ShardDistribution(main_rank, in_group, shard_to_metadata, ranks_in_group)


def _exchanged_shards(distribution: ShardDistribution) -> list[tuple[_ShardId, int]]:
    """The (shard, main rank) pairs that some other rank needs, in distribution order."""
    pairs = []
    for shard_id, rank in distribution.main_rank_for_shard.items():
        holders = distribution.all_ranks_for_shard[shard_id]
        if len(holders) == 1:
            if holders[0] != rank:
                raise CheckpointingException(
                    f"shard {shard_id} is needed only by rank {holders[0]} but assigned to "
                    f"rank {rank}"
                )
            continue
        pairs.append((shard_id, rank))
    return pairs


@torch.no_grad()
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Mapping[_ShardId, torch.Tensor],
    unloaded_shards: Mapping[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards with one ``all_gather`` per round (a collective).

    Per dtype, round ``i`` carries the ``i``-th shard each rank loaded, padded to the
    round's largest shard (gloo gathers equal sizes only).

    Returns:
        ``loaded_tensors`` plus every shard of ``unloaded_shards`` received.
    """
    with debug_time("exchange_loaded_tensors_gather_rounds", logger):
        local_rank = dist.get_rank(parallelization_group)
        world = dist.get_world_size(parallelization_group)
        device = _comm_device(parallelization_group)
        result = dict(loaded_tensors)
        pairs = _exchanged_shards(shard_distribution)
        dist.check_in("exchanging loaded shards", parallelization_group)
        meta = shard_distribution.shard_to_metadata
        for dtype in sorted({meta[s].dtype for s, _ in pairs}, key=str):
            by_rank: list[list[_ShardId]] = [[] for _ in range(world)]
            for shard_id, rank in pairs:
                if meta[shard_id].dtype == dtype:
                    by_rank[rank].append(shard_id)
            for round_ids in zip_longest(*by_rank):
                _gather_round(
                    list(round_ids),
                    local_rank,
                    device,
                    result,
                    unloaded_shards,
                    meta,
                    parallelization_group,
                )
        return result


def _gather_round(
    round_ids: list[_ShardId | None],
    local_rank: int,
    device: torch.device,
    result: dict[_ShardId, torch.Tensor],
    needed: Mapping[_ShardId, ShardedTensor],
    meta: Mapping[_ShardId, ShardedTensor],
    group: Any,
) -> None:
    sizes = [0 if s is None else _shard_size(meta[s]) for s in round_ids]
    width = max(sizes)
    buffers = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in round_ids]
    own = round_ids[local_rank]
    if own is not None:
        buffers[local_rank][: sizes[local_rank]].copy_(_as_bytes(result[own]))
    work = torch_dist.all_gather(buffers, buffers[local_rank], group=group, async_op=True)
    dist.await_collective("exchanging loaded shards (all_gather round)", work, group)
    for rank, shard_id in enumerate(round_ids):
        if shard_id is not None and rank != local_rank and shard_id in needed:
            target = _get_empty_tensor_for_exchange(shard_id, needed, {}, {})[0]
            result[shard_id] = _fill(target, buffers[rank].to(target.device))


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Mapping[_ShardId, torch.Tensor],
    unloaded_shards: Mapping[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards with one ``all_gather_object`` (simple; for debugging).

    Returns:
        Every shard loaded by any rank of the group.

    Raises:
        CheckpointingException: two ranks loaded the same shard.
    """
    gathered = dist.all_gather_object(dict(loaded_tensors), group=parallelization_group)
    return _merge_unique(gathered, "shard")


def exchange_loaded_objects_gather_object(
    loaded_objects: Mapping[_ShardId, Any],
) -> dict[_ShardId, Any]:
    """Exchange loaded ShardedObjects over the default group (``all_gather_object``).

    Raises:
        CheckpointingException: two ranks loaded the same object.
    """
    return _merge_unique(dist.all_gather_object(dict(loaded_objects)), "object")


def _merge_unique(per_rank: list[dict[_ShardId, Any]], what: str) -> dict[_ShardId, Any]:
    merged: dict[_ShardId, Any] = reduce(lambda a, b: {**a, **b}, per_rank, {})
    if len(merged) != sum(map(len, per_rank)):
        by_rank = [sorted(map(str, d)) for d in per_rank]
        raise CheckpointingException(
            f"Duplicate shard ids loaded by different ranks ({what}s by rank: {by_rank})"
        )
    return merged


BROADCAST_BUCKET_BYTES = 64 * 2**20
"""The most bytes of shards the broadcast exchange sends in one broadcast (a larger
shard goes alone): few collectives for many small shards, bounded extra memory."""

BROADCAST_ALONE_BYTES = 2**20
"""A shard of at least this many bytes is broadcast alone, straight from the loaded
tensor and into the requested one: no copy into or out of a bucket, where the
collective's latency is small beside the bytes."""


def _broadcast_buckets(
    shard_distribution: ShardDistribution, limit: int | None = None
) -> list[tuple[int, list[tuple[_ShardId, int]]]]:
    """The exchanged shards as ``(loading rank, [(shard id, bytes)])`` buckets: each
    rank's shards in distribution order, a shard of :data:`BROADCAST_ALONE_BYTES` or
    more alone, the smaller ones cut at ``limit`` bytes (default
    :data:`BROADCAST_BUCKET_BYTES`). The same on every rank (it depends on the
    distribution only)."""
    limit = BROADCAST_BUCKET_BYTES if limit is None else limit
    meta = shard_distribution.shard_to_metadata
    by_rank: dict[int, list[tuple[_ShardId, int]]] = {}
    for shard_id, rank in _exchanged_shards(shard_distribution):
        by_rank.setdefault(rank, []).append((shard_id, _shard_size(meta[shard_id])))
    buckets: list[tuple[int, list[tuple[_ShardId, int]]]] = []
    for rank in sorted(by_rank):
        current: list[tuple[_ShardId, int]] = []
        filled = 0
        for shard_id, size in by_rank[rank]:
            if size >= BROADCAST_ALONE_BYTES:
                buckets.append((rank, [(shard_id, size)]))
                continue
            if current and filled + size > limit:
                buckets.append((rank, current))
                current, filled = [], 0
            current.append((shard_id, size))
            filled += size
        if current:
            buckets.append((rank, current))
    return buckets


@torch.no_grad()
def exchange_loaded_tensors_broadcast(
    loaded_tensors: Mapping[_ShardId, torch.Tensor],
    unloaded_shards: Mapping[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards by broadcasts from their loading ranks: the shards of one
    loading rank go concatenated, up to :data:`BROADCAST_BUCKET_BYTES` per broadcast
    (Megatron-Core broadcasts each shard alone: one collective per shard); a shard
    alone in its bucket is received straight into the requested tensor.

    Returns:
        ``loaded_tensors`` plus every shard of ``unloaded_shards`` received.
    """
    return _exchange_broadcast(
        loaded_tensors, unloaded_shards, shard_distribution, parallelization_group
    )


@torch.no_grad()
def _exchange_broadcast(
    loaded_tensors: Mapping[_ShardId, torch.Tensor],
    unloaded_shards: Mapping[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Any = None,
    *,
    check_in: bool = True,
) -> dict[_ShardId, torch.Tensor]:
    """:func:`exchange_loaded_tensors_broadcast`; ``check_in=False`` skips the
    check-in barrier where the caller has just completed a collective over the group
    (the fully parallel load's agreement on its reads): every rank is known present,
    and each broadcast is still awaited with :func:`cloudckpt.dist.await_collective`."""
    with debug_time("exchange_loaded_tensors_broadcast", logger):
        local_rank = dist.get_rank(parallelization_group)
        device = _comm_device(parallelization_group)
        result = dict(loaded_tensors)
        if check_in:
            dist.check_in("exchanging loaded shards", parallelization_group)
        for rank, bucket in _broadcast_buckets(shard_distribution):
            sent = rank == local_rank
            direct = None if sent else _direct_target(bucket, unloaded_shards, device)
            if sent:
                parts = [_as_bytes(result[shard_id]) for shard_id, _ in bucket]
                payload = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
            elif direct is not None:
                payload = direct.reshape(-1).view(torch.uint8)
            else:
                payload = torch.empty(sum(n for _, n in bucket), dtype=torch.uint8, device=device)
            src = (
                rank
                if parallelization_group is None
                else torch_dist.get_global_rank(parallelization_group, rank)
            )
            work = torch_dist.broadcast(
                payload, src=src, group=parallelization_group, async_op=True
            )
            dist.await_collective(
                "exchanging loaded shards (broadcast)", work, parallelization_group
            )
            if sent:
                continue
            if direct is not None:
                result[bucket[0][0]] = direct
                continue
            _scatter_bucket(payload, bucket, unloaded_shards, result)
        return result


def _direct_target(
    bucket: list[tuple[_ShardId, int]],
    needed: Mapping[_ShardId, ShardedTensor],
    device: torch.device,
) -> torch.Tensor | None:
    """The requested tensor a one-shard bucket can be received into as it is (this rank
    needs it, and it is contiguous, of the bucket's size, on ``device``), else None."""
    if len(bucket) != 1 or bucket[0][0] not in needed:
        return None
    shard_id, size = bucket[0]
    target = _get_empty_tensor_for_exchange(shard_id, needed, {}, {})[0]
    fits = (
        target.is_contiguous()
        and target.device == device
        and target.numel() * target.element_size() == size
        and not is_float8tensor(target)
    )
    return target if fits else None


def _scatter_bucket(
    payload: torch.Tensor,
    bucket: list[tuple[_ShardId, int]],
    needed: Mapping[_ShardId, ShardedTensor],
    result: dict[_ShardId, torch.Tensor],
) -> None:
    """Copy the shards of a received bucket that this rank needs into their tensors."""
    offset = 0
    for shard_id, size in bucket:
        if shard_id in needed:
            target = _get_empty_tensor_for_exchange(shard_id, needed, {}, {})[0]
            piece = payload[offset : offset + size]
            result[shard_id] = _fill(target, piece.to(target.device))
        offset += size


_EXCHANGE_FUNCTIONS = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
    "gather_object": exchange_loaded_tensors_gather_object,
}


def exchange_by_distribution(
    loaded_tensors: Mapping[_ShardId, torch.Tensor],
    unloaded_shards: Mapping[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution | None,
    parallelization_group: Any = None,
    exchange_algo: ExchangeAlgo = "broadcast",
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards with ``exchange_algo`` (a collective over the group).

    Args:
        loaded_tensors: the shards this rank loaded, by shard id.
        unloaded_shards: the shards this rank needs and did not load; received data
            is written into their ``data`` (allocated on the CPU when None).
        shard_distribution: from :func:`determine_main_replica_uniform_distribution`.
        parallelization_group: the group (default: the default group).
        exchange_algo: ``"broadcast"`` (default), ``"gather_rounds"`` or ``"gather_object"``.

    Returns:
        Every shard this rank needs (and, for ``"gather_object"``, every loaded shard).

    Raises:
        CheckpointingException: no distribution was given.
        NotImplementedError: an unknown algorithm (as Megatron-Core raises).
    """
    if shard_distribution is None:
        raise CheckpointingException("Expecting distribution to perform exchange")
    exchange = _EXCHANGE_FUNCTIONS.get(exchange_algo)
    if exchange is None:
        raise NotImplementedError(f"Unrecognized gather algorithm: {exchange_algo}")
    return exchange(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)


__all__ = [
    "ShardDistribution",
    "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "is_float8tensor",
]
