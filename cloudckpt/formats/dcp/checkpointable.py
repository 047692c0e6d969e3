"""ShardedTensors as PyTorch DCP checkpointables (``torch.distributed._checkpointable``).

DCP asks each value of a state dict for its write items, its chunk list and, per
write item, the tensor holding the bytes. :class:`CheckpointableShardedTensor`
answers for one ShardedTensor and :class:`LocalShardsContainer` for several shards
of one key held by one rank (DCP allows a single value per key and rank).

How ShardedTensor offsets become DCP offsets:

* a regular shard is the DCP chunk at ``global_offset`` of size ``local_shape`` with
  a leading 1 per prepended axis, in a DCP tensor of ``global_shape``;
* a *flattened* shard (``flattened_range`` set: a contiguous range of the C-order
  elements of a grid chunk, as distributed optimizers store their state) is in
  general not a box of the global tensor, so it cannot be one DCP chunk of it. It is
  stored the way Megatron-Core's torch_dist backend stores "N-D flattened" tensors:
  the DCP tensor has shape ``(*axis_fragmentations, prod(local_shape))`` - one row
  per grid chunk holding that chunk's elements flat - and the shard is the box at
  ``(*chunk_index, flattened_range.start)`` of size ``(1, ..., 1, len(range))``.
  The original global shape is recorded in the DCP metadata (``mcore_data``, key
  ``nd_reformulated_orig_global_shape``) so loaders can undo the reformulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import ShardedTensor
from cloudckpt.validation import chunk_index, chunk_shape

__all__ = [
    "CheckpointableShardedTensor",
    "LocalShardsContainer",
    "dcp_chunk",
    "dcp_global_shape",
    "is_nd_flattened",
]


def is_nd_flattened(sh: ShardedTensor) -> bool:
    """True when ``sh`` is stored in the reformulated layout (it has a flattened range)."""
    return sh.flattened_range is not None


def _fragmentations(sh: ShardedTensor) -> tuple[int, ...]:
    """Chunks per global axis: ``axis_fragmentations``, or derived from the chunk shape."""
    if sh.axis_fragmentations is not None:
        return tuple(sh.axis_fragmentations)
    box = chunk_shape(sh)
    if any(size % ext if ext else size for size, ext in zip(sh.global_shape, box, strict=True)):
        raise CheckpointingException(
            f"tensor {sh.key!r}: flattened shards need a regular grid, but local shape "
            f"{sh.local_shape} does not divide global shape {sh.global_shape}"
        )
    return tuple(size // ext if ext else 1 for size, ext in zip(sh.global_shape, box, strict=True))


def dcp_global_shape(sh: ShardedTensor) -> torch.Size:
    """Shape of the DCP tensor that stores ``sh``'s key (see the module docstring)."""
    if not is_nd_flattened(sh):
        return torch.Size(sh.global_shape)
    return torch.Size((*_fragmentations(sh), math.prod(sh.local_shape)))


def dcp_chunk(sh: ShardedTensor) -> ChunkStorageMetadata:
    """The DCP chunk (offsets and sizes in the DCP tensor) that ``sh`` is."""
    rng = sh.flattened_range
    if rng is None:
        return ChunkStorageMetadata(
            offsets=torch.Size(sh.global_offset), sizes=torch.Size(chunk_shape(sh))
        )
    index = chunk_index(sh)
    if index is None:
        raise CheckpointingException(
            f"tensor {sh.key!r}: flattened shard at offset {sh.global_offset} is not aligned "
            f"to the chunk grid of local shape {sh.local_shape}"
        )
    ones = (1,) * len(index)
    return ChunkStorageMetadata(
        offsets=torch.Size((*index, rng.start)), sizes=torch.Size((*ones, rng.stop - rng.start))
    )


class CheckpointableShardedTensor(torch.Tensor):
    """ShardedTensor extension compatible with PyTorch DCP checkpointing library.

    Implements the ``torch.distributed._checkpointable._Checkpointable`` protocol. The
    wrapper has the shape of the DCP tensor (:func:`dcp_global_shape`) and no storage;
    it must not be used in tensor operations.
    """

    _data: torch.Tensor
    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        shape = dcp_global_shape(sh_ten)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=sh_ten.dtype)

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor) -> None:
        self._data = data
        self._sh_ten = sh_ten

    def _shard_tensor(self) -> torch.Tensor:
        """The data viewed with the DCP chunk's shape (a view when contiguous)."""
        return self._data.reshape(dcp_chunk(self._sh_ten).sizes)

    def __create_write_items__(
        self, fqn: str, sh_ten: CheckpointableShardedTensor, index: int | None = None
    ) -> list[WriteItem]:
        """Simple translation from ShardedTensor offsets into DCP offsets.

        Args:
            fqn: tensor FQN.
            sh_ten: same as ``self``.
            index: position within a LocalShardsContainer (an optimization hint of DCP).

        Returns:
            One DCP WriteItem for this shard.
        """
        chunk = dcp_chunk(sh_ten._sh_ten)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(sh_ten._data),
                    size=dcp_global_shape(sh_ten._sh_ten),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Simple translation from ShardedTensor offsets into DCP offsets."""
        return [dcp_chunk(self._sh_ten)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The underlying data tensor (viewed with the DCP chunk's shape); ``index`` is unused."""
        return self._shard_tensor()

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wrap ``sh_ten`` (which must hold data)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise CheckpointingException(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        if sh_ten.data is None:
            raise CheckpointingException(f"tensor {sh_ten.key!r} has no data to save")
        return cls(sh_ten.data, sh_ten)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        """Placeholder implementation."""
        raise NotImplementedError(
            f"{cls.__name__}.__torch_dispatch__ not implemented. "
            f"{cls.__name__} shouldn't be used with Tensor operations."
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """DCP compatible container for local shards.

    PyTorch DCP requires a single tensor per rank for a given global tensor FQN.
    This class acts as a container allowing multiple checkpointable shards per rank.

    Implements the ``torch.distributed._checkpointable._Checkpointable`` protocol.
    """

    _local_shards: list[CheckpointableShardedTensor]

    @staticmethod
    def __new__(cls, local_shards: list[torch.Tensor]) -> LocalShardsContainer:
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.size(), dtype=first.dtype)

    def __init__(self, local_shards: list[torch.Tensor]) -> None:
        shards = []
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise CheckpointingException(
                    f"LocalShardsContainer holds CheckpointableShardedTensors, got "
                    f"{type(shard).__name__}"
                )
            shards.append(shard)
        self._local_shards = shards

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        """Placeholder implementation."""
        raise NotImplementedError(
            f"{cls.__name__}.__torch_dispatch__ not implemented. "
            f"{cls.__name__} shouldn't be used with Tensor operations."
        )

    def __create_write_items__(
        self, fqn: str, local_shards_cont: LocalShardsContainer
    ) -> list[object]:
        """Delegates creating write items to local shards (each with its index hint)."""
        return list(
            chain.from_iterable(
                shard.__create_write_items__(fqn, shard, index=index)
                for index, shard in enumerate(local_shards_cont._local_shards)
            )
        )

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Delegates creating chunk items to local shards."""
        return list(chain.from_iterable(s.__create_chunk_list__() for s in self._local_shards))

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """Performs shard matching lookup based on index hint or offset.

        Args:
            index: the offset (in DCP coordinates) of the queried shard, optionally
                with an index hint, tried first.

        Raises:
            CheckpointingException: no offset given, or no shard at that offset.
        """
        if index.offset is None:
            raise CheckpointingException(
                f"cannot look up {index.fqn!r} in a LocalShardsContainer without an offset"
            )
        shards = self._local_shards
        hint = index.index
        if (
            hint is not None
            and 0 <= hint < len(shards)
            and dcp_chunk(shards[hint]._sh_ten).offsets == index.offset
        ):
            return shards[hint].__get_tensor_shard__(index)
        for shard in shards:
            if dcp_chunk(shard._sh_ten).offsets == index.offset:
                return shard.__get_tensor_shard__(index)
        raise CheckpointingException(
            f"no local shard of {index.fqn!r} at offset {tuple(index.offset)}"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._local_shards!r})"
