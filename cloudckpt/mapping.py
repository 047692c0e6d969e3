"""How local tensors and objects map onto global, sharded ones.

Wrap each tensor of a state dict in a :class:`ShardedTensor` (usually through
:meth:`ShardedTensor.from_rank_offsets`), other per-rank values in a :class:`ShardedObject`.
A :class:`ShardedTensorFactory` turns a tensor into a sub-state-dict before saving and back
after loading; a :class:`LocalNonpersistentObject` is never saved. Same names and semantics
as Megatron-Core's ``dist_checkpointing.mapping``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from cloudckpt._sharded_tensor import (
    CommonStateDict,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    as_ints,
    is_main_replica,
)
from cloudckpt.dict_utils import dict_list_map_inplace
from cloudckpt.errors import CheckpointingException, ShardingValidationError

__all__ = [
    "CommonStateDict",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]

logger = logging.getLogger(__name__)


class LocalNonpersistentObject:
    """Wraps a state-dict value that is never saved; loading puts the local value back."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """Return the wrapped value."""
        return self.obj


@dataclass
class ShardedObject(ShardedBase):
    """A local object that is one cell of a grid of objects (e.g. per-rank RNG state).

    Unlike a ShardedTensor, its sharding cannot change between save and load.

    Attributes:
        key: identifier of the global object.
        data: the local object, or None (metadata only).
        global_shape: shape of the grid of objects.
        global_offset: position of this object in the grid, in cells.
        replica_id: replication index (see :func:`is_main_replica`).
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = as_ints(self.global_shape)
        self.global_offset = as_ints(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Raise ShardingValidationError, naming the key, unless the offset is in the grid."""
        offset, shape = self.global_offset, self.global_shape
        if len(shape) != len(offset):
            problem = f"global_offset {offset} and global_shape {shape} differ in rank"
        elif not all(0 <= off < size for off, size in zip(offset, shape, strict=True)):
            problem = f"global_offset {offset} lies outside global_shape {shape}"
        else:
            return
        raise ShardingValidationError(f"Invalid ShardedObject {self.key!r}: {problem}", (problem,))

    def without_data(self) -> ShardedObject:
        """Return a copy with ``data=None`` and the same metadata."""
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offsets>_<shape>``, numbers joined by '.', e.g. ``rng/shard_0.3_1.8``."""
        offsets, shape = (".".join(map(str, t)) for t in (self.global_offset, self.global_shape))
        return f"{self.key}/shard_{offsets}_{shape}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Rebuild a data-less ShardedObject from its :attr:`unique_key` (key may hold '/').

        Raises CheckpointingException naming ``unique_key`` when it is malformed.
        """
        key, _, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        try:
            if not key or len(parts) != 3 or parts[0] != "shard":
                raise ValueError("expected <key>/shard_<offsets>_<shape>")
            offset, shape = (tuple(int(v) for v in p.split(".")) if p else () for p in parts[1:])
        except ValueError as exc:
            raise CheckpointingException(
                f"Malformed ShardedObject unique key {unique_key!r}: {exc}"
            ) from exc
        return cls(key, None, shape, offset, replica_id)


#: ``build_fn(key, data, replica_id, flattened_range) -> sharded sub-state-dict``.
FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, slice | None], ShardedStateDict]
#: ``merge_fn(loaded sub-state-dict) -> tensor``, the inverse of a FactoryBuildFn.
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Turns one tensor into a sharded sub-state-dict for saving, and back after loading.

    Optimizer states go through the same transformation as their parameters, so the
    built sub-state-dict must depend only on the ``build_fn`` arguments: ``key``, ``data``
    (the original tensor), ``replica_id`` and ``flattened_range`` (the flattening of the
    built ShardedTensors). ``merge_fn`` turns the loaded sub-state-dict back into a tensor.
    """

    key: str
    data: torch.Tensor | None
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """Return ``build_fn(key, data, replica_id, flattened_range)``.

        Raises CheckpointingException when the factory has no data (:meth:`without_data`).
        """
        if self.data is None:
            raise CheckpointingException(
                f"ShardedTensorFactory {self.key!r} has no data to build from"
            )
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check: a factory's metadata is whatever ``build_fn`` produces."""

    def without_data(self) -> ShardedTensorFactory:
        """Return a copy with ``data=None``."""
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace each ShardedTensorFactory in nested dicts/lists by its ``build()``, in place."""

    def _build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(_build, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: tuple[Any, ...] = ()) -> Any:
    """Fold loaded factory outputs back into tensors, in place.

    Walks ``x2``; where it holds a ShardedTensorFactory, the value at the same key path in
    ``x1`` becomes ``factory.merge_fn(value)``. A list in ``x1`` may be matched by a list
    of the same length or by a dict with int keys in ``x2``.

    ``x2`` is a subset of the loaded ``x1`` (by key paths) with factories as leaves;
    ``key`` is their key path, for error messages. Returns ``x1``, or ``x2.merge_fn(x1)``
    when ``x2`` itself is a factory. Raises CheckpointingException naming the key path
    where ``x2`` has a key, index, length or non-factory leaf that ``x1`` does not match.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x2, list) and not (isinstance(x1, list) and len(x1) == len(x2)):
        raise CheckpointingException(
            f"apply_factory_merges: {type(x1).__name__} at key {key} does not match a list of "
            f"length {len(x2)}"
        )
    items = enumerate(x2) if isinstance(x2, list) else x2.items() if isinstance(x2, dict) else None
    if items is None or not isinstance(x1, (dict, list)):
        raise CheckpointingException(
            f"apply_factory_merges: cannot merge {type(x2).__name__} "
            f"into {type(x1).__name__} at key {key}"
        )
    for k, v2 in items:
        in_x1 = k in x1 if isinstance(x1, dict) else isinstance(k, int) and 0 <= k < len(x1)
        if not in_x1:
            raise CheckpointingException(
                f"apply_factory_merges: key {(*key, k)} is missing from the loaded state dict"
            )
        x1[k] = apply_factory_merges(x1[k], v2, (*key, k))
    return x1
