"""Reading ShardedTensors out of zarr v2 arrays, with resharding.

A requested shard is a box of the global array (its offset and local shape). The
reader finds the stored chunks overlapping that box, fetches them concurrently
through :mod:`cloudckpt.storage` - for raw chunks only the byte range of the rows
it needs - and copies the overlaps into a fresh tensor (boxes and overlaps:
:mod:`cloudckpt.formats.geometry`). Requests are processed in batches of bounded
size so that peak memory stays near the size of one batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from cloudckpt import dist
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    CheckpointNotFoundError,
    TensorMismatchError,
)
from cloudckpt.formats.geometry import Box, copy_overlap, overlap_slices, shard_box
from cloudckpt.formats.tensor_bytes import bytes_to_tensor, tensor_bytes
from cloudckpt.formats.zarr.layout import (
    ZARRAY,
    ArrayMeta,
    decode_chunk,
    overlapping_chunks,
    row_byte_range,
)
from cloudckpt.mapping import ShardedTensor
from cloudckpt.storage import CheckpointStorage, ReadRequest
from cloudckpt.validation import chunk_shape

logger = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class _Piece:
    """One read serving one overlap of one requested tensor: ``box`` is what the read
    yields, of the global array (clipped to it): the chunk's box, or of a row range,
    its rows."""

    request: ReadRequest
    box: Box


class TensorReader:
    """Loads ShardedTensors from the zarr arrays of one checkpoint.

    Args:
        storage: the checkpoint.
        batch_bytes: upper bound on the bytes fetched per batch of requests.
    """

    def __init__(self, storage: CheckpointStorage, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.storage = storage
        self.batch_bytes = batch_bytes
        self._metas: dict[str, ArrayMeta] = {}

    def array_keys(self) -> list[str]:
        """Keys of every array in the checkpoint (one listing)."""
        suffix = "/" + ZARRAY
        return [p[: -len(suffix)] for p in self.storage.list() if p.endswith(suffix)]

    def all_array_metas(self) -> dict[str, ArrayMeta]:
        """``{key: ArrayMeta}`` for every array in the checkpoint."""
        return self.metas(self.array_keys())

    def metas(self, keys: Sequence[str]) -> dict[str, ArrayMeta]:
        """Read (once, concurrently) and return the ``.zarray`` of each key."""
        todo = sorted({k for k in keys if k not in self._metas})
        try:
            raws = self.storage.read_many([ReadRequest(f"{k}/{ZARRAY}") for k in todo])
        except CheckpointNotFoundError:
            present = set(self.array_keys())
            missing = [k for k in todo if k not in present]
            if not missing:  # the .zarray of a listed array vanished meanwhile
                raise
            raise CheckpointKeyNotFoundError.of(
                "tensor(s)", missing, self.storage.uri, dist.get_rank()
            ) from None
        for key, raw in zip(todo, raws, strict=True):
            self._metas[key] = ArrayMeta.from_json(raw, self.storage.child_uri(f"{key}/{ZARRAY}"))
        return {k: self._metas[k] for k in keys}

    def load_all(self, tensors: Sequence[ShardedTensor]) -> dict[int, torch.Tensor]:
        """Load every requested tensor; returns ``{id(sharded_tensor): tensor}``."""
        metas = self.metas([t.key for t in tensors])
        for sh in tensors:
            self._check_compatible(sh, metas[sh.key])
        out: dict[int, torch.Tensor] = {}
        for batch in self._batches(tensors, metas):
            out.update(self._load_batch(batch, metas))
        return out

    def _check_compatible(self, sh: ShardedTensor, meta: ArrayMeta) -> None:
        where = f"tensor {sh.key!r} in checkpoint {self.storage.uri!r}"
        if meta.dtype != sh.dtype:
            raise TensorMismatchError(f"{where}: stored dtype {meta.dtype}, requested {sh.dtype}")
        if tuple(meta.shape) != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
            raise TensorMismatchError(
                f"Global shape mismatch for loaded ({tuple(meta.shape)}) and expected "
                f"({tuple(sh.global_shape)}) tensor for key {sh.key} ({where}: stored global "
                f"shape {tuple(meta.shape)}, requested {tuple(sh.global_shape)}; set "
                "allow_shape_mismatch=True to cut or pad)"
            )

    def _batches(
        self, tensors: Sequence[ShardedTensor], metas: dict[str, ArrayMeta]
    ) -> Iterator[list[ShardedTensor]]:
        batch: list[ShardedTensor] = []
        size = 0
        for sh in tensors:
            nbytes = math.prod(chunk_shape(sh)) * metas[sh.key].itemsize
            if batch and size + nbytes > self.batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append(sh)
            size += nbytes
        if batch:
            yield batch

    def _load_batch(
        self, batch: list[ShardedTensor], metas: dict[str, ArrayMeta]
    ) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        jobs: list[tuple[ReadRequest, memoryview]] = []
        filled: list[tuple[ShardedTensor, torch.Tensor]] = []
        staged = []
        for sh in batch:
            meta = metas[sh.key]
            direct = _direct_reads(sh, meta) if meta.fill_value is None else None
            if direct is None:
                staged.append(sh)
                continue
            result = torch.empty(_result_numel(sh), dtype=sh.dtype)
            view, size = tensor_bytes(result), metas[sh.key].itemsize
            jobs += [
                (d.request, view[d.out_start * size : (d.out_start + d.length) * size])
                for d in direct
            ]
            filled.append((sh, result))
        self.storage.read_into_many(jobs)
        # only now: _finish may copy to the requested device, which must see the bytes
        for sh, result in filled:
            out[id(sh)] = _finish(sh, result.reshape(_result_shape(sh)))
        out.update(self._load_staged(staged, metas))
        return out

    def _load_staged(
        self, batch: list[ShardedTensor], metas: dict[str, ArrayMeta]
    ) -> dict[int, torch.Tensor]:
        """Fetch whole chunks (or row ranges) and copy the overlaps: any sharding, any codec."""
        plans = {id(sh): self._plan(sh, metas[sh.key]) for sh in batch}
        # Arrays with a fill_value may omit chunks (zarr writers skip all-fill chunks).
        fill_keys = {sh.key for sh in batch if metas[sh.key].fill_value is not None}
        present = {path for key in fill_keys for path in self.storage.list(key)}
        owner = {p.request: sh.key for sh in batch for p in plans[id(sh)]}
        unique = sorted(
            (r for r, key in owner.items() if key not in fill_keys or r.path in present),
            key=lambda r: (r.path, r.start),
        )
        fetched = dict(zip(unique, self.storage.read_many(unique), strict=True))
        return {id(sh): self._assemble(sh, metas[sh.key], plans[id(sh)], fetched) for sh in batch}

    def _plan(self, sh: ShardedTensor, meta: ArrayMeta) -> list[_Piece]:
        pieces = []
        for overlap in overlapping_chunks(meta, *shard_box(sh)):
            path = f"{sh.key}/{meta.chunk_key(overlap.index)}"
            if meta.is_raw and meta.order == "C" and overlap.in_chunk:
                start, end = row_byte_range(meta, overlap.in_chunk)
                rows = _rows(overlap.chunk, overlap.in_chunk[0])
                pieces.append(_Piece(ReadRequest(path, start, end), rows))
            else:
                pieces.append(_Piece(ReadRequest(path), overlap.chunk))
        return pieces

    def _assemble(
        self,
        sh: ShardedTensor,
        meta: ArrayMeta,
        pieces: list[_Piece],
        fetched: dict[ReadRequest, bytes],
    ) -> torch.Tensor:
        box = shard_box(sh)
        chunk = torch.zeros(box.sizes, dtype=meta.dtype)  # zeros pad a shape mismatch
        for piece in pieces:
            if piece.request not in fetched and meta.fill_value is not None:
                overlap = overlap_slices(piece.box, box)
                if overlap is not None:
                    chunk[overlap[1]] = meta.fill_value  # never written: the fill value
                continue
            part = self._decode(meta, piece, fetched[piece.request])
            copy_overlap(chunk, box, part, piece.box)
        result = chunk.reshape(tuple(sh.local_shape))
        if sh.flattened_range is not None:
            result = result.reshape(-1)[sh.flattened_range].clone()
        return _finish(sh, result)

    def _decode(self, meta: ArrayMeta, piece: _Piece, raw: bytes) -> torch.Tensor:
        where = self.storage.child_uri(piece.request.path)
        if piece.request.end is None:
            return decode_chunk(meta, raw, where)
        rows = piece.box.sizes[0]
        expected = piece.request.end - piece.request.start
        if len(raw) != expected:
            raise CheckpointingException(
                f"{where}: read {len(raw)} bytes at offset {piece.request.start}, expected "
                f"{expected}; the chunk is truncated"
            )
        return bytes_to_tensor(raw, meta.dtype).reshape((rows, *tuple(meta.chunks[1:])))


def _rows(box: Box, rows: slice) -> Box:
    """The ``rows`` (axis 0, relative to ``box``) of ``box``."""
    offsets, sizes = box
    return Box((offsets[0] + rows.start, *offsets[1:]), (rows.stop - rows.start, *sizes[1:]))


@dataclass(frozen=True)
class _DirectRead:
    """A byte range of a raw chunk that lands contiguously in the result tensor."""

    request: ReadRequest
    out_start: int  # first element of the (flat) result it fills
    length: int  # elements


def _result_numel(sh: ShardedTensor) -> int:
    rng = sh.flattened_range
    return rng.stop - rng.start if rng is not None else math.prod(sh.local_shape)


def _result_shape(sh: ShardedTensor) -> tuple[int, ...]:
    return (_result_numel(sh),) if sh.flattened_range is not None else tuple(sh.local_shape)


def _finish(sh: ShardedTensor, result: torch.Tensor) -> torch.Tensor:
    """Move the result to the device of the requested tensor's data (if not CPU)."""
    if sh.data is not None and sh.data.device.type not in ("cpu", "meta"):
        return result.to(sh.data.device)
    return result


def _direct_reads(sh: ShardedTensor, meta: ArrayMeta) -> list[_DirectRead] | None:
    """Byte ranges to read straight into the result, or None when copying is needed.

    Possible when chunks are raw C-order bytes and every overlap of a chunk with the
    request is one contiguous range both of the chunk and of the result - as when
    request and chunks differ only along axis 0 (an unchanged layout, a resharding
    along axis 0, flattened optimizer state) or when a shard was split into chunks
    (see :func:`cloudckpt.formats.zarr.layout.split_chunk_shape`) and is read back whole.
    Then each overlap is one read, and of a flattened request only the requested
    elements are read.
    """
    offsets, box = shard_box(sh)
    if not (meta.is_raw and meta.order == "C"):
        return None
    rng = sh.flattened_range
    want_lo, want_hi = (rng.start, rng.stop) if rng is not None else (0, math.prod(box))
    reads, covered = [], 0
    for overlap in overlapping_chunks(meta, offsets, box):
        in_box = _contiguous_span(overlap.in_box, box)
        in_chunk = _contiguous_span(overlap.in_chunk, meta.chunks)
        if in_box is None or in_chunk is None:
            return None
        lo, hi = in_box
        covered += hi - lo
        a, b = max(lo, want_lo), min(hi, want_hi)
        if a < b:
            first = (in_chunk[0] + a - lo) * meta.itemsize
            path = f"{sh.key}/{meta.chunk_key(overlap.index)}"
            request = ReadRequest(path, first, first + (b - a) * meta.itemsize)
            reads.append(_DirectRead(request, a - want_lo, b - a))
    return reads if covered == math.prod(box) else None  # a shortfall needs zero padding


def _contiguous_span(
    selection: tuple[slice, ...], shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """``[first, stop)`` flat C-order elements of ``shape`` that ``selection`` selects.

    None unless the selection is contiguous: whole along the innermost axes, any range
    along one axis, and a single index along every outer one.
    """
    extents = [s.stop - s.start for s in selection]
    axis = len(shape)
    while axis and extents[axis - 1] == shape[axis - 1]:
        axis -= 1
    if any(e != 1 for e in extents[: max(axis - 1, 0)]):
        return None
    first, stride = 0, 1
    for s, n in zip(reversed(selection), reversed(shape), strict=True):
        first += s.start * stride
        stride *= n
    return first, first + math.prod(extents)
