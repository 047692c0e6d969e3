"""Zarr v2 array format, as Megatron-Core 0.15's zarr backend writes it (pure, no I/O).

One array per ShardedTensor key: ``<key>/.zarray`` (JSON metadata) and one object
per chunk, named by its chunk index joined with ``.`` (``0.0``, ``1.0``; ``0`` for a
0-d array). cloudckpt writes chunks as raw little-endian C-order bytes without a
compressor, and reads whatever a zarr v2 writer produced: numcodecs compressors and
filters (Megatron-Core's default is Blosc), ``C`` or ``F`` order, either dimension
separator. bfloat16 is stored as ``"dtype": "bfloat16"`` (the spelling Megatron-Core
gets from tensorstore's numpy dtype), two bytes per element.

cloudckpt's chunk is the local shard shape, unless the shard is larger than the
configured chunk size: then :func:`split_chunk_shape` cuts it into a regular grid of
smaller chunks, each a contiguous range of the shard's bytes.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
import torch

from cloudckpt.errors import IncompatibleCheckpointError, MalformedCheckpointError
from cloudckpt.formats.geometry import Box, grid_box, grid_indices, overlap_slices
from cloudckpt.formats.tensor_bytes import bytes_to_tensor

ZARRAY = ".zarray"

_TORCH_TO_ZARR: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.uint8: "|u1",
    torch.bool: "|b1",
}
_ZARR_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_ZARR.items()}
# Spellings of the same little-endian types other writers use.
_ZARR_TO_TORCH.update(
    {"<i1": torch.int8, "<u1": torch.uint8, "<b1": torch.bool, "<bf16": torch.bfloat16}
)


def encode_dtype(dtype: torch.dtype, key: str = "") -> str:
    """The ``.zarray`` dtype string of a torch dtype."""
    try:
        return _TORCH_TO_ZARR[dtype]
    except KeyError:
        raise IncompatibleCheckpointError(
            f"tensor {key!r}: dtype {dtype} is not supported by the zarr backend "
            f"(supported: {', '.join(map(str, _TORCH_TO_ZARR))})"
        ) from None


def decode_dtype(spec: Any, where: str = "") -> torch.dtype:
    """The torch dtype of a ``.zarray`` dtype string."""
    if isinstance(spec, str) and spec in _ZARR_TO_TORCH:
        return _ZARR_TO_TORCH[spec]
    raise IncompatibleCheckpointError(f"{where}: unsupported zarr dtype {spec!r}")


@dataclass(frozen=True)
class ArrayMeta:
    """The contents of one ``.zarray``.

    Attributes:
        shape: global array shape.
        chunks: chunk shape (every chunk is stored at this full shape, edge ones too).
        dtype: element type.
        compressor: numcodecs config of the compressor, or None for raw bytes.
        filters: numcodecs configs of filters applied before the compressor, or None.
        order: ``"C"`` or ``"F"`` memory order inside a chunk.
        dimension_separator: ``"."`` or ``"/"`` between chunk indices in object names.
        fill_value: value of chunks that were never written, or None (cloudckpt and
            Megatron-Core write every chunk; a missing chunk is then an error).
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: torch.dtype
    compressor: dict[str, Any] | None = None
    filters: tuple[dict[str, Any], ...] | None = None
    order: str = "C"
    dimension_separator: str = "."
    fill_value: float | int | bool | None = None

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one uncompressed chunk."""
        return math.prod(self.chunks) * self.itemsize

    @property
    def grid(self) -> tuple[int, ...]:
        """Number of chunks along each axis."""
        return tuple(
            math.ceil(s / c) if c else 0 for s, c in zip(self.shape, self.chunks, strict=True)
        )

    @property
    def is_raw(self) -> bool:
        """True when chunk bytes are the elements themselves (byte ranges can be read)."""
        return self.compressor is None and not self.filters

    def chunk_key(self, index: tuple[int, ...]) -> str:
        """Object name of the chunk at ``index`` (relative to the array)."""
        return self.dimension_separator.join(map(str, index)) if index else "0"

    def to_json(self) -> bytes:
        """Serialize as a zarr v2 ``.zarray`` document."""
        doc = {
            "chunks": list(self.chunks),
            "compressor": self.compressor,
            "dimension_separator": self.dimension_separator,
            "dtype": encode_dtype(self.dtype),
            "fill_value": None,
            "filters": list(self.filters) if self.filters else None,
            "order": self.order,
            "shape": list(self.shape),
            "zarr_format": 2,
        }
        return json.dumps(doc, indent=4, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "") -> ArrayMeta:
        """Parse a ``.zarray`` document; ``where`` names it in errors."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise MalformedCheckpointError(f"{where}: not a valid .zarray: {exc}") from exc
        if not isinstance(doc, dict):
            raise MalformedCheckpointError(f"{where}: not a valid .zarray: not a JSON object")
        try:
            return cls._from_doc(doc, where)
        except (KeyError, TypeError, ValueError) as exc:
            raise MalformedCheckpointError(
                f"{where}: not a valid .zarray: bad or missing field {exc}"
            ) from exc

    @classmethod
    def _from_doc(cls, doc: dict[str, Any], where: str) -> ArrayMeta:
        if doc.get("zarr_format") != 2:
            raise IncompatibleCheckpointError(
                f"{where}: zarr_format {doc.get('zarr_format')!r} is not supported (expected 2)"
            )
        order = doc.get("order", "C")
        if order not in ("C", "F"):
            raise IncompatibleCheckpointError(f"{where}: unknown chunk order {order!r}")
        filters = doc.get("filters")
        return cls(
            shape=tuple(doc["shape"]),
            chunks=tuple(doc["chunks"]),
            dtype=decode_dtype(doc["dtype"], where),
            compressor=doc.get("compressor"),
            filters=tuple(filters) if filters else None,
            order=order,
            dimension_separator=doc.get("dimension_separator") or ".",
            fill_value=_decode_fill_value(doc.get("fill_value"), where),
        )


def split_chunk_shape(
    local_shape: tuple[int, ...], itemsize: int, max_bytes: int | None
) -> tuple[int, ...]:
    """The zarr chunk shape of an array whose shards have ``local_shape``.

    A shard of at most ``max_bytes`` is one chunk (the chunk is ``local_shape``, as
    Megatron-Core writes it). A larger one is cut into a regular grid of chunks of at
    most ``max_bytes``: walking the axes from the outermost, an axis whose inner
    block (``prod(local_shape[i+1:]) * itemsize``) still fits gets the largest divisor
    ``d`` of its length with ``d * inner <= max_bytes`` and the later axes stay whole;
    an axis whose inner block is too large gets 1 and the walk goes on. The result,
    ``(1, ..., 1, d, full, ..., full)``, divides ``local_shape`` on every axis - so
    each shard is an exact block of whole chunks - and each chunk is one contiguous
    range of the shard's C-order bytes.

    The chunk grid must be regular and must divide the shard, so ``d`` is a divisor:
    an axis of prime length (or one without a divisor near the limit) can get
    ``d = 1`` and many small chunks. That is the price of a regular grid.

    Args:
        local_shape: shape of one shard (prepended axes included).
        itemsize: bytes per element.
        max_bytes: largest chunk in bytes, or None for one chunk per shard.

    Returns:
        ``local_shape`` unchanged when it fits, is 0-d or holds no elements.
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    numel = math.prod(local_shape)
    if max_bytes is None or not local_shape or numel == 0 or numel * itemsize <= max_bytes:
        return tuple(local_shape)
    chunks = list(local_shape)
    for axis, length in enumerate(local_shape):
        inner = math.prod(local_shape[axis + 1 :]) * itemsize
        if inner <= max_bytes:
            chunks[axis] = _largest_divisor_at_most(length, max_bytes // inner)
            break
        chunks[axis] = 1
    return tuple(chunks)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` (> 0) that is at most ``limit`` (>= 1)."""
    if n <= limit:
        return n
    best = 1
    for small in range(1, math.isqrt(n) + 1):
        if n % small:
            continue
        for d in (small, n // small):
            if best < d <= limit:
                best = d
    return best


def shard_chunk_indices(
    shard_index: tuple[int, ...], local_shape: tuple[int, ...], chunks: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Grid indices of the chunks making up the shard at ``shard_index`` (shard grid).

    Chunk index = shard index * (local_shape // chunks) + index of the block inside
    the shard. Listed in C order of the blocks: for chunks from
    :func:`split_chunk_shape` this is the order of their bytes in the shard, chunk
    ``j`` being bytes ``[j * chunk_nbytes, (j + 1) * chunk_nbytes)``.
    """
    per_shard = tuple(n // c if c else 1 for n, c in zip(local_shape, chunks, strict=True))
    return [
        tuple(i * p + b for i, p, b in zip(shard_index, per_shard, block, strict=True))
        for block in itertools.product(*(range(p) for p in per_shard))
    ]


def decode_chunk(meta: ArrayMeta, raw: bytes, where: str = "") -> torch.Tensor:
    """Turn one stored chunk into a tensor of shape ``meta.chunks``."""
    if not meta.is_raw:
        raw = _decompress(meta, raw, where)
    if len(raw) != meta.chunk_nbytes:
        raise IncompatibleCheckpointError(
            f"{where}: chunk has {len(raw)} bytes, expected {meta.chunk_nbytes} "
            f"(chunk shape {meta.chunks}, {meta.dtype})"
        )
    flat = bytes_to_tensor(raw, meta.dtype)
    if meta.order == "F":
        return flat.reshape(tuple(reversed(meta.chunks))).permute(
            *reversed(range(len(meta.chunks)))
        )
    return flat.reshape(meta.chunks)


def _decompress(meta: ArrayMeta, raw: bytes, where: str) -> bytes:
    data: Any = raw
    try:
        if meta.compressor is not None:
            data = numcodecs.get_codec(meta.compressor).decode(data)
        for config in reversed(meta.filters or ()):
            data = numcodecs.get_codec(config).decode(data)
    except Exception as exc:
        raise IncompatibleCheckpointError(
            f"{where}: cannot decode chunk with {meta.compressor} / {meta.filters}: {exc}"
        ) from exc
    return bytes(np.ascontiguousarray(data).view(np.uint8))


_SPECIAL_FILLS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _decode_fill_value(value: Any, where: str) -> float | int | bool | None:
    """A zarr v2 ``fill_value``: null, a number, or NaN / Infinity spelled as strings."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str) and value in _SPECIAL_FILLS:
        return _SPECIAL_FILLS[value]
    raise IncompatibleCheckpointError(f"{where}: unsupported fill_value {value!r}")


@dataclass(frozen=True)
class ChunkOverlap:
    """Where one stored chunk meets a requested box of the global array.

    Attributes:
        index: chunk index in the chunk grid.
        in_chunk: slices selecting the overlap inside the chunk.
        in_box: slices selecting the overlap inside the requested box.
        chunk: the chunk's box of the global array, clipped to the array.
    """

    index: tuple[int, ...]
    in_chunk: tuple[slice, ...]
    in_box: tuple[slice, ...]
    chunk: Box


def overlapping_chunks(
    meta: ArrayMeta, offset: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[ChunkOverlap]:
    """Every chunk that intersects the box ``[offset, offset + shape)``, clipped to the array."""
    box = Box(offset, shape)
    for index in grid_indices(box, meta.chunks, meta.shape):
        chunk = grid_box(index, meta.chunks, meta.shape)
        overlap = overlap_slices(chunk, box)
        if overlap is not None:  # always, for positive chunk sizes
            yield ChunkOverlap(index, *overlap, chunk)


def row_byte_range(meta: ArrayMeta, in_chunk: tuple[slice, ...]) -> tuple[int, int]:
    """Bytes of a raw C-order chunk that hold the rows (axis-0 slice) of ``in_chunk``.

    Reading only this range is enough to extract ``in_chunk``; for a 0-d or 1-d
    array it is exact.
    """
    if not in_chunk:
        return 0, meta.chunk_nbytes
    row = math.prod(meta.chunks[1:]) * meta.itemsize
    return in_chunk[0].start * row, in_chunk[0].stop * row
