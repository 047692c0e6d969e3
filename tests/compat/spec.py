"""The state both sides of a compatibility test build: deterministic, seeded by key.

Imported by the pytest side (cloudckpt's environment, as ``tests.compat.spec``) and by
the Megatron-Core scripts (their own environments, as ``spec``), so it needs nothing
but torch and the standard library. The sharded-state builders take the library's
``ShardedTensor`` / ``ShardedObject`` classes, whose constructors cloudckpt and
Megatron-Core share.

Layout: ``rank -> (tp_rank, dp_rank) = (rank % tp, rank // tp)``; every tensor but the
replicated one is split evenly along its axis over the ``tp`` tensor-parallel ranks,
data-parallel ranks hold replicas. One ShardedObject is split over the saving world's
ranks; a loading rank requests every piece of it (main replica on rank 0 only).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import torch

# key -> (global shape, dtype, tensor-parallel axis or None for a replicated tensor)
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, int | None]] = {
    "decoder.w_col": ((8, 6), torch.float32, 0),
    "decoder.w_row": ((6, 8), torch.bfloat16, 1),
    "embedding.weight": ((16, 4), torch.bfloat16, 0),
    "decoder.norm": ((8,), torch.float32, None),
}
OBJECT_KEY = "rng_state"
COMMON: dict[str, Any] = {"iteration": 42, "lr": 0.5, "run": {"name": "compat", "steps": [1, 2]}}


def reference(key: str) -> torch.Tensor:
    """The global value of tensor ``key`` (its full, unsharded contents)."""
    shape, dtype, _ = TENSORS[key]
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def local_shard(key: str, tp: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank ``tp_rank``'s shard of ``key`` (the whole tensor if replicated)."""
    axis = TENSORS[key][2]
    full = reference(key)
    if axis is None:
        return full.clone()
    return full.chunk(tp, dim=axis)[tp_rank].clone()


def object_piece(index: int) -> dict[str, Any]:
    """Piece ``index`` of the ShardedObject: plain values and a tensor."""
    return {"seed": 1000 + index, "state": torch.arange(4, dtype=torch.int64) + 10 * index}


def build_state(
    sharded_tensor: Any,
    sharded_object: Any,
    rank: int,
    tp: int,
    object_world: int,
    *,
    empty: bool = False,
    common: bool = True,
) -> dict[str, Any]:
    """Rank ``rank``'s sharded state dict: tensors in the TP=``tp`` layout, the object
    split over ``object_world`` ranks, and the common values.

    With ``empty``, tensors hold uninitialised data and the object pieces None (a
    request to load), and every rank asks for every object piece.
    """
    tp_rank, dp_rank = rank % tp, rank // tp
    state: dict[str, Any] = {}
    for key, (_, _, axis) in TENSORS.items():
        data = local_shard(key, tp, tp_rank)
        if empty:
            data = torch.empty_like(data)
        if axis is None:
            state[key] = sharded_tensor.from_rank_offsets(key, data, replica_id=rank)
        else:
            state[key] = sharded_tensor.from_rank_offsets(
                key, data, (axis, tp_rank, tp), replica_id=dp_rank
            )
    if empty:
        state[OBJECT_KEY] = [
            sharded_object(OBJECT_KEY, None, (object_world,), (i,), replica_id=rank)
            for i in range(object_world)
        ]
    elif rank < object_world:
        state[OBJECT_KEY] = [
            sharded_object(OBJECT_KEY, object_piece(rank), (object_world,), (rank,), replica_id=0)
        ]
    if common:
        state.update(COMMON)
    return state


def digest(tensor: torch.Tensor) -> str:
    """dtype, shape and SHA-256 of the raw bytes of ``tensor`` (bit-exact identity)."""
    t = tensor.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    shape = "x".join(map(str, t.shape))
    return f"{str(t.dtype).removeprefix('torch.')}:{shape}:{hashlib.sha256(raw).hexdigest()}"


def expected_digests(tp: int, tp_rank: int) -> dict[str, str]:
    """What a rank of a TP=``tp`` layout must load, as :func:`digest` values."""
    return {key: digest(local_shard(key, tp, tp_rank)) for key in TENSORS}


def describe_object(value: Any) -> Any:
    """A JSON-able form of a loaded object piece (tensors by digest)."""
    if isinstance(value, torch.Tensor):
        return digest(value)
    if isinstance(value, dict):
        return {k: describe_object(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [describe_object(v) for v in value]
    return value


def describe_loaded(loaded: dict[str, Any]) -> dict[str, Any]:
    """A JSON-able account of a loaded state dict: tensor digests, object pieces,
    common values and the top-level keys."""
    objects = loaded.get(OBJECT_KEY)
    return {
        "tensors": {k: digest(loaded[k]) for k in TENSORS if k in loaded},
        "objects": None if objects is None else describe_object(objects),
        "common": {k: describe_object(loaded[k]) for k in COMMON if k in loaded},
        "keys": sorted(loaded),
    }


def expected_objects(object_world: int) -> list[Any]:
    """Every piece of the ShardedObject saved by ``object_world`` ranks, described."""
    return [describe_object(object_piece(i)) for i in range(object_world)]
