"""DCP's ``.metadata`` pickled with its per-item part in columns.

``pickle.dumps`` of a DCP ``Metadata`` spends most of its time on ``storage_data``: one
``MetadataIndex`` key and one ``_StorageInfo`` value per item, each reduced through
Python (``_StorageInfo.__getstate__``), a few microseconds per item. :func:`dumps_metadata`
writes the same objects as fixed-width pickle records built with numpy from the columns
of ``storage_data`` (each item's key, chunk offset, index hint, path, offset, length),
and each tensor's list of ``ChunkStorageMetadata`` the same way (offsets and sizes
memoized once per distinct value), then lets the standard pickler write the
``Metadata`` itself: the pickler's memo is primed with what the records memoized (the
dict, the chunk lists, the classes, the keys, offsets and paths), so the ``Metadata``
refers to them. The stream unpickles with ``pickle.load``
(DCP's ``FileSystemReader``) and cloudckpt's restricted unpickler to a ``Metadata``
equal to the one given, with the same classes and the same instance dicts (a
``_StorageInfo`` without ``transform_descriptors`` has none in its dict, as its
``__getstate__`` writes it).

Items of another shape (a ``transform_descriptors`` value, another key or value
type, an offset other than ``torch.Size``) make it fall back to ``pickle.dumps``.

The parts: :mod:`.metadata_pickle_dict` pickles a ``Metadata`` whose ``storage_data``
is built (:func:`dumps_metadata`), :mod:`.pickle_records` holds the opcodes and records
both are made of; this module pickles one from the columns themselves
(:func:`dumps_metadata_columns`).
"""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from cloudckpt.formats.dcp.columns import ChunkColumns, RecordColumns, StorageColumns
from cloudckpt.formats.dcp.metadata_pickle_dict import _write_chunks, dumps_metadata
from cloudckpt.formats.dcp.pickle_records import (
    _INT32,
    _NAMES,
    PROTOCOL,
    _get,
    _global,
    _int,
    _push_point,
    _push_size,
    _record_array,
    _record_parts,
    _Stream,
    _string,
)


def dumps_metadata_columns(
    metadata: Metadata,
    storage: StorageColumns,
    chunks: ChunkColumns | None = None,
    records: RecordColumns | None = None,
) -> bytes:
    """``metadata`` with the ``storage_data`` that ``storage`` describes, pickled as
    :func:`dumps_metadata` pickles it, without building the dict's per-item objects
    (``MetadataIndex``, ``_StorageInfo``): the records are filled from the columns'
    arrays; so are the tensors' chunk lists from ``chunks`` where ``metadata`` holds
    those very lists, and the record tables of ``mcore_data`` from ``records`` (the
    tables it holds, while all are empty). ``metadata`` itself is left as it was."""
    if len(storage) < 2 or not _plain_tables(storage):
        if chunks is not None:
            chunks.fill()
        if records is not None:
            records.fill()
        full = copy.copy(metadata)
        full.storage_data = storage.storage_data()
        return dumps_metadata(full)
    placeholder: dict[Any, Any] = {}  # written from the columns; the pickler refers to it
    kept = metadata.storage_data
    metadata.storage_data = placeholder
    try:
        out = _Stream()
        out.write(pickle.PROTO + bytes([PROTOCOL]))
        sizes = _write_storage_columns(out, placeholder, storage)
        if chunks is None or not _write_chunk_columns(out, metadata, chunks, sizes):
            if chunks is not None:
                chunks.fill()
            _write_chunks(out, metadata, sizes)
        if records is not None and not _write_record_columns(out, records):
            records.fill()  # the pickler writes them
        pickler = pickle.Pickler(out.buffer, protocol=PROTOCOL)
        pickler.memo = out.memo
        pickler.dump(metadata)
        return out.buffer.getvalue()
    finally:
        metadata.storage_data = kept


def _plain_tables(storage: StorageColumns) -> bool:
    """Whether the tables hold what the records write (str names and paths, distinct
    ``torch.Size`` sizes)."""
    if set(map(type, storage.names)) | set(map(type, storage.paths)) != {str}:
        return False
    if storage.sizes and set(map(type, storage.sizes)) != {torch.Size}:
        return False
    return len(set(storage.sizes)) == len(storage.sizes)


def _write_storage_columns(
    out: _Stream, storage: dict[Any, Any], cols: StorageColumns
) -> dict[Any, int]:
    """:func:`_write_storage` from id columns: the tables memoized once each, then one
    fixed-width record per plain item (numpy fills each field from the ids' memo
    indices), the others opcode by opcode; the memo indices of the sizes."""
    for cls in (MetadataIndex, _StorageInfo, torch.Size, ChunkStorageMetadata):
        out.memoize(cls, _global)
    for name in _NAMES.values():
        out.memoize(name, _string)
    names = np.array([out.memoize(s, _string) for s in cols.names] or [0], dtype=np.int64)
    paths = np.array([out.memoize(s, _string) for s in cols.paths] or [0], dtype=np.int64)
    push = functools.partial(_push_size, out)
    size_memo = [out.memoize(s, push) for s in cols.sizes]
    sizes = dict(zip(cols.sizes, size_memo, strict=True))
    memo_of_size = np.array([*size_memo, 0], dtype=np.int64)  # -1 (None): unused 0
    out.memoize(storage, lambda _: pickle.EMPTY_DICT)  # then pushed again, filled
    out.write(out.get(storage) + pickle.MARK)
    plain = (cols.offset_ids >= 0) & (cols.hints >= 0)
    ints = (cols.hints[plain], cols.starts, cols.lengths)
    wide = any(c.size and (c.min() < _INT32[0] or c.max() > _INT32[1]) for c in ints)
    rec = _record_array(_record_parts(out, wide), min(len(cols), _ROWS))
    others = np.flatnonzero(~plain)
    memo = (names, paths, memo_of_size)
    raw, width = memoryview(rec.view(np.uint8)), rec.dtype.itemsize  # written from itself
    for lo in range(0, len(cols), _ROWS):
        block = slice(lo, min(lo + _ROWS, len(cols)))
        _fill_records(rec, cols, block, memo)
        done = lo
        inside = others[np.searchsorted(others, lo) : np.searchsorted(others, block.stop)]
        for i in inside.tolist():
            out.write(raw[(done - lo) * width : (i - lo) * width])
            out.write(_column_record(out, cols, i, memo))
            done = i + 1
        out.write(raw[(done - lo) * width : (block.stop - lo) * width])
    out.write(pickle.SETITEMS + pickle.POP)
    return sizes


#: items per block of records: the block is reused (no fresh pages for every item's
#: record and for each field's temporary), its temporaries stay in the cache
_ROWS = 1 << 15


def _fill_records(rec: Any, cols: StorageColumns, block: slice, memo: tuple[Any, ...]) -> None:
    """The first records of ``rec`` filled from the items of ``block`` (those of plain
    items: the others are written by :func:`_column_record`)."""
    names, paths, memo_of_size = memo
    hints = cols.hints[block]
    n = len(hints)
    rec["fqn"][:n] = names[cols.key_ids[block]]
    rec["index"][:n] = np.maximum(hints, 0)  # (None's -1: not written)
    rec["offset"][:n] = memo_of_size[cols.offset_ids[block]]
    rec["path"][:n] = paths[cols.path_ids[block]]
    rec["start"][:n] = cols.starts[block]
    rec["length"][:n] = cols.lengths[block]


def _column_record(out: _Stream, cols: StorageColumns, i: int, memo: tuple[Any, ...]) -> bytes:
    """Item ``i``'s key and value opcode by opcode (its offset or index is None)."""
    names, paths, sizes = memo
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    end = pickle.SETITEMS + pickle.BUILD
    offset, hint = int(cols.offset_ids[i]), int(cols.hints[i])
    key = (
        out.get(MetadataIndex) + new,
        out.get(_NAMES["fqn"]) + _get(int(names[cols.key_ids[i]])),
        out.get(_NAMES["index"]) + (pickle.NONE if hint < 0 else _int(hint)),
        b"" if offset < 0 else out.get(_NAMES["offset"]) + _get(int(sizes[offset])),
        end,
    )
    value = (
        out.get(_StorageInfo) + new,
        out.get(_NAMES["relative_path"]) + _get(int(paths[cols.path_ids[i]])),
        out.get(_NAMES["offset"]) + _int(int(cols.starts[i])),
        out.get(_NAMES["length"]) + _int(int(cols.lengths[i])),
        end,
    )
    return b"".join(key) + b"".join(value)


def _write_chunk_columns(
    out: _Stream, metadata: Metadata, chunks: ChunkColumns, sizes: dict[Any, int]
) -> bool:
    """:func:`_write_chunks` from ids: each tensor's chunk list, where ``metadata``
    holds the very list ``chunks`` names for it (empty, or filled to the length the ids
    say), written as records filled with numpy; False (nothing written) where it does
    not."""
    md = metadata.state_dict_metadata
    if type(md) is not dict or len(chunks.lists) != len(chunks.names):
        return False
    for name, chunk_list in zip(chunks.names, chunks.lists, strict=True):
        value = md.get(name)
        if type(value) is not TensorStorageMetadata or value.chunks is not chunk_list:
            return False
        if type(chunk_list) is not list:
            return False
    lengths = chunks.counts()
    if sum(lengths) != len(chunks.offset_ids) or len(set(map(id, chunks.lists))) != len(lengths):
        return False
    if any(c and len(c) != n for c, n in zip(chunks.lists, lengths, strict=True)):
        return False  # a list changed since: not the one the ids describe
    if set(map(type, chunks.sizes)) - {torch.Size}:
        return False
    push = functools.partial(_push_size, out)
    memo = [sizes[s] if s in sizes else out.memoize(s, push) for s in chunks.sizes]
    for size, index in zip(chunks.sizes, memo, strict=True):
        sizes.setdefault(size, index)
    memo_of = np.array([*memo, 0], dtype=np.int64)
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    parts: list[tuple[str, bytes | str]] = [
        (
            "c0",
            out.get(ChunkStorageMetadata) + new + out.get(_NAMES["offsets"]) + pickle.LONG_BINGET,
        ),
        ("offsets", "<u4"),
        ("c1", out.get(_NAMES["sizes"]) + pickle.LONG_BINGET),
        ("sizes", "<u4"),
        ("c2", pickle.SETITEMS + pickle.BUILD),
    ]
    rec = _record_array(parts, min(len(chunks.offset_ids), _ROWS))

    def fill(block: slice) -> None:
        n = len(chunks.offset_ids[block])
        rec["offsets"][:n] = memo_of[chunks.offset_ids[block]]
        rec["sizes"][:n] = memo_of[chunks.size_ids[block]]

    head, tail = pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.MARK, pickle.APPENDS + pickle.POP
    for chunk_list in chunks.lists:
        out.memo[id(chunk_list)] = (len(out.memo), chunk_list)
    _write_runs(out, rec, fill, chunks.bounds.tolist(), (head, tail))
    return True


def _write_runs(
    out: _Stream,
    rec: Any,
    fill: Callable[[slice], None],
    bounds: list[int],
    ends: tuple[bytes, bytes],
) -> None:
    """Records ``bounds[0]:bounds[-1]`` in runs ``bounds[i]:bounds[i + 1]``, each between
    ``ends`` (head and tail), filled block by block into ``rec`` (a block of records:
    ``fill(block)`` fills its first records) and written from its memory."""
    if len(bounds) < 2:
        return
    head, tail = ends
    raw, width = memoryview(rec.view(np.uint8)), rec.dtype.itemsize
    between = tail + head
    out.write(head)
    cut = 1  # the next bound between two runs
    rows = max(len(rec), 1)
    for lo in range(bounds[0], bounds[-1], rows):
        block = slice(lo, min(lo + rows, bounds[-1]))
        fill(block)
        done = lo
        while cut < len(bounds) - 1 and bounds[cut] <= block.stop:
            out.write(raw[(done - lo) * width : (bounds[cut] - lo) * width])
            out.write(between)
            done, cut = bounds[cut], cut + 1
        out.write(raw[(done - lo) * width : (block.stop - lo) * width])
    out.write(between * (len(bounds) - 1 - cut))  # empty runs at the end
    out.write(tail)


def _write_record_columns(out: _Stream, records: RecordColumns) -> bool:
    """The record tables of ``records`` from its arrays, each memoized as the table
    object the metadata holds: one fixed-width record per entry (its offsets, memoized
    once per distinct tuple, and its ``(start, nbytes)``), filled with numpy. The
    entries of a table in item order: the later of equal offsets wins when unpickled,
    as in the dict. False (nothing written) where a table is not empty."""
    if any(records.tables) or len(set(map(id, records.tables))) != len(records.tables):
        return False
    used_mask = np.zeros(len(records.points), dtype=bool)
    used_mask[records.point_ids] = True
    used = np.flatnonzero(used_mask).tolist()
    memo = np.zeros(len(records.points), dtype=np.int64)
    memo[used] = [out.memoize(records.points[i], _push_point) for i in used]
    ints = (records.starts, records.nbytes)
    wide = any(c.size and (c.min() < _INT32[0] or c.max() > _INT32[1]) for c in ints)
    int_op, int_type = (pickle.LONG1 + b"\x08", "<i8") if wide else (pickle.BININT, "<i4")
    parts: list[tuple[str, bytes | str]] = [
        ("c0", pickle.LONG_BINGET),
        ("point", "<u4"),
        ("c1", int_op),
        ("start", int_type),
        ("c2", int_op),
        ("nbytes", int_type),
        ("c3", pickle.TUPLE2 + pickle.SETITEM),
    ]
    rec = _record_array(parts, min(len(records), _ROWS))

    def fill(block: slice) -> None:
        n = len(records.point_ids[block])
        rec["point"][:n] = memo[records.point_ids[block]]
        rec["start"][:n] = records.starts[block]
        rec["nbytes"][:n] = records.nbytes[block]

    for table in records.tables:
        out.memo[id(table)] = (len(out.memo), table)
    _write_runs(
        out, rec, fill, records.bounds.tolist(), (pickle.EMPTY_DICT + pickle.MEMOIZE, pickle.POP)
    )
    return True


__all__ = ["dumps_metadata_columns"]
