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
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

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
    all_plans: Sequence[SavePlan],
) -> tuple[list[SavePlan], Metadata, list[array.array[int]]] | None:
    """:func:`linear_global_save_plan`, and per plan the index hint it set on each item
    (-1: the item is kept as it is)."""
    seen: set[tuple[str, Any]] = set()
    md: dict[str, _STORAGE] = {}
    new_plans = []
    all_hints = []
    for plan in all_plans:
        if not plan.usable:
            return None
        items = []
        hints = array.array("q")
        for item in plan.items:
            index = item.index
            unique = (index.fqn, index.offset)
            if unique in seen:  # de-duplication (or an error) would follow: DCP decides
                return None
            seen.add(unique)
            if item.type == WriteItemType.BYTE_IO:
                if index.fqn in md:
                    return None
                md[index.fqn] = BytesStorageMetadata()
                items.append(item)
                hints.append(-1)
                continue
            data = item.tensor_data
            if data is None or data.chunk is None:
                return None
            tensor_md = md.get(index.fqn)
            if tensor_md is None:
                tensor_md = md[index.fqn] = TensorStorageMetadata(data.properties, data.size, [])
            elif not isinstance(tensor_md, TensorStorageMetadata) or (
                item.type != WriteItemType.SHARD
            ):
                return None
            hints.append(len(tensor_md.chunks))
            items.append(_with_index_hint(item, hints[-1]))
            tensor_md.chunks.append(data.chunk)
        new_plans.append(dataclasses.replace(plan, items=items))
        all_hints.append(hints)
    metadata = Metadata(md)
    if not all(_valid_chunks(v, len(new_plans) > 1) for v in md.values()):
        return None
    return new_plans, metadata, all_hints


def _valid_chunks(value: _STORAGE, check_fill: bool) -> bool:
    """True when DCP's ``_validate_global_plan`` finds no error for ``value``, proven
    by bounds, a grid and (``check_fill``) the volume; False when it may find one."""
    if isinstance(value, BytesStorageMetadata) or len(value.size) == 0:
        return True
    size = tuple(value.size)
    chunks = value.chunks
    volume = 0
    for chunk in chunks:
        if not len(chunk.offsets) == len(chunk.sizes) == len(size):
            return False
        for offset, length, dim in zip(chunk.offsets, chunk.sizes, size, strict=True):
            if offset < 0 or length < 0 or offset + length > dim:
                return False
        volume += math.prod(chunk.sizes)
    if check_fill and volume != math.prod(size):
        return False
    return len(chunks) < 2 or _on_grid(chunks, size)


def _on_grid(chunks: Iterable[ChunkStorageMetadata], size: tuple[int, ...]) -> bool:
    """True when every chunk spans exactly one cell of the grid made by the chunks'
    offsets in each dimension (distinct offsets, checked by the caller: disjoint)."""
    chunks = list(chunks)
    for dim, extent in enumerate(size):
        bounds = sorted({c.offsets[dim] for c in chunks} | {extent})
        following = dict(itertools.pairwise(bounds))
        for c in chunks:
            if following.get(c.offsets[dim]) != c.offsets[dim] + c.sizes[dim]:
                return False
    return True


def share_equal_sizes(plan: SavePlan) -> SavePlan:
    """``plan`` with its equal ``torch.Size`` values made one object each (an item's
    index offset and chunk offsets, chunk sizes, global sizes: few distinct ones), so
    that its pickle refers to each once: the same plan when unpickled, sent and
    unpickled by the coordinator in fewer bytes and less time. Changes the plan's own
    (frozen) items in place, as their constructors set their fields; returns it."""
    pool: dict[torch.Size, torch.Size] = {}
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            continue
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
    after DCP's own step."""

    index_hints: list[array.array[int]] | None = None

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan, its equal sizes shared (:func:`share_equal_sizes`)."""
        return share_equal_sizes(super().create_local_plan())

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        fast = None
        self.index_hints = None
        if not self.flatten_state_dict and not getattr(self, "_enable_plan_caching", False):
            fast = _linear_global(all_plans)
        if fast is None:
            return super().create_global_plan(all_plans)
        self.global_plan, self.metadata, self.index_hints = fast
        return self.global_plan, self.metadata


@dataclass(frozen=True)
class GlobalPlanUpdate:
    """What the coordinator's step changed in one rank's local plan, when that was only
    the items' index hints and the plan's fields (the writer's ``storage_data``): what
    the coordinator scatters instead of the whole global plan (a few bytes per item
    instead of the items), expanded by the rank with :func:`apply_global_plan_update`.

    Attributes:
        hints: per item of the local plan, its index hint; -1 keeps the item as it is.
    """

    hints: array.array[int]
    storage_data: Any
    planner_data: Any
    usable: bool


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
    "GlobalPlanUpdate",
    "LinearGlobalPlanMixin",
    "apply_global_plan_update",
    "global_plan_updates",
    "linear_global_save_plan",
    "share_equal_sizes",
]
