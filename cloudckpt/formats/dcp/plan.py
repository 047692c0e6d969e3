"""A linear-time coordinator step for DCP saves: the same global plans and ``Metadata``
as PyTorch DCP's ``DefaultSavePlanner.create_global_plan``, without its per-item costs.

DCP's default de-duplicates the plans (a dict of every item's index, several hashes
per item), rewrites every item's index hint with two ``dataclasses.replace`` per item,
then validates each tensor's chunks (bounds, a sweep for overlaps, the covered
volume). :func:`linear_global_save_plan` does the same work once per item, and proves
the common valid case cheaply:

* no two items share an index (key and offset): de-duplication would keep every item;
* each tensor's chunks lie within its bounds, form a grid (each chunk spans exactly
  one cell between consecutive chunk offsets, in every dimension) and, with more than
  one plan, cover its volume: they cannot overlap.

Where it cannot prove that (duplicates, chunks off a grid, an error), it returns None
and the caller runs DCP's own step, which gives DCP's results and errors unchanged.
"""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from cloudckpt.array_utils import stable_order
from cloudckpt.formats.dcp.columns import ChunkColumns, PlanColumns, PlanKeys
from cloudckpt.formats.dcp.grid import GridChunks, valid_chunks

_STORAGE = BytesStorageMetadata | TensorStorageMetadata
#: copying the instance dicts (item, index) is exact only for dataclasses with one
_FAST_COPY = not hasattr(WriteItem, "__slots__") and not hasattr(MetadataIndex, "__slots__")


def _with_index_hint(item: WriteItem, hint: int) -> WriteItem:
    """``item`` with its index hint set, as ``dataclasses.replace`` makes it (same
    fields, same attribute order), without calling the constructors."""
    if not _FAST_COPY:
        return dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint))
    index = object.__new__(MetadataIndex)
    index.__dict__.update(item.index.__dict__)
    index.__dict__["index"] = hint
    new = object.__new__(WriteItem)
    new.__dict__.update(item.__dict__)
    new.__dict__["index"] = index
    return new


def linear_global_save_plan(
    all_plans: Sequence[SavePlan],
) -> tuple[list[SavePlan], Metadata] | None:
    """DCP's default global plans and metadata for ``all_plans`` (no flattening, no
    plan caching), or None where the fast path cannot prove they are those."""
    planned = _linear_global(all_plans)
    return None if planned is None else (planned[0], planned[1])


def _linear_global(
    all_plans: Sequence[SavePlan], hinted: bool = True
) -> tuple[list[SavePlan], Metadata, list[array.array[int]]] | None:
    """:func:`linear_global_save_plan`, and per plan the index hint it set on each item
    (-1: the item is kept as it is). With ``hinted`` off, the plans keep their items
    (the hints are only returned: :func:`apply_global_plan_update` sets them)."""
    md: dict[str, _STORAGE] = {}
    tensors: dict[str, _Tensor] = {}
    columns: dict[int, _RankChunks] = {}
    new_plans = []
    all_hints = []
    for plan in all_plans:
        if not plan.usable:
            return None
        hints = _plan_hints(plan, md, tensors, columns)
        if hints is None:
            return None
        if hinted:
            items = [
                item if hint < 0 else _with_index_hint(item, hint)
                for item, hint in zip(plan.items, hints, strict=True)
            ]
            new_plans.append(dataclasses.replace(plan, items=items))
        else:
            new_plans.append(plan)
        all_hints.append(hints)
    check_fill = len(new_plans) > 1
    if not all(col.valid(check_fill) for ndim, col in columns.items() if ndim):
        return None
    return new_plans, Metadata(md), all_hints


#: a tensor's chunks in the metadata, its id among the tensors of its rank, its rank
#: (number of dimensions) and the columns of its chunks
_Tensor = tuple[list[ChunkStorageMetadata], int, int, "_RankChunks"]


def _plan_hints(
    plan: SavePlan,
    md: dict[str, _STORAGE],
    tensors: dict[str, _Tensor],
    columns: dict[int, _RankChunks],
) -> array.array[int] | None:
    """Add ``plan``'s items to the metadata and the columns; the index hint of each
    (-1: kept), or None where DCP must decide (a duplicate, a clash, a chunk whose
    rank differs from its tensor's or that its index does not name)."""
    hints = array.array("q")
    for item in plan.items:
        index = item.index
        fqn = index.fqn
        if item.type == WriteItemType.BYTE_IO:
            if fqn in md:  # a duplicate (DCP de-duplicates) or a clash: DCP decides
                return None
            md[fqn] = BytesStorageMetadata()
            hints.append(-1)
            continue
        data = item.tensor_data
        if data is None or data.chunk is None:
            return None
        entry = tensors.get(fqn)
        if entry is None:
            if fqn in md:
                return None
            entry = _new_tensor(md, tensors, columns, fqn, data.properties, data.size)
        elif item.type != WriteItemType.SHARD:
            return None
        chunks, tid, ndim, col = entry
        chunk = data.chunk
        offsets, sizes = chunk.offsets, chunk.sizes
        if len(offsets) != ndim or len(sizes) != ndim:
            return None
        if index.offset is not offsets and index.offset != offsets:
            return None  # the index names another chunk: DCP decides
        if not ndim and chunks:
            return None  # a 0-d tensor's second chunk (its columns are not checked)
        hints.append(len(chunks))
        chunks.append(chunk)
        col.tids.append(tid)
        col.offsets.extend(offsets)
        col.sizes.extend(sizes)
    return hints


def _new_tensor(
    md: dict[str, _STORAGE],
    tensors: dict[str, _Tensor],
    columns: dict[int, _RankChunks],
    fqn: str,
    properties: Any,
    size: torch.Size,
) -> _Tensor:
    """Register tensor ``fqn`` (its metadata, its id among the tensors of its rank)."""
    value = md[fqn] = TensorStorageMetadata(properties, size, [])
    ndim = len(size)
    col = columns.get(ndim)
    if col is None:
        col = columns[ndim] = _RankChunks(ndim)
    tid = len(col.extents) // max(ndim, 1) if ndim else 0
    col.extents.extend(size)
    entry = tensors[fqn] = (value.chunks, tid, ndim, col)
    return entry


class _RankChunks:
    """The chunks of the tensors of one rank (number of dimensions), as columns: each
    chunk's tensor id, offsets and sizes; each tensor's size."""

    def __init__(self, ndim: int) -> None:
        self.ndim = ndim
        self.tids = array.array("q")
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.extents: list[int] = []

    def valid(self, check_fill: bool) -> bool:
        """True when DCP's ``_validate_global_plan`` finds no error for these tensors
        and no two chunks of a tensor share their offsets, proven by bounds, a grid
        and (``check_fill``) the volume; False when it may find one."""
        try:
            off = np.array(self.offsets, dtype=np.int64).reshape(-1, self.ndim)
            sz = np.array(self.sizes, dtype=np.int64).reshape(-1, self.ndim)
            ext = np.array(self.extents, dtype=np.int64).reshape(-1, self.ndim)
        except (OverflowError, TypeError, ValueError):
            return False
        tids = np.frombuffer(self.tids, dtype=np.int64)
        return valid_chunks(GridChunks.of_rows(off, sz, ext, tids), check_fill)


@dataclass(frozen=True)
class ColumnsGlobalPlan:
    """:func:`linear_global_columns`' result: DCP's global ``Metadata``, per rank the
    index hint of each item (-1: kept) and its items' keys (for results in columns).
    The metadata's chunk lists are empty until :meth:`ChunkColumns.fill` (``chunks``)
    fills them: the coordinator pickles them from the ids, without the objects."""

    metadata: Metadata
    hints: list[array.array[int]]
    keys: list[PlanKeys]
    chunks: ChunkColumns


_BYTE_IO = WriteItemType.BYTE_IO.value
_SHARD = WriteItemType.SHARD.value


def linear_global_columns(plans: Sequence[PlanColumns]) -> ColumnsGlobalPlan | None:
    """:func:`linear_global_save_plan` on plans sent in columns (:class:`~cloudckpt.
    formats.dcp.columns.PlanColumns`): the same ``Metadata`` and index hints, the
    checks run on arrays (a Python step per item only to look up its key), or None
    where the fast path cannot prove them (the caller then runs DCP's step on
    :meth:`PlanColumns.to_plan`)."""
    if not all(plan.usable for plan in plans):
        return None
    table = _KeyTable()
    parts = []
    for plan in plans:
        part = table.add(plan)
        if part is None:
            return None
        parts.append(part)
    return table.finish(plans, parts, check_fill=len(plans) > 1)


class _KeyTable:
    """The coordinator's tables for :func:`linear_global_columns`: the metadata by key,
    each key's id and tensor, each tensor's size, the distinct sizes of every rank."""

    def __init__(self) -> None:
        self.md: dict[str, _STORAGE] = {}
        self.ids: dict[str, int] = {}  # a key's id: its position in names
        self.names: list[str] = []
        self.key_tensor: list[int] = []  # per key, its tensor's id; -2: a bytes key
        self._key_tensor = np.zeros(0, dtype=np.int64)  # key_tensor, as far as converted
        self.values: list[TensorStorageMetadata] = []
        self.tensor_names: list[str] = []
        self.extents: list[torch.Size] = []
        self.sizes: dict[torch.Size, int] = {}
        self._known: dict[bytes, Any] = {}  # a key list seen (as sent): its key ids

    def add(self, plan: PlanColumns) -> tuple[Any, ...] | None:
        """Register one rank's items: per item its key's id; per tensor item (a mask
        over the items) its tensor's id and the global ids of its chunk's offsets and
        sizes."""
        cached = self._known.get(plan.keys)
        if cached is not None:  # a replica's key list: every key known, none first
            kid, first = cached, np.zeros(len(plan), dtype=bool)
        else:
            kid, first = self._key_ids(plan)
            kid.flags.writeable = False  # shared by the ranks sending this list
            self._known[plan.keys] = kid
        return self._rank_part(plan, kid, first)

    def _key_ids(self, plan: PlanColumns) -> tuple[Any, Any]:
        """Per item its key's id (new keys registered) and whether it registered it."""
        fqns, ids = plan.fqns, self.ids
        kids = [ids.get(f, -1) for f in fqns]
        first = np.zeros(len(fqns), dtype=bool)
        for i in [i for i, k in enumerate(kids) if k == -1]:
            fqn = fqns[i]
            known = ids.get(fqn)
            if known is not None:  # a second chunk of a tensor new on this rank
                kids[i] = known
                continue
            first[i] = True
            kids[i] = ids[fqn] = len(self.names)
            self.names.append(fqn)
            if plan.types[i] == _BYTE_IO:
                self.md[fqn] = BytesStorageMetadata()
                self.key_tensor.append(-2)
                continue
            extent = plan.sizes[plan.extent_ids[i]]
            value = TensorStorageMetadata(plan.properties[plan.property_ids[i]], extent, [])
            self.md[fqn] = value
            self.key_tensor.append(len(self.values))
            self.values.append(value)
            self.tensor_names.append(fqn)
            self.extents.append(extent)
        if len(self._key_tensor) < len(self.key_tensor):
            added = np.array(self.key_tensor[len(self._key_tensor) :], dtype=np.int64)
            self._key_tensor = np.concatenate([self._key_tensor, added])
        return np.array(kids, dtype=np.int64), first

    def _rank_part(self, plan: PlanColumns, kid: Any, first: Any) -> tuple[Any, ...] | None:
        """The checks of one rank's items on arrays; its part (see :meth:`add`)."""
        kinds = np.frombuffer(plan.types, dtype=np.uint8)
        tid = self._key_tensor[kid]
        byte = kinds == _BYTE_IO
        if (byte & ~first).any() or (~byte & (tid < 0)).any():
            return None  # a duplicate or a clash of keys: DCP decides
        if (~byte & ~first & (kinds != _SHARD)).any():
            return None
        to_global = np.array(
            [self.sizes.setdefault(v, len(self.sizes)) for v in plan.sizes], dtype=np.int64
        )
        tensor = ~byte
        offsets = np.frombuffer(plan.offset_ids, dtype=np.int64)[tensor]
        sizes = np.frombuffer(plan.size_ids, dtype=np.int64)[tensor]
        return tensor, tid[tensor], to_global[offsets], to_global[sizes], kid

    def finish(
        self, plans: Sequence[PlanColumns], parts: list[Any], check_fill: bool
    ) -> ColumnsGlobalPlan | None:
        """Check every tensor's chunks at once; the metadata, hints and keys."""
        empty = np.zeros(0, dtype=np.int64)
        tid = np.concatenate([p[1] for p in parts] or [empty])
        off = np.concatenate([p[2] for p in parts] or [empty])
        sz = np.concatenate([p[3] for p in parts] or [empty])
        pool = list(self.sizes)
        matrix = _size_matrix(pool)
        extents = _size_matrix(self.extents)
        if matrix is None or extents is None:
            return None
        (pool_ndim, pool_rows), (ndim, ext_rows) = matrix, extents
        chunk_ndim = ndim[tid]
        if not ((pool_ndim[off] == chunk_ndim).all() and (pool_ndim[sz] == chunk_ndim).all()):
            return None  # a chunk whose rank differs from its tensor's: DCP decides
        width = max(int(ndim.max(initial=0)), 1)  # every rank padded to one (0-d: 1-d)
        grid = GridChunks(
            tid,
            off,
            sz,
            _padded(pool_rows, pool_ndim, width, 0),
            _padded(pool_rows, pool_ndim, width, 1),
            _padded(ext_rows, ndim, width, 1),
        )
        if not valid_chunks(grid, check_fill):
            return None
        del grid, chunk_ndim
        order = stable_order(tid, len(self.values))
        ordered = tid[order]
        starts = np.searchsorted(ordered, np.arange(len(self.values) + 1))
        hint_all = np.empty(len(tid), dtype=np.int64)
        hint_all[order] = np.arange(len(tid)) - starts[ordered]
        lists = [value.chunks for value in self.values]  # empty: filled on request
        columns = ChunkColumns(self.tensor_names, lists, pool, off[order], sz[order], starts)
        return self._per_rank(plans, parts, hint_all, columns)

    def _per_rank(
        self, plans: Sequence[PlanColumns], parts: list[Any], hint_all: Any, chunks: ChunkColumns
    ) -> ColumnsGlobalPlan:
        pool = chunks.sizes
        hints, keys = [], []
        done = 0
        for plan, (tensor, _, off, _, kid) in zip(plans, parts, strict=True):
            rank = np.full(len(plan), -1, dtype=np.int64)
            offsets = np.full(len(plan), -1, dtype=np.int64)
            count = len(off)
            rank[tensor] = hint_all[done : done + count]
            offsets[tensor] = off
            done += count
            hints.append(array.array("q", rank.tobytes()))
            keys.append(PlanKeys(self.names, pool, kid, offsets, rank))
        return ColumnsGlobalPlan(Metadata(self.md), hints, keys, chunks)


def _size_matrix(sizes: Sequence[torch.Size]) -> tuple[Any, Any] | None:
    """The ranks (dimensions) of ``sizes`` and their values as rows (zero-padded);
    None where a value does not fit int64."""
    ndim = np.array([len(s) for s in sizes], dtype=np.int64)
    width = int(ndim.max(initial=0))
    try:
        rows = np.array([(*s, *([0] * (width - len(s)))) for s in sizes], dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        return None
    return ndim, rows.reshape(len(sizes), width)


def _padded(rows: Any, ndim: Any, width: int, fill: int) -> Any:
    """``rows`` of :func:`_size_matrix` (ranks ``ndim``) as ``width`` columns, ``fill``
    past each row's rank: a dimension of one cell (offset 0, size and extent 1) leaves
    every check of :func:`~cloudckpt.formats.dcp.grid.valid_chunks` as it is, so
    tensors of all ranks are checked at once."""
    out = np.full((len(rows), width), fill, dtype=np.int64)
    used = min(width, rows.shape[1])
    out[:, :used] = rows[:, :used]
    out[np.arange(width)[None, :] >= ndim[:, None]] = fill
    return out


def share_equal_sizes(plan: SavePlan) -> SavePlan:
    """``plan`` with its equal ``torch.Size`` values (an item's index offset and chunk
    offsets, chunk sizes, global sizes) and ``TensorProperties`` made one object each
    (there are few distinct ones), so that its pickle refers to each once: the same
    plan when unpickled, sent and unpickled by the coordinator in fewer bytes and less
    time (one ``TensorProperties.__setstate__`` per distinct value, not per item).
    Changes the plan's own (frozen) items in place, as their constructors set their
    fields; returns it."""
    pool: dict[torch.Size, torch.Size] = {}
    properties: dict[tuple[Any, ...], Any] = {}
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            continue
        props = data.properties
        if type(props) is TensorProperties:  # a plain dataclass: equal when its fields are
            key = tuple(vars(props).items())
            object.__setattr__(data, "properties", properties.setdefault(key, props))
        chunk = data.chunk
        chunk.offsets = pool.setdefault(chunk.offsets, chunk.offsets)
        chunk.sizes = pool.setdefault(chunk.sizes, chunk.sizes)
        object.__setattr__(data, "size", pool.setdefault(data.size, data.size))
        offset = item.index.offset
        if offset is not None:
            object.__setattr__(item.index, "offset", pool.setdefault(offset, offset))
    return plan


class LinearGlobalPlanMixin(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` whose coordinator step is :func:`linear_global_save_plan`
    where it applies (``flatten_state_dict`` off, no plan caching), DCP's otherwise.

    After the fast path, :attr:`index_hints` holds per plan the index hint set on each
    item (-1: kept): all that step changed (see :func:`global_plan_updates`); None
    after DCP's own step. :attr:`items_hinted` is False after
    :meth:`create_global_plan_unhinted`'s fast path: its plans keep the local items."""

    index_hints: list[array.array[int]] | None = None
    items_hinted: bool = True
    exact_in_columns: ClassVar[bool] = True
    """The coordinator's step on columns (:meth:`create_global_plan_columns`) gives what
    this planner's own steps would. Declared: a subclass has it only where its body says
    so (one that changes a step does not), so that a custom planner gets its own step."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "exact_in_columns" not in cls.__dict__:
            cls.exact_in_columns = False

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, its equal sizes shared (:func:`share_equal_sizes`)."""
        return share_equal_sizes(super().create_local_plan())

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return self._global_plan(all_plans, hinted=True)

    def create_global_plan_unhinted(
        self, all_plans: list[SavePlan]
    ) -> tuple[list[SavePlan], Metadata]:
        """:meth:`create_global_plan`, except that on the fast path the plans keep their
        local items, without the index hints (:attr:`index_hints` holds them): for a
        coordinator that scatters :class:`GlobalPlanUpdate` s only, which set them on
        each rank. DCP's own step (where the fast path does not apply) sets them."""
        return self._global_plan(all_plans, hinted=False)

    def create_global_plan_columns(
        self, all_plans: Sequence[PlanColumns]
    ) -> ColumnsGlobalPlan | None:
        """:meth:`create_global_plan_unhinted`'s fast path on plans sent in columns
        (:func:`linear_global_columns`); None where it does not apply (the caller runs
        :meth:`create_global_plan_unhinted` on the plans as objects)."""
        self.index_hints = None
        self.items_hinted = True
        if self.flatten_state_dict or getattr(self, "_enable_plan_caching", False):
            return None
        fast = linear_global_columns(all_plans)
        if fast is None:
            return None
        self.metadata, self.index_hints, self.items_hinted = fast.metadata, fast.hints, False
        return fast

    def _global_plan(
        self, all_plans: list[SavePlan], hinted: bool
    ) -> tuple[list[SavePlan], Metadata]:
        fast = None
        self.index_hints = None
        self.items_hinted = True
        if not self.flatten_state_dict and not getattr(self, "_enable_plan_caching", False):
            fast = _linear_global(all_plans, hinted)
        if fast is None:
            return super().create_global_plan(all_plans)
        self.global_plan, self.metadata, self.index_hints = fast
        self.items_hinted = hinted
        return self.global_plan, self.metadata


@dataclass(frozen=True)
class GlobalPlanUpdate:
    """What the coordinator's step changed in one rank's local plan, when that was only
    the items' index hints and the plan's fields (the writer's ``storage_data``): what
    the coordinator scatters instead of the whole global plan (a few bytes per item
    instead of the items), expanded by the rank with :func:`apply_global_plan_update`.

    Attributes:
        hints: per item of the local plan, its index hint; -1 keeps the item as it is.
        columns: the coordinator knows every item's key from the plans: the rank sends
            its write results in columns (:mod:`~cloudckpt.formats.dcp.columns`).
    """

    hints: array.array[int]
    storage_data: Any
    planner_data: Any
    usable: bool
    columns: bool = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its fields' values (no field names: sent to every rank)."""
        fields = (self.hints, self.storage_data, self.planner_data, self.usable)
        return type(self), (*fields, self.columns) if self.columns else fields


def global_plan_updates(
    planner: Any, planned: Sequence[SavePlan], central: Sequence[SavePlan]
) -> list[SavePlan | GlobalPlanUpdate]:
    """Per rank, what the coordinator scatters: a :class:`GlobalPlanUpdate` where
    ``planner``'s step only set index hints (its fast path) and the storage writer's
    ``prepare_global_plan`` kept that step's items (``planned``: the planner's plans,
    ``central``: the writer's), else the whole global plan."""
    hints = getattr(planner, "index_hints", None)
    if hints is None or len(hints) != len(central):
        return list(central)
    out: list[SavePlan | GlobalPlanUpdate] = []
    for plan, new, hinted in zip(planned, central, hints, strict=True):
        if new.items is plan.items:  # the writer changed no item
            out.append(GlobalPlanUpdate(hinted, new.storage_data, new.planner_data, new.usable))
        elif not getattr(planner, "items_hinted", True):
            raise ValueError(
                "the storage writer changed the items of plans planned without index hints"
            )
        else:
            out.append(new)
    return out


def apply_global_plan_update(local: SavePlan, update: SavePlan | GlobalPlanUpdate) -> SavePlan:
    """The global plan of the rank whose local plan is ``local``: ``update`` itself, or
    ``local`` with the :class:`GlobalPlanUpdate` applied (the same plan DCP's step
    gives, index hints included)."""
    if not isinstance(update, GlobalPlanUpdate):
        return update
    if len(update.hints) != len(local.items):
        raise ValueError(
            f"the global plan update has {len(update.hints)} index hints for "
            f"{len(local.items)} items of the local plan"
        )
    items = [
        item if hint < 0 else _with_index_hint(item, hint)
        for item, hint in zip(local.items, update.hints, strict=True)
    ]
    return dataclasses.replace(
        local,
        items=items,
        storage_data=update.storage_data,
        planner_data=update.planner_data,
        usable=update.usable,
    )


__all__ = [
    "ColumnsGlobalPlan",
    "GlobalPlanUpdate",
    "LinearGlobalPlanMixin",
    "apply_global_plan_update",
    "global_plan_updates",
    "linear_global_columns",
    "linear_global_save_plan",
    "share_equal_sizes",
]
