"""A DCP save's item keys and write results in columns, for cloudckpt's own writer.

DCP's finish gathers every rank's write results as ``WriteResult`` objects (an index,
a size and a storage info per item: several objects to pickle, send and unpickle per
item) and the writer builds ``Metadata.storage_data`` from them (a ``MetadataIndex``
and a ``_StorageInfo`` per item). Where the coordinator's planning was cloudckpt's
linear step (it knows every item's key, offset and index hint from the plans) and the
writer is cloudckpt's own, a rank sends :class:`ItemResultColumns` instead: per item of
its plan, in plan order, an id into its object paths, the item's offset and length in
its object and where its tensor elements lie (the record); the coordinator joins them
with the items' keys (:class:`PlanKeys`) into :class:`StorageColumns`, from which
:func:`~cloudckpt.formats.dcp.metadata_pickle.dumps_metadata_columns` writes
``.metadata`` without building the per-item objects. The pickle unpickles to the
``Metadata`` DCP's own step writes.

Anything the columns cannot say exactly (a result that is not one of the plan's
items, a storage info of another type or with stream transforms) makes
:meth:`ItemResultColumns.of` return None: the rank sends its results as objects, and
the coordinator takes the object path for every rank (:func:`as_write_results`).
"""

from __future__ import annotations

import array
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from cloudckpt.array_utils import stable_order
from cloudckpt.formats.dcp.ranges import RecordedStorageInfo

#: a record table: per chunk offsets, (start, nbytes) of its elements within the item
RecordTable = dict[tuple[int, ...], tuple[int, int]]
KEY_SEPARATOR = "\x00"  # between the keys of PlanColumns.keys


@dataclass(frozen=True)
class ItemResultColumns:
    """One rank's write results in columns, in its plan's item order.

    Attributes:
        paths: the rank's object paths (relative to the checkpoint).
        path_ids: per item, its object's position in ``paths``.
        starts: per item, its offset in its object.
        lengths: per item, its length in bytes.
        record_starts: per item, where its tensor elements start within the item
            (-1: no record).
        record_bytes: per item, the bytes of its tensor elements (0 without a record).
    """

    paths: tuple[str, ...]
    path_ids: array.array[int]
    starts: array.array[int]
    lengths: array.array[int]
    record_starts: array.array[int]
    record_bytes: array.array[int]

    def __len__(self) -> int:
        return len(self.path_ids)

    @classmethod
    def of(
        cls, items: Sequence[WriteItem], results: Sequence[DcpWriteResult]
    ) -> ItemResultColumns | None:
        """``results`` (of ``items``, each result naming its item's own index object)
        in the items' order; None where they cannot be said in columns exactly."""
        if len(items) != len(results):
            return None
        position = {id(item.index): i for i, item in enumerate(items)}
        if len(position) != len(items):
            return None
        n = len(items)
        path_ids, starts, lengths = _zeros(n), _zeros(n), _zeros(n)
        record_starts, record_bytes = _zeros(n, -1), _zeros(n)
        paths: dict[str, int] = {}
        seen = bytearray(n)
        for result in results:
            i = position.get(id(result.index), -1)
            info = result.storage_data
            if i < 0 or seen[i] or not _plain_fields(info, result):
                return None
            seen[i] = 1
            path_ids[i] = paths.setdefault(info.relative_path, len(paths))
            starts[i] = info.offset
            lengths[i] = info.length
            record = getattr(info, "record", None)
            if record is not None:
                start, nbytes = int(record[0]), int(record[1])
                if start < 0:
                    return None
                record_starts[i], record_bytes[i] = start, nbytes
        return cls(tuple(paths), path_ids, starts, lengths, record_starts, record_bytes)


def _zeros(n: int, value: int = 0) -> array.array[int]:
    return array.array("q", [value]) * n


def _plain_fields(info: Any, result: DcpWriteResult) -> bool:
    """Whether ``info`` is a storage info the columns say exactly: DCP's or cloudckpt's
    (with a record), a str path, int offset and length (the result's size), no stream
    transforms."""
    return (
        type(info) in (_StorageInfo, RecordedStorageInfo)
        and type(info.relative_path) is str
        and type(info.offset) is int
        and type(info.length) is int
        and info.transform_descriptors is None
        and result.size_in_bytes == info.length
    )


@dataclass(frozen=True)
class PlanKeys:
    """The keys of one rank's items as the coordinator's step left them, as ids into
    tables (which ranks may share): per item its fqn (an id into ``names``), its offset
    (an id into ``sizes``; -1: None, a bytes item) and its index hint (-1: None)."""

    names: Sequence[str]
    sizes: Sequence[torch.Size]
    key_ids: Any  # numpy int64 arrays, one value per item
    offset_ids: Any
    hints: Any

    def __len__(self) -> int:
        return len(self.key_ids)

    @classmethod
    def of(cls, plan: SavePlan, hints: Sequence[int]) -> PlanKeys | None:
        """The keys of ``plan``'s items with ``hints`` set (-1: the item's own, which
        must be None); None where an item's key is not one the ids say."""
        names: dict[str, int] = {}
        sizes: dict[torch.Size, int] = {}
        key_ids, offset_ids, out = [], [], []
        for item, hint in zip(plan.items, hints, strict=True):
            index = item.index
            if type(index.fqn) is not str or (hint < 0 and index.index is not None):
                return None
            offset = index.offset
            if offset is not None and type(offset) is not torch.Size:
                return None
            key_ids.append(names.setdefault(index.fqn, len(names)))
            offset_ids.append(-1 if offset is None else sizes.setdefault(offset, len(sizes)))
            out.append(hint)
        return cls(
            list(names),
            list(sizes),
            np.array(key_ids, dtype=np.int64),
            np.array(offset_ids, dtype=np.int64),
            np.array(out, dtype=np.int64),
        )

    def index(self, i: int) -> MetadataIndex:
        """Item ``i``'s ``MetadataIndex``."""
        offset, hint = int(self.offset_ids[i]), int(self.hints[i])
        return MetadataIndex(
            self.names[self.key_ids[i]],
            None if offset < 0 else self.sizes[offset],
            None if hint < 0 else hint,
        )


@dataclass
class StorageColumns:
    """``Metadata.storage_data`` in columns, every rank's items one after another, as
    ids into tables: each item's key (fqn id, offset id, index hint; -1: None) and its
    storage info (path id, offset, length). The pickle writer (:func:`~cloudckpt.
    formats.dcp.metadata_pickle.dumps_metadata_columns`) reads these."""

    names: list[str]
    sizes: list[torch.Size]
    paths: list[str]
    key_ids: Any  # numpy int64 arrays, one value per item
    offset_ids: Any
    hints: Any
    path_ids: Any
    starts: Any
    lengths: Any

    def __len__(self) -> int:
        return len(self.key_ids)

    def storage_data(self) -> dict[MetadataIndex, _StorageInfo]:
        """The ``storage_data`` dict these columns describe (objects: for a caller that
        needs them)."""
        out = {}
        for i in range(len(self)):
            offset, hint = int(self.offset_ids[i]), int(self.hints[i])
            key = MetadataIndex(
                self.names[self.key_ids[i]],
                None if offset < 0 else self.sizes[offset],
                None if hint < 0 else hint,
            )
            path = self.paths[self.path_ids[i]]
            out[key] = _StorageInfo(path, int(self.starts[i]), int(self.lengths[i]))
        return out


class _Table:
    """A table of distinct values (names, sizes, paths) over ranks, each value the
    object ``shared`` holds for it where it holds one."""

    def __init__(self, shared: dict[Any, Any] | None = None) -> None:
        self.ids: dict[Any, int] = {}
        self.values: list[Any] = []
        self.shared = shared or {}
        self._seen: dict[int, Any] = {}  # id(a rank's table) -> its ids here

    def ids_of(self, values: Sequence[Any]) -> Any:
        """The ids here of a rank's table ``values`` (computed once per table object)."""
        known = self._seen.get(id(values))
        if known is not None and known[0] is values:
            return known[1]
        out = np.empty(len(values), dtype=np.int64)
        for i, value in enumerate(values):
            found = self.ids.get(value)
            if found is None:
                found = self.ids[value] = len(self.values)
                self.values.append(self.shared.get(value, value))
            out[i] = found
        self._seen[id(values)] = (values, out)
        return out


def join_columns(
    keys: Sequence[PlanKeys],
    results: Sequence[ItemResultColumns],
    shared_fqns: dict[str, str],
    shared_sizes: dict[torch.Size, torch.Size],
) -> tuple[StorageColumns, RecordColumns] | None:
    """Every rank's keys joined with its result columns (the same items, in the same
    order) on global tables, equal fqns and offsets the objects of ``shared_fqns`` and
    ``shared_sizes`` (so that the pickle refers to each once), and per fqn the record
    table of its items (in columns); None where a rank's columns do not match its keys."""
    if len(keys) != len(results) or any(
        len(k) != len(r) for k, r in zip(keys, results, strict=True)
    ):
        return None
    names, sizes, paths = _Table(shared_fqns), _Table(shared_sizes), _Table()
    parts: dict[str, list[Any]] = {f: [] for f in ("key", "off", "hint", "path", "start", "len")}
    records: dict[str, list[Any]] = {"start": [], "bytes": []}
    for rank_keys, rank in zip(keys, results, strict=True):
        offsets = rank_keys.offset_ids
        size_ids = np.append(sizes.ids_of(rank_keys.sizes), -1)  # -1 stays -1
        parts["key"].append(names.ids_of(rank_keys.names)[rank_keys.key_ids])
        parts["off"].append(size_ids[offsets])
        parts["hint"].append(rank_keys.hints)
        path_ids = np.frombuffer(rank.path_ids, dtype=np.int64)
        parts["path"].append(paths.ids_of(rank.paths)[path_ids] if len(path_ids) else path_ids)
        parts["start"].append(np.frombuffer(rank.starts, dtype=np.int64))
        parts["len"].append(np.frombuffer(rank.lengths, dtype=np.int64))
        records["start"].append(np.frombuffer(rank.record_starts, dtype=np.int64))
        records["bytes"].append(np.frombuffer(rank.record_bytes, dtype=np.int64))
    cat = {f: _concat(v) for f, v in parts.items()}
    cols = StorageColumns(
        names.values,
        sizes.values,
        paths.values,
        cat["key"],
        cat["off"],
        cat["hint"],
        cat["path"],
        cat["start"],
        cat["len"],
    )
    tables = _record_tables(cols, _concat(records["start"]), _concat(records["bytes"]))
    return cols, tables


def _concat(arrays: list[Any]) -> Any:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)


def _record_tables(cols: StorageColumns, starts: Any, nbytes: Any) -> RecordColumns:
    """Per fqn, the records of its items that have one and an offset (``{chunk offsets:
    (start, nbytes)}``, as the writer's object path builds them), in item order, as
    :class:`RecordColumns`."""
    recorded = (starts >= 0) & (cols.offset_ids >= 0)
    if recorded.all():  # every item (the usual case): no subset to copy
        order = stable_order(cols.key_ids, len(cols.names))
    else:
        chosen = np.flatnonzero(recorded)
        order = chosen[stable_order(cols.key_ids[chosen], len(cols.names))]
    keys = cols.key_ids[order]
    cut = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    bounds = np.concatenate([[0], cut, [len(order)]]) if len(order) else np.zeros(1, np.int64)
    names = [cols.names[k] for k in keys[bounds[:-1]].tolist()]
    return RecordColumns(
        names,
        [{} for _ in names],
        [tuple(size) for size in cols.sizes],
        bounds.astype(np.int64),
        cols.offset_ids[order],
        starts[order],
        nbytes[order],
    )


@dataclass(frozen=True)
class RecordColumns:
    """``mcore_data``'s record tables (per fqn ``{chunk offsets: (start, nbytes)}``:
    where each item's tensor lies in its stored bytes) as arrays: per fqn with records
    its name and its table object (empty until :meth:`fill`); per record (the fqns'
    records one after another, in item order) the id of its offsets in ``points`` (the
    tables' keys, one tuple per distinct offsets), its start and byte count; per fqn
    where its records start (``bounds``, one more than the names). The pickle writer
    writes the tables from these, without the per-record objects."""

    names: list[str]
    tables: list[RecordTable]
    points: list[tuple[int, ...]]
    bounds: Any  # numpy int64 arrays
    point_ids: Any
    starts: Any
    nbytes: Any

    def __len__(self) -> int:
        return len(self.point_ids)

    def by_name(self) -> dict[str, RecordTable]:
        """The table objects by fqn."""
        return dict(zip(self.names, self.tables, strict=True))

    def fill(self) -> None:
        """Fill each empty table with its records (for a caller that needs them as
        objects); a table's later record of the same offsets wins, as in a dict."""
        if all(self.tables):
            return
        points = self.points
        offsets = [points[o] for o in self.point_ids.tolist()]
        values = list(zip(self.starts.tolist(), self.nbytes.tolist(), strict=True))
        bounds = self.bounds.tolist()
        for t, table in enumerate(self.tables):
            if not table:
                lo, hi = bounds[t], bounds[t + 1]
                table.update(zip(offsets[lo:hi], values[lo:hi], strict=True))


@dataclass(frozen=True)
class ChunkColumns:
    """The chunk lists of the global metadata's tensors as ids, as the coordinator's
    step on columns made them: per tensor (in order) its key and its list object
    (empty until :meth:`fill`); per chunk (the tensors' chunks one after another) ids
    into ``sizes`` of its offsets and sizes; per tensor where its chunks start
    (``bounds``, one more than the tensors). The pickle writer writes the lists from
    these where the metadata still holds those very lists, without the objects."""

    names: list[str]
    lists: list[list[ChunkStorageMetadata]]
    sizes: list[torch.Size]
    offset_ids: Any  # numpy int64 arrays, one value per chunk
    size_ids: Any
    bounds: Any  # numpy int64 array, len(names) + 1

    def counts(self) -> list[int]:
        """Each tensor's number of chunks."""
        return np.diff(self.bounds).tolist()  # type: ignore[no-any-return]

    def fill(self) -> None:
        """Fill each empty list with its ``ChunkStorageMetadata`` objects (for a caller
        that needs the metadata whole: the objects path, another pickle)."""
        at = self.sizes.__getitem__
        bounds = self.bounds.tolist()
        for t, chunk_list in enumerate(self.lists):
            lo, hi = bounds[t], bounds[t + 1]
            if chunk_list or hi == lo:
                continue
            offsets, sizes = self.offset_ids[lo:hi].tolist(), self.size_ids[lo:hi].tolist()
            chunk_list.extend(map(ChunkStorageMetadata, map(at, offsets), map(at, sizes)))


def as_write_results(
    keys: PlanKeys, results: ItemResultColumns | list[DcpWriteResult]
) -> list[DcpWriteResult]:
    """One rank's results as DCP's ``WriteResult`` objects (the writer's object path),
    whether it sent columns or objects."""
    if not isinstance(results, ItemResultColumns):
        return results
    out = []
    for i in range(len(results)):
        start, nbytes = results.record_starts[i], results.record_bytes[i]
        info = RecordedStorageInfo(
            results.paths[results.path_ids[i]],
            results.starts[i],
            results.lengths[i],
            record=None if start < 0 else (start, nbytes),
        )
        out.append(DcpWriteResult(keys.index(i), results.lengths[i], info))
    return out


@dataclass(frozen=True)
class PlanColumns:
    """One rank's local ``SavePlan`` in columns, what it sends the coordinator instead
    of the plan's ``WriteItem`` objects: per item its fqn and type; per tensor item ids
    into the rank's distinct sizes (chunk offsets, chunk sizes, the tensor's size) and
    distinct ``TensorProperties``; the bytes items whole (there are few). The plan's
    own fields as they are. :meth:`to_plan` gives the plan back (equal items) where the
    coordinator takes DCP's step.

    Attributes:
        keys: the items' keys (fqns) joined by ``"\\x00"``, UTF-8, zlib-compressed: one
            small string to send and unpickle, not one object per item (:attr:`fqns`
            gives them back; a key holding the separator makes the plan go as
            objects). DP replicas send equal ones: the coordinator looks each distinct
            one up once.
        types: per item, its ``WriteItemType`` value.
        sizes: the rank's distinct ``torch.Size`` values.
        offset_ids, size_ids, extent_ids: per item, ids into ``sizes`` of its chunk's
            offsets and sizes and its tensor's size (-1: a bytes item).
        properties: the rank's distinct ``TensorProperties``.
        property_ids: per item, an id into ``properties`` (-1: a bytes item).
        byte_items: the bytes items, by position.
    """

    keys: bytes
    types: bytes
    sizes: tuple[torch.Size, ...]
    offset_ids: array.array[int]
    size_ids: array.array[int]
    extent_ids: array.array[int]
    properties: tuple[TensorProperties, ...]
    property_ids: array.array[int]
    byte_items: dict[int, WriteItem]
    storage_data: Any
    planner_data: Any
    usable: bool

    def __len__(self) -> int:
        return len(self.types)

    @property
    def fqns(self) -> list[str]:
        """Per item, its key."""
        joined = zlib.decompress(self.keys).decode("utf-8", "surrogatepass")
        return joined.split(KEY_SEPARATOR) if self.types else []

    @classmethod
    def of(cls, plan: SavePlan) -> PlanColumns | None:
        """``plan`` in columns; None where an item is not one the columns say exactly
        (another class, an index hint, an index naming another chunk)."""
        if type(plan) is not SavePlan:
            return None
        n = len(plan.items)
        sizes: dict[torch.Size, int] = {}
        props: dict[tuple[Any, ...], int] = {}
        props_of: list[TensorProperties] = []
        ids = [_zeros(n, -1) for _ in range(4)]
        fqns: list[str] = []
        types = bytearray(n)
        byte_items: dict[int, WriteItem] = {}
        for i, item in enumerate(plan.items):
            index = item.index
            if type(item) is not WriteItem or type(index) is not MetadataIndex:
                return None
            if type(index.fqn) is not str or index.index is not None:
                return None
            fqns.append(index.fqn)
            types[i] = item.type.value
            if item.type == WriteItemType.BYTE_IO:
                if item.tensor_data is not None or index.offset is not None:
                    return None
                byte_items[i] = item
                continue
            found = _tensor_ids(item, sizes, props, props_of)
            if found is None:
                return None
            for column, value in zip(ids, found, strict=True):
                column[i] = value
        joined = KEY_SEPARATOR.join(fqns)
        if joined.count(KEY_SEPARATOR) != max(n - 1, 0):
            return None  # a key holds the separator
        return cls(
            zlib.compress(joined.encode("utf-8", "surrogatepass"), 1),
            bytes(types),
            tuple(sizes),
            ids[0],
            ids[1],
            ids[2],
            tuple(props_of),
            ids[3],
            byte_items,
            plan.storage_data,
            plan.planner_data,
            plan.usable,
        )

    def to_plan(self) -> SavePlan:
        """The plan these columns say (items equal to the rank's)."""
        items = []
        for i, fqn in enumerate(self.fqns):
            byte_item = self.byte_items.get(i)
            if byte_item is not None:
                items.append(byte_item)
                continue
            offsets = self.sizes[self.offset_ids[i]]
            chunk = ChunkStorageMetadata(offsets, self.sizes[self.size_ids[i]])
            data = TensorWriteData(
                chunk,
                self.properties[self.property_ids[i]],
                self.sizes[self.extent_ids[i]],
            )
            kind = WriteItemType(self.types[i])
            items.append(WriteItem(MetadataIndex(fqn, offsets), kind, tensor_data=data))
        return SavePlan(items, self.storage_data, self.planner_data, self.usable)


def _tensor_ids(
    item: WriteItem,
    sizes: dict[torch.Size, int],
    props: dict[tuple[Any, ...], int],
    props_of: list[TensorProperties],
) -> tuple[int, int, int, int] | None:
    """A tensor item's ids into the rank's sizes (chunk offsets, chunk sizes, tensor
    size) and properties; None where it is not plain."""
    data = item.tensor_data
    if type(data) is not TensorWriteData or item.bytes_io_data is not None:
        return None
    if item.type not in (WriteItemType.SHARD, WriteItemType.TENSOR):
        return None
    chunk, properties = data.chunk, data.properties
    if type(chunk) is not ChunkStorageMetadata or type(properties) is not TensorProperties:
        return None
    values = (chunk.offsets, chunk.sizes, data.size)
    if any(type(v) is not torch.Size for v in values) or item.index.offset != chunk.offsets:
        return None
    if list(vars(chunk)) != ["offsets", "sizes"]:
        return None
    key = tuple(vars(properties).items())
    pid = props.get(key)
    if pid is None:
        pid = props[key] = len(props_of)
        props_of.append(properties)
    found = [sizes.setdefault(v, len(sizes)) for v in values]
    return found[0], found[1], found[2], pid


__all__ = [
    "KEY_SEPARATOR",
    "ChunkColumns",
    "ItemResultColumns",
    "PlanColumns",
    "PlanKeys",
    "RecordColumns",
    "RecordTable",
    "StorageColumns",
    "as_write_results",
    "join_columns",
]
