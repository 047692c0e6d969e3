"""One rank's sharding metadata in columns: what a save gathers on the coordinator to
check every rank's keys and sharding (:mod:`cloudckpt.table_validation`).

A :class:`ShardTable` holds, for each ShardedTensor and ShardedObject of a rank (in
its order), what the checks read, in two parts:

* ``static``: one byte string (zlib-compressed) with the keys (UTF-8, once per
  distinct key) and, per shard, the columns that do not depend on the rank's place
  in a data-parallel group (key index, kind, dtype, flattened or not, global and
  local shape, prepended axes, axis fragmentations): DP replicas send identical
  ``static`` parts, which the coordinator decodes once per distinct ``digest``;
* ``dynamic``: one integer array, a column per shard: its chunk in the grid its own
  metadata defines (-1 when off that grid: the offsets of those *odd* shards travel
  apart, in ``odd``), main replica (1/0), flattened range start and stop.

A rank whose shards the columns cannot hold (another ShardedBase type, a dtype
outside torch's, inconsistent ranks) sends its shards as objects instead
(``shards``); the coordinator then runs the object-based checks on every rank.
:func:`rebuild_shards` turns a table back into data-less ShardedTensors and
ShardedObjects equal, for the checks, to the ones it was built from (replica ids
become 0 or 1: only whether a shard is the main replica matters there).
"""

from __future__ import annotations

import copy
import hashlib
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

TENSOR, OBJECT = 0, 1
"""Values of the kind column."""
FLAT, MISMATCH_OK, NO_GRID = 1, 2, 4
"""Bits of the flags column: flattened_range set, allow_shape_mismatch, no
axis_fragmentations."""
KEY, KIND, DTYPE, NDIM, PREPEND, FLAGS = range(6)
"""Columns of the decoded static array; then global shape, local shape (padded to the
global rank with zeros: its first ``ndim - prepend`` values count) and axis
fragmentations, ``width`` columns each."""
_HEAD = 6
DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
"""torch's dtypes, by code (the same list on every rank of one torch version)."""
_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}
_INT32 = np.iinfo(np.int32)


class _Unfit(Exception):
    """A shard the columns cannot hold."""


@dataclass(frozen=True)
class StaticPart:
    """A decoded ``static`` part: the distinct keys and the per-shard columns."""

    keys: list[str]
    columns: np.ndarray  # int64 [shards, 6 + 3 * width]
    width: int

    def block(self, first: int) -> np.ndarray:
        """Columns ``first`` .. ``first + width`` (global shape: _HEAD; local: +width)."""
        return self.columns[:, first : first + self.width]

    @property
    def global_shapes(self) -> np.ndarray:
        return self.block(_HEAD)

    @property
    def local_shapes(self) -> np.ndarray:
        return self.block(_HEAD + self.width)

    @property
    def fragmentations(self) -> np.ndarray:
        return self.block(_HEAD + 2 * self.width)


@dataclass(frozen=True)
class ShardTable:
    """One rank's sharding metadata, columnar (see the module docstring).

    Attributes:
        digest: a hash of ``static`` (equal parts, equal digests).
        static: keys and rank-independent columns (:func:`decode_static`).
        dynamic: int32 or int64 ``[4, shards]``: the shard's chunk in the grid of its
            chunk shape (C order; -1 when off the grid, or a flattened range empty or
            outside the chunk: such shards are *odd*), main replica (1/0), flattened
            range start and stop (0, 0 when not flattened).
        odd: int64 ``[odd shards, 1 + width]``: row and global offset of each odd shard
            (the others' offsets follow from their chunk).
        shards: the shards as objects, when the columns cannot hold them (then
            ``static`` and ``dynamic`` are empty).
    """

    digest: bytes
    static: bytes
    dynamic: np.ndarray
    odd: np.ndarray
    shards: tuple[ShardedBase, ...] | None = None

    @classmethod
    def of(cls, shards: Iterable[ShardedBase]) -> ShardTable:
        """The table of one rank's shards (data ignored). O(shards)."""
        shards = list(shards)
        try:
            static, dynamic, odd = _columns(shards)
        except _Unfit:
            empty = np.zeros((0, 0), np.int64)
            return cls(b"", b"", empty, empty, tuple(map(_dataless, shards)))
        return cls(hashlib.blake2b(static, digest_size=16).digest(), static, dynamic, odd)

    def __len__(self) -> int:
        return len(self.shards) if self.shards is not None else self.dynamic.shape[1]

    def key_names(self) -> set[str]:
        """The keys of the shards it was built from."""
        if self.shards is not None:
            return {sh.key for sh in self.shards}
        return set(decode_static(self.static).keys) if self.static else set()


def check_metadata(shards: Iterable[ShardedBase]) -> None:
    """Run each ShardedTensor's and ShardedObject's own metadata checks on it without
    its data, as ``without_data`` does (a shard edited after it was made fails here, on
    its rank). Raises what ``validate_metadata_integrity`` raises."""
    for sh in shards:
        if isinstance(sh, ShardedTensor | ShardedObject):
            _dataless(sh).validate_metadata_integrity()


def _dataless(sh: ShardedBase) -> ShardedBase:
    """A copy of ``sh`` without data, made without re-running its constructor's checks
    (``without_data`` would: a shard edited after it was made may fail them)."""
    if type(sh) in (ShardedTensor, ShardedObject):  # plain attributes: copied directly
        copied = object.__new__(type(sh))
        copied.__dict__.update(sh.__dict__)
    else:
        copied = copy.copy(sh)
    object.__setattr__(copied, "data", None)
    return copied


def _ints(values: Sequence[int], width: int) -> list[int]:
    """``values`` padded with zeros to ``width``."""
    return [*values, *(0,) * (width - len(values))]


def _columns(shards: list[ShardedBase]) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(static bytes, dynamic array, odd rows) of ``shards``; raises _Unfit."""
    width = max((_rank_of(sh) for sh in shards), default=0)
    key_index: dict[str, int] = {}
    static_rows, dynamic_rows, odd = [], [], []
    for row, sh in enumerate(shards):
        k = key_index.setdefault(sh.key, len(key_index))
        main = int(is_main_replica(sh.replica_id))
        if type(sh) is ShardedTensor:
            static_rows.append(_tensor_static(sh, k, width))
            rng = sh.flattened_range
            span = [0, 0] if rng is None else [rng.start, rng.stop]
            cell = _tensor_cell(sh)
        else:
            assert type(sh) is ShardedObject
            shape = _ints(sh.global_shape, width)
            static_rows.append(
                [k, OBJECT, -1, len(sh.global_shape), 0, 0, *shape, *[0] * width * 2]
            )
            span = [0, 0]
            cell = _cell(sh.global_offset, (1,) * len(sh.global_shape), sh.global_shape)
        dynamic_rows.append([cell, main, *span])
        if cell < 0:
            odd.append([row, *_ints(sh.global_offset, width)])
    static = np.array(static_rows, np.int64).reshape(len(shards), _HEAD + 3 * width)
    dynamic = np.array(dynamic_rows, np.int64).reshape(len(shards), 4).T
    if dynamic.size and _INT32.min <= dynamic.min() and dynamic.max() <= _INT32.max:
        dynamic = dynamic.astype(np.int32)
    odd_rows = np.array(odd, np.int64).reshape(len(odd), 1 + width)
    return _encode_static(list(key_index), static, width), np.ascontiguousarray(dynamic), odd_rows


def _cell(offset: Sequence[int], chunk: Sequence[int], shape: Sequence[int]) -> int:
    """The index, in C order, of the chunk at ``offset`` in the grid of chunks of
    ``chunk`` over ``shape``; -1 when ``offset`` is not on that grid (or a chunk is
    empty)."""
    cell = 0
    for off, size, extent in zip(offset, chunk, shape, strict=True):
        cells = -(-extent // size) if size > 0 else 0
        if size <= 0 or off % size or not 0 <= off // size < cells:
            return -1
        cell = cell * cells + off // size
    return cell


def _tensor_cell(sh: ShardedTensor) -> int:
    """:func:`_cell` of a tensor shard; -1 too for a flattened range that is not a
    non-empty part of its local elements."""
    chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    rng = sh.flattened_range
    if rng is not None and not 0 <= rng.start < rng.stop <= math.prod(chunk):
        return -1
    return _cell(sh.global_offset, chunk, sh.global_shape)


def _rank_of(sh: ShardedBase) -> int:
    """The global rank of ``sh``; raises _Unfit unless its metadata is consistent."""
    if type(sh) is ShardedTensor:
        ndim = len(sh.global_shape)
        rng = sh.flattened_range
        frag = sh.axis_fragmentations
        if (
            len(sh.local_shape) + sh.prepend_axis_num != ndim
            or sh.prepend_axis_num < 0
            or len(sh.global_offset) != ndim
            or (frag is not None and len(frag) != ndim)
            or sh.dtype not in _DTYPE_CODES
            or (rng is not None and (rng.step not in (None, 1) or not _is_int(rng.start, rng.stop)))
        ):
            raise _Unfit
        return ndim
    if type(sh) is ShardedObject and len(sh.global_offset) == len(sh.global_shape):
        return len(sh.global_shape)
    raise _Unfit


def _is_int(*values: object) -> bool:
    return all(isinstance(v, int) for v in values)


def _tensor_static(sh: ShardedTensor, k: int, width: int) -> list[int]:
    frag = sh.axis_fragmentations
    flags = (FLAT if sh.flattened_range is not None else 0) | (
        MISMATCH_OK if sh.allow_shape_mismatch else 0
    )
    flags |= NO_GRID if frag is None else 0
    return [
        k,
        TENSOR,
        _DTYPE_CODES[sh.dtype],
        len(sh.global_shape),
        sh.prepend_axis_num,
        flags,
        *_ints(sh.global_shape, width),
        *_ints(sh.local_shape, width),
        *_ints(frag or (), width),
    ]


def _encode_static(keys: list[str], columns: np.ndarray, width: int) -> bytes:
    encoded = [k.encode("utf-8", "surrogatepass") for k in keys]
    head = np.array([len(columns), width, len(keys)], np.int64)
    lengths = np.array([len(e) for e in encoded], np.int64)
    raw = b"".join([head.tobytes(), lengths.tobytes(), columns.tobytes(), *encoded])
    return zlib.compress(raw, 1)


def decode_static(static: bytes) -> StaticPart:
    """The keys and columns of a table's ``static`` part."""
    static = zlib.decompress(static)
    rows, width, nkeys = (int(v) for v in np.frombuffer(static, np.int64, 3))
    lengths = np.frombuffer(static, np.int64, nkeys, 24)
    at = 24 + 8 * nkeys
    columns = np.frombuffer(static, np.int64, rows * (_HEAD + 3 * width), at)
    at += columns.nbytes
    ends = (at + np.cumsum(lengths)).tolist()
    starts = [at, *ends[:-1]] if ends else []
    keys = [static[a:b].decode("utf-8", "surrogatepass") for a, b in zip(starts, ends, strict=True)]
    return StaticPart(keys, columns.reshape(rows, _HEAD + 3 * width), width)


def rebuild_shards(
    table: ShardTable, part: StaticPart | None = None, rows: Sequence[int] | None = None
) -> list[ShardedBase]:
    """Data-less shards equal, for the checks, to those ``table`` was built from (only
    ``rows``, in order, when given); ``part``: its decoded static part, if at hand."""
    if table.shards is not None:
        shards = list(table.shards)
        return shards if rows is None else [shards[i] for i in rows]
    part = part or decode_static(table.static)
    index = list(range(table.dynamic.shape[1]) if rows is None else rows)
    odd = {row: tuple(offset) for row, *offset in table.odd.tolist()}
    statics = part.columns[index].tolist()
    dynamics = table.dynamic[:, index].T.tolist()
    return [
        _shard(part, s, d, odd.get(i)) for i, s, d in zip(index, statics, dynamics, strict=True)
    ]


def chunk_offset(part: StaticPart, static: list[int], cell: int) -> tuple[int, ...]:
    """The global offset of the chunk ``cell`` of a shard's own grid."""
    width, ndim, prepend = part.width, static[NDIM], static[PREPEND]
    shape = static[_HEAD : _HEAD + ndim]
    if static[KIND] == OBJECT:
        chunk = [1] * ndim
    else:
        chunk = [1] * prepend + static[_HEAD + width : _HEAD + width + ndim - prepend]
    index = []
    for extent, size in zip(reversed(shape), reversed(chunk), strict=True):
        cells = -(-extent // size)
        cell, at = divmod(cell, cells)
        index.append(at * size)
    return tuple(reversed(index))


def _shard(
    part: StaticPart, static: list[int], dynamic: list[int], odd: tuple[int, ...] | None
) -> ShardedBase:
    """One shard from its static and dynamic rows (``odd``: its padded offset, for an
    odd shard), built without re-running the constructors' checks (its own shard
    passed them)."""
    width, ndim = part.width, static[NDIM]
    cell, main, start, stop = dynamic
    key = part.keys[static[KEY]]
    offset = odd[:ndim] if odd is not None else chunk_offset(part, static, cell)
    replica_id = 0 if main else 1
    global_shape = tuple(static[_HEAD : _HEAD + ndim])
    if static[KIND] == OBJECT:
        obj = object.__new__(ShardedObject)
        obj.__dict__.update(
            key=key,
            data=None,
            global_shape=global_shape,
            global_offset=offset,
            replica_id=replica_id,
        )
        return obj
    flags, prepend = static[FLAGS], static[PREPEND]
    local = _HEAD + width
    frag = _HEAD + 2 * width
    tensor = object.__new__(ShardedTensor)
    tensor.__dict__.update(
        key=key,
        data=None,
        dtype=DTYPES[static[DTYPE]],
        local_shape=tuple(static[local : local + ndim - prepend]),
        global_shape=global_shape,
        global_offset=offset,
        axis_fragmentations=None if flags & NO_GRID else tuple(static[frag : frag + ndim]),
        replica_id=replica_id,
        prepend_axis_num=prepend,
        allow_shape_mismatch=bool(flags & MISMATCH_OK),
        flattened_range=slice(start, stop) if flags & FLAT else None,
    )
    return tensor
