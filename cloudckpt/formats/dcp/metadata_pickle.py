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
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import operator
import pickle
import struct
from collections.abc import Callable, Mapping, Sequence
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

PROTOCOL = 4  # pickle.dumps's default protocol here: what the writer wrote before
_INT32 = (-(1 << 31), (1 << 31) - 1)
#: the instance dicts of ``MetadataIndex`` (its constructor sets no offset of None)
_KEY_FIELDS = ("fqn", "index", "offset")
_KEY_SHAPES = {_KEY_FIELDS, ("fqn", "index")}
_INFO_FIELDS = ("relative_path", "offset", "length")
#: the instance dicts of ``_StorageInfo``: as built, and as unpickled (no None values)
_INFO_SHAPES = {(*_INFO_FIELDS, "transform_descriptors"), _INFO_FIELDS}


def dumps_metadata(metadata: Metadata) -> bytes:
    """``metadata`` pickled (see the module docstring): equal to ``pickle.dumps`` when
    unpickled, in a fraction of its time for many items."""
    storage = metadata.storage_data
    if type(storage) is not dict or len(storage) < 2:
        return pickle.dumps(metadata, protocol=PROTOCOL)
    columns = _Columns.of(storage)
    if columns is None:
        return pickle.dumps(metadata, protocol=PROTOCOL)
    return _dump(metadata, storage, columns)


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


def _dump(metadata: Metadata, storage: dict[Any, Any], columns: _Columns) -> bytes:
    """``metadata`` pickled, its ``storage_data`` (``storage``) written from
    ``columns`` as fixed-width records."""
    out = _Stream()
    out.write(pickle.PROTO + bytes([PROTOCOL]))
    sizes = _write_storage(out, storage, columns)
    _write_chunks(out, metadata, sizes)
    pickler = pickle.Pickler(out.buffer, protocol=PROTOCOL)
    pickler.memo = out.memo
    pickler.dump(metadata)
    return out.buffer.getvalue()


class _Columns:
    """``storage_data`` as columns: per item its key's fqn, index and offset, its
    info's path, offset (``start``) and length; which items are plain (a key dict of
    fqn, index and offset, a ``torch.Size`` offset and an int index: fixed-width
    records)."""

    def __init__(
        self, columns: dict[str, list[Any]], key_dicts: Sequence[Mapping[str, Any]] | None
    ) -> None:
        self.fqn = columns["fqn"]
        self.index = columns["index"]
        self.offset = columns["offset"]
        self.path = columns["relative_path"]
        self.start = columns["start"]
        self.length = columns["length"]
        self.key_dicts = key_dicts
        index_types = set(map(type, self.index))
        offset_types = set(map(type, self.offset))
        if index_types == {int} and offset_types == {torch.Size}:
            self.all_plain = True
            self.plain: list[bool] = []
        else:
            self.all_plain = False
            self.plain = [
                type(o) is torch.Size and type(i) is int
                for o, i in zip(self.offset, self.index, strict=True)
            ]

    def is_plain(self, i: int) -> bool:
        """Whether item ``i`` is plain."""
        return self.all_plain or self.plain[i]

    def key_has_offset(self, i: int) -> bool:
        """Whether item ``i``'s key has an offset in its instance dict (the
        ``MetadataIndex`` constructor sets none for an offset of None)."""
        if self.key_dicts is None:
            return self.offset[i] is not None
        return "offset" in self.key_dicts[i]

    @classmethod
    def of(cls, storage: dict[Any, Any]) -> _Columns | None:
        """The columns of ``storage``, or None where an item has another shape."""
        keys, infos = list(storage), list(storage.values())
        if set(map(type, keys)) != {MetadataIndex} or set(map(type, infos)) != {_StorageInfo}:
            return None
        key_dicts, info_dicts = list(map(vars, keys)), list(map(vars, infos))
        if not set(map(tuple, key_dicts)) <= _KEY_SHAPES:
            return None
        if not set(map(tuple, info_dicts)) <= _INFO_SHAPES:
            return None
        descriptors = list(map(operator.methodcaller("get", "transform_descriptors"), info_dicts))
        if descriptors.count(None) != len(descriptors):
            return None
        columns = {
            "fqn": list(map(operator.itemgetter("fqn"), key_dicts)),
            "index": list(map(operator.itemgetter("index"), key_dicts)),
            "offset": list(map(operator.methodcaller("get", "offset"), key_dicts)),
            "relative_path": list(map(operator.itemgetter("relative_path"), info_dicts)),
            "start": list(map(operator.itemgetter("offset"), info_dicts)),
            "length": list(map(operator.itemgetter("length"), info_dicts)),
        }
        return cls(columns, key_dicts) if _plain_types(columns) else None


def _plain_types(columns: dict[str, list[Any]]) -> bool:
    """Whether the columns hold the types the records write (str keys and paths, int
    offsets and lengths, ``torch.Size`` or None offsets, int or None indices)."""
    if set(map(type, columns["fqn"])) | set(map(type, columns["relative_path"])) != {str}:
        return False
    if set(map(type, columns["start"])) | set(map(type, columns["length"])) != {int}:
        return False
    if not set(map(type, columns["offset"])) <= {torch.Size, type(None)}:
        return False
    return set(map(type, columns["index"])) <= {int, type(None)}


class _Stream:
    """The pickle being written and what it memoized, as the pickler's memo expects
    it (``{id(obj): (memo index, obj)}``)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.write = self.buffer.write
        self.memo: dict[int, tuple[int, Any]] = {}

    def memoize(self, obj: Any, push: Callable[[Any], bytes]) -> int:
        """Memoize ``obj`` (pushed by the opcodes ``push(obj)``, then popped) unless it
        is; its memo index."""
        known = self.memo.get(id(obj))
        if known is not None:
            return known[0]
        index = len(self.memo)
        self.write(push(obj) + pickle.MEMOIZE + pickle.POP)
        self.memo[id(obj)] = (index, obj)
        return index

    def get(self, obj: Any) -> bytes:
        """The opcode pushing memoized ``obj``."""
        return _get(self.memo[id(obj)][0])


def _get(index: int) -> bytes:
    if index < 256:
        return pickle.BINGET + bytes([index])
    return pickle.LONG_BINGET + struct.pack("<I", index)


def _string(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    if _INT32[0] <= value <= _INT32[1]:
        return pickle.BININT + struct.pack("<i", value)
    return pickle.LONG1 + _long_bytes(value)


def _long_bytes(value: int) -> bytes:
    """LONG1's operand: a length byte and the little-endian two's complement."""
    raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    return bytes([len(raw)]) + raw


def _global(cls: type) -> bytes:
    return _string(cls.__module__) + _string(cls.__qualname__) + pickle.STACK_GLOBAL


def _write_storage(out: _Stream, storage: dict[Any, Any], cols: _Columns) -> dict[Any, int]:
    """Push ``storage`` rebuilt from ``cols`` and memoize it (the stack left empty);
    the memo indices of the offsets (``torch.Size`` values)."""
    for cls in (MetadataIndex, _StorageInfo, torch.Size, ChunkStorageMetadata):
        out.memoize(cls, _global)
    for name in _NAMES.values():
        out.memoize(name, _string)
    fqns = {s: out.memoize(s, _string) for s in dict.fromkeys(cols.fqn)}
    paths = {s: out.memoize(s, _string) for s in dict.fromkeys(cols.path)}
    sizes = {
        s: out.memoize(s, functools.partial(_push_size, out))
        for s in dict.fromkeys(cols.offset)
        if s is not None
    }
    out.memoize(storage, lambda _: pickle.EMPTY_DICT)  # then pushed again, filled
    out.write(out.get(storage) + pickle.MARK)
    out.write(_records(out, cols, fqns, paths, sizes, _NAMES))
    out.write(pickle.SETITEMS + pickle.POP)
    return sizes


#: the field names the records refer to (memoized once)
_NAMES = {
    name: name for name in ("fqn", "offset", "index", "relative_path", "length", "offsets", "sizes")
}


def _push_size(out: _Stream, size: torch.Size) -> bytes:
    elements = b"".join(_int(int(v)) for v in size)
    return (
        out.get(torch.Size) + pickle.MARK + elements + pickle.TUPLE + pickle.TUPLE1 + pickle.REDUCE
    )


def _write_chunks(out: _Stream, metadata: Metadata, sizes: dict[Any, int]) -> None:
    """Push and memoize each tensor's list of chunks (``ChunkStorageMetadata`` records
    in columns), so that the pickler refers to them; nothing where a chunk or list has
    another shape (the pickler writes them then)."""
    lists = [
        v.chunks
        for v in metadata.state_dict_metadata.values()
        if type(v) is TensorStorageMetadata and type(v.chunks) is list
    ]
    if not lists or len(set(map(id, lists))) != len(lists):
        return
    chunks = list(itertools.chain.from_iterable(lists))
    if set(map(type, chunks)) != {ChunkStorageMetadata}:
        return
    dicts = list(map(vars, chunks))
    if set(map(tuple, dicts)) != {("offsets", "sizes")}:
        return
    offsets = list(map(operator.itemgetter("offsets"), dicts))
    lengths = list(map(operator.itemgetter("sizes"), dicts))
    if set(map(type, offsets)) | set(map(type, lengths)) != {torch.Size}:
        return
    for size in itertools.chain(offsets, lengths):
        if size not in sizes:
            sizes[size] = out.memoize(size, functools.partial(_push_size, out))
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    offsets_name = out.get(_NAMES["offsets"])
    parts: list[tuple[str, bytes | str]] = [
        ("c0", out.get(ChunkStorageMetadata) + new + offsets_name + pickle.LONG_BINGET),
        ("offsets", "<u4"),
        ("c1", out.get(_NAMES["sizes"]) + pickle.LONG_BINGET),
        ("sizes", "<u4"),
        ("c2", pickle.SETITEMS + pickle.BUILD),
    ]
    rec = _record_array(parts, len(chunks))
    rec["offsets"] = list(map(sizes.__getitem__, offsets))
    rec["sizes"] = list(map(sizes.__getitem__, lengths))
    raw, width = rec.tobytes(), rec.dtype.itemsize
    pieces = []
    done = 0
    for chunk_list in lists:
        pieces.append(pickle.EMPTY_LIST + pickle.MEMOIZE + pickle.MARK)
        pieces.append(raw[done * width : (done + len(chunk_list)) * width])
        pieces.append(pickle.APPENDS + pickle.POP)
        out.memo[id(chunk_list)] = (len(out.memo), chunk_list)
        done += len(chunk_list)
    out.write(b"".join(pieces))


_LONG_GET = pickle.LONG_BINGET


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


def _push_point(point: tuple[int, ...]) -> bytes:
    """A tuple of ints (a record table's key)."""
    return pickle.MARK + b"".join(_int(int(v)) for v in point) + pickle.TUPLE


def _record_array(parts: list[tuple[str, bytes | str]], n: int) -> Any:
    """``n`` fixed-width records of ``parts``: (name, constant bytes or numpy type)."""
    dtype = np.dtype(
        [(f, p if isinstance(p, str) else f"S{len(p)}") for f, p in parts], align=False
    )
    template = np.zeros(1, dtype=dtype)
    for name, part in parts:
        if isinstance(part, bytes):
            template[name] = part
    rec = np.empty(n, dtype=dtype)
    whole = f"V{dtype.itemsize}"  # the constants copied as one record (not field by field)
    rec.view(whole)[:] = template.view(whole)[0]
    return rec


def _records(
    out: _Stream,
    cols: _Columns,
    fqns: dict[str, int],
    paths: dict[str, int],
    sizes: dict[torch.Size, int],
    names: dict[str, str],
) -> bytes:
    """Every item's key and value: plain items as fixed-width numpy records, the
    others (an offset or index of None) one by one, in ``storage_data``'s order."""
    n = len(cols.fqn)
    index = cols.index
    offsets = cols.offset
    if not cols.all_plain:
        index = [i if p else 0 for i, p in zip(index, cols.plain, strict=True)]
        offsets = [o if p else None for o, p in zip(offsets, cols.plain, strict=True)]
    ints = (index, cols.start, cols.length)
    wide = any(min(c, default=0) < _INT32[0] or max(c, default=0) > _INT32[1] for c in ints)
    rec = _record_array(_record_parts(out, wide, names), n)
    dtype = rec.dtype
    rec["fqn"] = list(map(fqns.__getitem__, cols.fqn))
    rec["path"] = list(map(paths.__getitem__, cols.path))
    if cols.all_plain:
        rec["offset"] = list(map(sizes.__getitem__, offsets))
    else:
        rec["offset"] = [0 if o is None else sizes[o] for o in offsets]
    rec["index"] = index
    rec["start"] = cols.start
    rec["length"] = cols.length
    raw: bytes = rec.tobytes()
    if cols.all_plain:
        return raw
    width = dtype.itemsize
    pieces: list[bytes] = []
    done = 0
    for i in (i for i, plain in enumerate(cols.plain) if not plain):
        pieces.append(raw[done * width : i * width])
        pieces.append(_record(out, cols, i, (fqns, paths, sizes), names))
        done = i + 1
    pieces.append(raw[done * width :])
    return b"".join(pieces)


def _record_parts(
    out: _Stream, wide: bool, names: dict[str, str] | None = None
) -> list[tuple[str, bytes | str]]:
    """The fields of a plain item's record: (name, constant opcodes or numpy type)."""
    names = names or _NAMES
    int_op, int_type = (pickle.LONG1 + b"\x08", "<i8") if wide else (pickle.BININT, "<i4")
    key_cls, info_cls = out.get(MetadataIndex), out.get(_StorageInfo)
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    end = pickle.SETITEMS + pickle.BUILD
    return [
        ("c0", key_cls + new + out.get(names["fqn"]) + pickle.LONG_BINGET),
        ("fqn", "<u4"),
        ("c1", out.get(names["index"]) + int_op),
        ("index", int_type),
        ("c2", out.get(names["offset"]) + pickle.LONG_BINGET),
        ("offset", "<u4"),
        ("c3", end + info_cls + new + out.get(names["relative_path"]) + pickle.LONG_BINGET),
        ("path", "<u4"),
        ("c4", out.get(names["offset"]) + int_op),
        ("start", int_type),
        ("c5", out.get(names["length"]) + int_op),
        ("length", int_type),
        ("c6", end),
    ]


def _offset(offset: torch.Size | None, sizes: dict[torch.Size, int]) -> bytes:
    return pickle.NONE if offset is None else _get(sizes[offset])


def _record(
    out: _Stream,
    cols: _Columns,
    i: int,
    memo: tuple[dict[str, int], dict[str, int], dict[torch.Size, int]],
    names: dict[str, str],
) -> bytes:
    """Item ``i``'s key and value, opcode by opcode (an offset or index may be None)."""
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    end = pickle.SETITEMS + pickle.BUILD
    fqns, paths, sizes = memo
    offset, index = cols.offset[i], cols.index[i]
    key: Sequence[bytes] = (
        out.get(MetadataIndex) + new,
        out.get(names["fqn"]) + _get(fqns[cols.fqn[i]]),
        out.get(names["index"]) + (pickle.NONE if index is None else _int(index)),
        b"" if not cols.key_has_offset(i) else out.get(names["offset"]) + _offset(offset, sizes),
        end,
    )
    value = (
        out.get(_StorageInfo) + new,
        out.get(names["relative_path"]) + _get(paths[cols.path[i]]),
        out.get(names["offset"]) + _int(cols.start[i]),
        out.get(names["length"]) + _int(cols.length[i]),
        end,
    )
    return b"".join(key) + b"".join(value)


__all__ = ["dumps_metadata", "dumps_metadata_columns"]
