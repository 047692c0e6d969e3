"""Reading only the bytes of a DCP tensor item that a load needs.

A tensor item of a DCP checkpoint is ``torch.save`` bytes: a zip archive whose one
storage record (``<archive>/data/0``) holds the tensor's elements uncompressed, in C
order (cloudckpt saves contiguous tensors that own exactly their storage, see
:func:`~cloudckpt.formats.host_copies.to_host`). When cloudckpt writes an item it
finds where that record's bytes lie within the item (:func:`storage_record`), and the
coordinator keeps these records per key in ``Metadata.mcore_data[key]`` under
:data:`TENSOR_DATA_KEY` (:func:`with_records`): ``{chunk offsets: (start, nbytes)}``.
``mcore_data`` is Megatron-Core's per-key dict; its readers and PyTorch DCP's carry it
and look only at the keys they know, so the format stays theirs.

A load then reads, of each stored chunk, only the element runs its shards overlap: the
overlap is a box of the chunk (:func:`read_box` widens it where the bytes between two
of its runs are fewer than :data:`READ_GAP`, which costs no request and, with block
CRCs, no block), its C-order runs (:func:`element_runs`) become byte ranges of the item
(:func:`plan_reads`), and the ranges' bytes are copied into the region
(:func:`assemble`). Every range goes through the storage layer's checked reads (block
CRC-32Cs). Items without a record - written by PyTorch DCP or Megatron-Core, or on a
big-endian machine - and items needed whole are read whole, as before (except an item
that is exactly one shard's chunk: the reader reads its recorded elements straight into
the shard's tensor).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import re
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from cloudckpt.config import MiB
from cloudckpt.formats.dcp.torch_zip import Reader, ZipLayoutError, find_storage
from cloudckpt.formats.geometry import Box, shard_box
from cloudckpt.formats.tensor_bytes import bytes_to_tensor
from cloudckpt.mapping import ShardedTensor
from cloudckpt.storage import ReadRequest
from cloudckpt.storage.buffers import BufferReader

logger = logging.getLogger(__name__)

TENSOR_DATA_KEY = "cloudckpt_tensor_data"
"""The ``mcore_data[key]`` entry: ``{chunk offsets (tuple): (start, nbytes)}``, where
an item's tensor elements lie within the item's bytes."""

READ_GAP = MiB
"""Runs of a needed box closer than this many bytes are read as one range (with the
bytes between them): a smaller gap holds no whole 1 MiB CRC block, so skipping it
would save no bytes read from the store, only add a request."""

_STORAGE_RECORD = re.compile(r"[^/]+/data/\d+")
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature ... file name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"

Record = tuple[int, int]  # (start within the item, nbytes) of the tensor's elements


# -- writing: where the elements are ------------------------------------------------------


def storage_record(item: memoryview) -> Record | None:
    """``(start, nbytes)`` of the tensor elements within one ``torch.save`` item: its
    only storage record, stored uncompressed. None when the item has no such single
    record (several storages, a compressed record) or the machine is big-endian.

    Read from the zip directory with :mod:`struct`
    (:func:`~cloudckpt.formats.dcp.torch_zip.find_storage`); an archive laid out
    otherwise than expected is read with ``zipfile`` instead."""

    def read(offset: int, nbytes: int) -> memoryview:
        return item[offset : offset + nbytes]

    return storage_record_from(read, item.nbytes, item)


def storage_record_from(read: Reader, size: int, item: memoryview | None = None) -> Record | None:
    """:func:`storage_record` of a ``size``-byte item of which ``read`` gives the
    directory and headers (the item's elements need not be at hand): None also when
    the layout is not the expected one and the whole ``item`` is not given."""
    if sys.byteorder != "little":
        return None
    try:
        return find_storage(read, size)
    except ZipLayoutError as exc:
        if item is None:
            logger.debug("no storage record found in a torch.save item: %s", exc)
            return None
    return _storage_record_zipfile(item)


def _storage_record_zipfile(item: memoryview) -> Record | None:
    """:func:`storage_record` through ``zipfile`` (any valid archive)."""
    try:
        with zipfile.ZipFile(BufferReader(item)) as archive:
            records = [i for i in archive.infolist() if _STORAGE_RECORD.fullmatch(i.filename)]
    except zipfile.BadZipFile:
        return None
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    info = records[0]
    header = item[info.header_offset : info.header_offset + _LOCAL_HEADER.size]
    if header.nbytes != _LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    start = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if signature != _LOCAL_SIGNATURE or start + info.file_size > item.nbytes:
        return None
    return start, info.file_size


@dataclass
class RecordedStorageInfo(_StorageInfo):
    """DCP's per-item storage info with the item's :func:`storage_record`: what a
    rank's write results carry to the coordinator (``.metadata`` stores plain
    ``_StorageInfo`` and the records in ``mcore_data``, see :func:`with_records`)."""

    record: Record | None = None


def plain_info(info: Any) -> Any:
    """``info`` as DCP's own ``_StorageInfo`` (the record dropped)."""
    if type(info) is not RecordedStorageInfo:
        return info
    return _StorageInfo(info.relative_path, info.offset, info.length, info.transform_descriptors)


def with_records(
    extra: Mapping[str, dict[str, Any]], results: Iterable[Iterable[DcpWriteResult]]
) -> dict[str, dict[str, Any]]:
    """``extra`` (per-key ``mcore_data``) with every recorded item's record under its
    key's :data:`TENSOR_DATA_KEY` (new dicts; ``extra`` is not changed)."""
    tables: dict[str, dict[tuple[int, ...], Record]] = {}
    for rank in results:
        for result in rank:
            record = getattr(result.storage_data, "record", None)
            if record is not None and result.index.offset is not None:
                table = tables.setdefault(result.index.fqn, {})
                table[tuple(result.index.offset)] = (int(record[0]), int(record[1]))
    merged = dict(extra)
    for key, table in tables.items():
        merged[key] = {**merged.get(key, {}), TENSOR_DATA_KEY: table}
    return merged


def records_of(extra: Mapping[str, Any] | None, key: str) -> dict[tuple[int, ...], Record]:
    """The records of ``key``'s items in a checkpoint's ``mcore_data`` (``{}`` when it
    has none, they are not what :func:`with_records` writes, or this machine is
    big-endian: records describe little-endian elements)."""
    if sys.byteorder != "little":
        return {}
    entry = (extra or {}).get(key)
    table = entry.get(TENSOR_DATA_KEY) if isinstance(entry, dict) else None
    if not isinstance(table, dict):
        return {}
    return {
        tuple(offsets): value
        for offsets, value in table.items()
        if isinstance(offsets, tuple) and _is_record(value)
    }


def _is_record(value: Any) -> bool:
    """Whether ``value`` is a record: ``(start, nbytes)``, two non-negative ints."""
    if not isinstance(value, tuple) or len(value) != 2:
        return False
    start, nbytes = value
    return isinstance(start, int) and isinstance(nbytes, int) and start >= 0 and nbytes >= 0


# -- reading: which bytes -----------------------------------------------------------------


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-order array of ``shape``."""
    strides = [1] * len(shape)
    for dim in reversed(range(len(shape) - 1)):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def read_box(shape: tuple[int, ...], box: Box, itemsize: int, gap: int = READ_GAP) -> Box:
    """``box`` (of an array of ``shape``) widened to whole trailing dimensions while
    the bytes between two of its C-order runs are fewer than ``gap``."""
    offsets, sizes = list(box[0]), list(box[1])
    strides = c_strides(shape)
    for dim in reversed(range(1, len(shape))):
        if (offsets[dim], sizes[dim]) == (0, shape[dim]):
            continue
        if (
            math.prod(sizes[:dim]) == 1
            or (shape[dim] - sizes[dim]) * strides[dim] * itemsize >= gap
        ):
            break
        offsets[dim], sizes[dim] = 0, shape[dim]
    return Box(tuple(offsets), tuple(sizes))


def element_runs(shape: tuple[int, ...], box: Box) -> list[tuple[int, int]]:
    """The ``(start, length)`` runs of flat C-order element indices that ``box`` covers
    in an array of ``shape``, in order (they never touch)."""
    offsets, sizes = box
    if 0 in sizes:
        return []
    partial = [d for d in range(len(shape)) if (offsets[d], sizes[d]) != (0, shape[d])]
    if not partial:
        return [(0, math.prod(shape))]
    last, strides = partial[-1], c_strides(shape)
    base, length = offsets[last] * strides[last], sizes[last] * strides[last]
    outer = [range(o, o + s) for o, s in zip(offsets[:last], sizes[:last], strict=True)]
    return [
        (base + sum(i * s for i, s in zip(index, strides, strict=False)), length)
        for index in itertools.product(*outer)
    ]


@dataclass(frozen=True)
class Piece:
    """A stored item of a source box: C-order elements ``[start, start + numel)`` of it."""

    index: MetadataIndex
    start: int
    numel: int


@dataclass(frozen=True)
class PieceRead:
    """One read for a region: elements ``[lo, hi)`` (flat, of the source box) of
    ``piece``; ``whole``: ``request`` is the whole item (``torch.save`` bytes), else
    exactly those elements' bytes."""

    piece: Piece
    request: ReadRequest
    lo: int
    hi: int
    whole: bool


@dataclass(frozen=True)
class RegionPlan:
    """How to read the ``box`` (relative to its source box) of one source: its runs
    of source elements, in order, and the reads that cover them."""

    box: Box
    runs: tuple[tuple[int, int], ...]
    reads: tuple[PieceRead, ...]


#: a piece's whole-item request and its record (None: read it whole)
Locate = Callable[[Piece], tuple[ReadRequest, Record | None]]


def plan_reads(
    shape: tuple[int, ...], needed: Box, pieces: Iterable[Piece], itemsize: int, locate: Locate
) -> RegionPlan:
    """The reads of the region of a source box of ``shape`` covering ``needed``."""
    box = read_box(shape, needed, itemsize)
    runs = element_runs(shape, box)
    reads: list[PieceRead] = []
    for piece in pieces:
        reads += _piece_reads(piece, runs, itemsize, locate)
    return RegionPlan(box, tuple(runs), tuple(reads))


def _piece_reads(
    piece: Piece, runs: list[tuple[int, int]], itemsize: int, locate: Locate
) -> list[PieceRead]:
    first, end = piece.start, piece.start + piece.numel
    segments = [(max(s, first), min(s + n, end)) for s, n in runs if s < end and s + n > first]
    if not segments:
        return []
    whole, record = locate(piece)
    length = (whole.end or 0) - whole.start
    if (
        record is None
        or record[1] != piece.numel * itemsize  # not the elements the metadata describes
        or record[0] + record[1] > length
        or sum(hi - lo for lo, hi in segments) == piece.numel  # needed whole anyway
    ):
        return [PieceRead(piece, whole, first, end, True)]
    base = whole.start + record[0]
    return [
        PieceRead(
            piece,
            ReadRequest(whole.path, base + (lo - first) * itemsize, base + (hi - first) * itemsize),
            lo,
            hi,
            False,
        )
        for lo, hi in segments
    ]


def assemble(
    plan: RegionPlan,
    dtype: torch.dtype,
    fetched: Mapping[ReadRequest, bytes],
    decode: Callable[[PieceRead, bytes], torch.Tensor],
) -> torch.Tensor:
    """The region's tensor (shape ``plan.box`` sizes) from the fetched reads;
    ``decode`` turns a whole item's bytes into its tensor."""
    sizes = plan.box[1]
    reads = plan.reads
    if len(reads) == 1 and reads[0].whole and plan.runs == ((0, reads[0].piece.numel),):
        return decode(reads[0], fetched[reads[0].request]).reshape(sizes)
    out = torch.zeros(math.prod(sizes), dtype=dtype)
    starts = [s for s, _ in plan.runs]
    positions = list(itertools.accumulate((n for _, n in plan.runs), initial=0))
    for read in reads:
        raw = fetched[read.request]
        values = decode(read, raw).reshape(-1) if read.whole else bytes_to_tensor(raw, dtype)
        offset = read.piece.start if read.whole else read.lo
        run = max(bisect.bisect_right(starts, read.lo) - 1, 0)
        for (start, length), position in zip(plan.runs[run:], positions[run:], strict=False):
            lo, hi = max(start, read.lo), min(start + length, read.hi)
            if start >= read.hi:
                break
            if lo < hi:
                out[position + lo - start : position + hi - start] = values[
                    lo - offset : hi - offset
                ]
    return out.reshape(sizes)


# -- boxes --------------------------------------------------------------------------------


def needed_box(sh: ShardedTensor) -> Box:
    """The box of the global tensor ``sh`` needs: its chunk, or for a flattened range
    the rows (first dimension) of its chunk that the range touches."""
    box = shard_box(sh)
    offsets, shape = box
    flat = sh.flattened_range
    if flat is None or not shape or flat.stop <= flat.start:
        return box
    row = math.prod(shape[1:])
    if row == 0:
        return box
    first, last = flat.start // row, min(-(-flat.stop // row), shape[0])
    return Box((offsets[0] + first, *offsets[1:]), (last - first, *shape[1:]))
