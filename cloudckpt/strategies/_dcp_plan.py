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

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

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
    seen: set[tuple[str, Any]] = set()
    md: dict[str, _STORAGE] = {}
    new_plans = []
    for plan in all_plans:
        if not plan.usable:
            return None
        items = []
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
            items.append(_with_index_hint(item, len(tensor_md.chunks)))
            tensor_md.chunks.append(data.chunk)
        new_plans.append(dataclasses.replace(plan, items=items))
    metadata = Metadata(md)
    if not all(_valid_chunks(v, len(new_plans) > 1) for v in md.values()):
        return None
    return new_plans, metadata


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


class LinearGlobalPlanMixin(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` whose coordinator step is :func:`linear_global_save_plan`
    where it applies (``flatten_state_dict`` off, no plan caching), DCP's otherwise."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        fast = None
        if not self.flatten_state_dict and not getattr(self, "_enable_plan_caching", False):
            fast = linear_global_save_plan(all_plans)
        if fast is None:
            return super().create_global_plan(all_plans)
        self.global_plan, self.metadata = fast
        return fast


__all__ = ["LinearGlobalPlanMixin", "linear_global_save_plan"]
