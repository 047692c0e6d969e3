"""ShardedTensor: one local tensor as a shard of a global tensor, and the types and
helpers it shares with the rest of :mod:`cloudckpt.mapping` (which re-exports them:
import them from there)."""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from cloudckpt.errors import CheckpointingException, ShardingValidationError

logger = logging.getLogger(__name__)

#: A plain (possibly nested) state dict, as returned by ``module.state_dict()``.
StateDict = dict[str, Any]
#: The non-sharded part of a state dict, saved once by rank 0.
CommonStateDict = dict[str, Any]
#: A state dict whose tensors are wrapped in ShardedTensor / ShardedObject / factories.
ShardedStateDict = dict[str, Any]
#: Replication index of a shard; 0 or all zeros marks the main replica.
ReplicaId = int | tuple[int, ...]


class ShardedBase(ABC):
    """Interface of ShardedTensor, ShardedObject and ShardedTensorFactory.

    ``key`` names the global tensor or object, ``data`` is the local payload (None for
    metadata only) and ``replica_id`` says which replica of the shard this process holds.
    """

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException if the metadata attributes are inconsistent."""

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """Return a copy of this instance with ``data=None``."""


def as_ints(x: Any) -> tuple[int, ...]:
    """``x`` as a tuple of Python ints (shapes and offsets)."""
    return tuple(int(v) for v in x)


def _set(t: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return (*t[:i], v, *t[i + 1 :])


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor together with its place in a global tensor split among processes.

    Attributes:
        key: unique identifier of the global tensor.
        data: the local tensor, or None (metadata only, e.g. before loading).
        dtype: dtype of the local and the global tensor.
        local_shape: shape of the local tensor.
        global_shape: shape of the global tensor (``prepend_axis_num`` more axes).
        global_offset: index of the local tensor's first element in the global tensor.
        axis_fragmentations: equal chunks per global axis; None without a regular grid.
        replica_id: replication index (see :func:`is_main_replica`).
        prepend_axis_num: leading global axes the local tensor lacks (extent 1 on each).
        allow_shape_mismatch: on load the stored global shape may differ (the tensor is
            cut or zero-padded); also lifts the bounds check.
        flattened_range: if set, ``data`` is ``local.flatten()[flattened_range]``.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        self.local_shape = as_ints(self.local_shape)
        self.global_shape = as_ints(self.global_shape)
        self.global_offset = as_ints(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = as_ints(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check the metadata against itself and ``data``; report every violation at once.

        Raises ShardingValidationError (a CheckpointingException and ValueError) naming
        the key, with one entry per problem in ``violations``.
        """
        violations = self._rank_violations()
        if not violations:
            violations = self._data_violations() + self._bounds_violations()
        if violations:
            message = f"Invalid ShardedTensor {self.key!r}: " + "; ".join(violations)
            raise ShardingValidationError(message, tuple(violations))

    def _rank_violations(self) -> list[str]:
        ndim, out, rng = len(self.global_shape), [], self.flattened_range
        if self.prepend_axis_num < 0 or len(self.local_shape) + self.prepend_axis_num != ndim:
            out.append(
                f"local_shape {self.local_shape} with prepend_axis_num="
                f"{self.prepend_axis_num} does not fit global_shape {self.global_shape}"
            )
        if len(self.global_offset) != ndim:
            out.append(f"global_offset {self.global_offset} has not the rank of global_shape")
        if len(self.axis_fragmentations or self.global_shape) != ndim:
            out.append(
                f"axis_fragmentations {self.axis_fragmentations} has not the rank of global_shape"
            )
        if rng is not None and not (isinstance(rng.start, int) and isinstance(rng.stop, int)):
            out.append(f"flattened_range {rng} needs integer start and stop")
        return out

    def _data_violations(self) -> list[str]:
        out, rng, numel = [], self.flattened_range, math.prod(self.local_shape)
        if rng is not None and rng.step not in (None, 1):
            out.append(f"flattened_range {rng} has step {rng.step}; only 1 is supported")
        if rng is not None and not 0 <= rng.start <= rng.stop <= numel:
            out.append(f"flattened_range {rng} lies outside the {numel} local elements")
        if self.data is None:
            return out
        if self.data.dtype != self.dtype:
            out.append(f"data dtype {self.data.dtype} differs from dtype {self.dtype}")
        shape = tuple(self.data.shape)
        if rng is None and shape != self.local_shape:
            out.append(f"data shape {shape} differs from local_shape {self.local_shape}")
        if rng is not None and shape != (rng.stop - rng.start,):
            out.append(f"flat data must be 1-D of length {rng.stop - rng.start}, got {shape}")
        return out

    def _bounds_violations(self) -> list[str]:
        out, extents = [], (1,) * self.prepend_axis_num + self.local_shape
        for axis, (off, ext, size) in enumerate(
            zip(self.global_offset, extents, self.global_shape, strict=True)
        ):
            if min(off, ext, size) < 0:
                out.append(f"axis {axis}: negative offset or shape")
            elif off + ext > size and not self.allow_shape_mismatch:
                out.append(
                    f"axis {axis}: offset {off} + local extent {ext} exceeds global shape {size}"
                )
        if any(f < 1 for f in self.axis_fragmentations or ()):
            out.append(f"axis_fragmentations {self.axis_fragmentations} must be positive")
        return out

    @property
    def has_regular_grid(self) -> bool:
        """True when the shards form a regular grid (``axis_fragmentations`` is set)."""
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of this shard in the global tensor, so ``global[st.global_slice()]`` is it.

        Per global axis: the offset (int) on prepended axes, else a slice of the local extent.
        """
        rest = zip(self.global_offset[self.prepend_axis_num :], self.local_shape, strict=True)
        prepended = self.global_offset[: self.prepend_axis_num]
        return prepended + tuple(slice(off, off + ext) for off, ext in rest)

    def local_coordinates(self) -> tuple[np.ndarray, ...]:
        """Coordinates in the local tensor of a flat shard's elements, in flat (C) order.

        Returns one int64 array per local axis, so ``local[coords]`` equals ``data``.
        Raises CheckpointingException when ``flattened_range`` is None.
        """
        rng = self.flattened_range
        if rng is None:
            raise CheckpointingException(
                f"coordinates are undefined for ShardedTensor {self.key!r} without flattened_range"
            )
        flat = np.arange(rng.start, rng.stop, dtype=np.int64)
        if not self.local_shape:  # a 0-D shard has no local axes
            return ()
        return tuple(c.astype(np.int64) for c in np.unravel_index(flat, self.local_shape))

    def global_coordinates(self) -> tuple[np.ndarray, ...]:
        """Coordinates in the global tensor of a flat shard's elements, in flat (C) order.

        Returns one int64 array per global axis, so ``global[coords]`` equals ``data``.
        Raises CheckpointingException when ``flattened_range`` is None.
        """
        local, p, rng = self.local_coordinates(), self.prepend_axis_num, self.flattened_range
        n = 0 if rng is None else rng.stop - rng.start  # local_coordinates raised if None
        prepended = tuple(np.full(n, off, dtype=np.int64) for off in self.global_offset[:p])
        shifted = zip(local, self.global_offset[p:], strict=True)
        return prepended + tuple(c + off for c, off in shifted)

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Index of this shard in the grid of chunks of its local shape.

        Returns, per global axis, the offset on prepended axes, else offset // local extent.
        Raises CheckpointingException when an offset is not a multiple of the local extent.
        """
        p = self.prepend_axis_num
        chunk = list(self.global_offset[:p])
        pairs = zip(self.global_offset[p:], self.local_shape, strict=True)
        for axis, (off, ext) in enumerate(pairs, p):
            if (off % ext if ext else off) != 0:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: offset {off} on axis {axis} is not a multiple "
                    f"of the local extent {ext}; the shard is not aligned to a chunk grid"
                )
            chunk.append(off // ext if ext else 0)
        return tuple(chunk)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Size of one grid chunk per global axis: ``global_shape // axis_fragmentations``.

        Raises CheckpointingException without a regular grid, or (unless
        ``allow_shape_mismatch``) when an axis is not divisible by its fragmentation.
        """
        if self.axis_fragmentations is None:
            raise CheckpointingException(f"ShardedTensor {self.key!r} has no regular grid")
        pairs = list(zip(self.global_shape, self.axis_fragmentations, strict=True))
        for axis, (size, fragm) in enumerate(pairs):
            if size % fragm and not self.allow_shape_mismatch:
                raise CheckpointingException(
                    f"ShardedTensor {self.key!r}: axis {axis} of size {size} is not divisible "
                    f"by its fragmentation {fragm}"
                )
        return tuple(size // fragm for size, fragm in pairs)

    def without_data(self) -> ShardedTensor:
        """Return a copy with ``data=None`` and the same metadata."""
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Build a ShardedTensor from the local tensor and its chunk index along split axes.

        Args:
            key: unique key of the global tensor.
            data: the local tensor.
            *rank_offsets: ``(axis, axis_rank_offset, axis_fragm)``: global ``axis``
                (prepended axes counted) is cut into ``axis_fragm`` chunks of the local
                extent and ``data`` is chunk ``axis_rank_offset``. Other axes are whole.
            replica_id, prepend_axis_num, **init_kwargs: other ShardedTensor fields.
            flattened_range: must be None; use :meth:`from_rank_offsets_flat`.

        Raises:
            ShardingValidationError: invalid or repeated axis, bad offsets, a flattened_range.
        """
        if flattened_range is not None:
            raise ShardingValidationError(
                f"ShardedTensor {key!r}: from_rank_offsets cannot build a flat ShardedTensor; "
                "use ShardedTensor.from_rank_offsets_flat"
            )
        extents = (1,) * prepend_axis_num + tuple(data.shape)
        shape, offset, fragms = extents, (0,) * len(extents), (1,) * len(extents)
        seen: set[int] = set()
        for rank_offset in rank_offsets:
            axis, rank, fragm = _check_rank_offset(key, rank_offset, len(extents), seen)
            shape = _set(shape, axis, fragm * extents[axis])
            offset = _set(offset, axis, rank * extents[axis])
            fragms = _set(fragms, axis, fragm)
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            shape,
            offset,
            fragms,
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *args: Any,
        flattened_range: slice | None = None,
        **kwargs: Any,
    ) -> ShardedTensor:
        """Build a flat ShardedTensor: ``data`` is ``local.flatten()[flattened_range]``.

        ``non_flat_local_shape`` is the shape of the whole local shard; ``*args`` and
        ``**kwargs`` go to :meth:`from_rank_offsets`. ``flattened_range`` is required: a
        non-empty ``slice(start, stop)`` (step None or 1) within the shard's element count.

        Raises:
            ShardingValidationError: missing or invalid range, data not 1-D of its length,
                or invalid rank offsets.
        """
        rng = flattened_range
        if rng is None or not (
            isinstance(rng.start, int) and isinstance(rng.stop, int) and rng.start < rng.stop
        ):
            raise ShardingValidationError(
                f"ShardedTensor {key!r}: from_rank_offsets_flat needs a non-empty integer "
                f"flattened_range, got {rng} (use from_rank_offsets for a non-flat tensor)"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        non_flat = cls.from_rank_offsets(key, meta, *args, **kwargs)
        return replace(non_flat, data=data, flattened_range=rng)

    def init_data(
        self, device: str | torch.device, init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocate ``data`` when it is None; a no-op otherwise.

        ``init_fn(shape, dtype=self.dtype, device=device)`` is called with ``local_shape``,
        or with ``(len(flattened_range),)`` for a flat shard.
        """
        if self.data is not None:
            return
        rng = self.flattened_range
        shape = self.local_shape if rng is None else (rng.stop - rng.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """Analogue of :func:`torch.narrow`, applied to the local tensor on every rank.

        Each rank keeps ``[start, start + length)`` of its local extent along local axis
        ``dim``, so the global extent and offset along it scale by ``length / local extent``.

        Returns exactly one ShardedTensor for a non-flat shard. For a flat one (``dim`` must
        be 0): ``[]`` when the kept rows miss ``flattened_range``, else one ShardedTensor
        holding the overlap, its range re-based onto the narrowed local shape.

        Raises CheckpointingException for bad arguments, no regular grid along ``dim``,
        or a flat shard with ``dim != 0``.
        """
        global_shape, global_offset = self._narrowed_global(dim, start, length)
        rng, data = self.flattened_range, self.data
        if rng is None:
            data = None if data is None else data.narrow(dim, start, length)
        elif dim != 0:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: a flat shard narrows only along dim 0, not {dim}"
            )
        else:
            row = math.prod(self.local_shape[1:])
            lo, hi = max(rng.start, start * row), min(rng.stop, (start + length) * row)
            if lo >= hi:
                return []
            data = None if data is None else data[lo - rng.start : hi - rng.start]
            rng = slice(lo - start * row, hi - start * row)
        return [
            replace(
                self,
                data=data,
                local_shape=_set(self.local_shape, dim, length),
                global_shape=global_shape,
                global_offset=global_offset,
                flattened_range=rng,
            )
        ]

    def _narrowed_global(
        self, dim: int, start: int, length: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if not 0 <= dim < len(self.local_shape):
            raise CheckpointingException(f"ShardedTensor {self.key!r}: bad narrow dim {dim}")
        ext = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > ext:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrow({dim}, {start}, {length}) exceeds the "
                f"local extent {ext}"
            )
        gdim = dim + self.prepend_axis_num
        size, off = self.global_shape[gdim], self.global_offset[gdim]
        if ext == 0 or size % ext or off % ext:
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: narrowing needs a regular grid along dim {dim} "
                f"(global size {size} and offset {off} multiples of local extent {ext})"
            )
        return (
            _set(self.global_shape, gdim, size // ext * length),
            _set(self.global_offset, gdim, off // ext * length),
        )


def _check_rank_offset(
    key: str, rank_offset: Any, ndim: int, seen: set[int]
) -> tuple[int, int, int]:
    """Validate one (axis, axis_rank_offset, axis_fragm) triple and record its axis."""
    try:
        axis, rank, fragm = (int(v) for v in rank_offset)
    except (TypeError, ValueError) as exc:
        raise ShardingValidationError(
            f"ShardedTensor {key!r}: rank offset {rank_offset!r} is not an "
            "(axis, axis_rank_offset, axis_fragm) triple"
        ) from exc
    checks = (
        (not 0 <= axis < ndim, f"axis {axis} is outside the {ndim} global axes"),
        (axis in seen, f"axis {axis} is given more than once"),
        (fragm < 1, f"axis fragmentation {fragm} must be positive"),
        (not 0 <= rank < fragm, f"axis rank offset {rank} is outside [0, {fragm})"),
    )
    problem = next((message for failed, message in checks if failed), None)
    if problem is not None:
        raise ShardingValidationError(
            f"ShardedTensor {key!r}: invalid rank offset {tuple(rank_offset)}: {problem}"
        )
    seen.add(axis)
    return axis, rank, fragm


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the main replica (the int 0 or a tuple of zeros), the one that is saved.

    The application assigns replica ids; each shard needs exactly one main replica.
    """
    if isinstance(replica_id, int):
        return replica_id == 0
    return not any(replica_id)  # every (integer) index is 0
