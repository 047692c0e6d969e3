"""The global ``Metadata`` the DCP writer (:mod:`.storage`) pickles, from the ranks'
write results: ``storage_data`` and the per-key records of where each tensor item's
elements lie (:func:`_storage_data`), with equal chunk offsets and sizes made one object
(:func:`_share_sizes`); and several DCP saves' ``Metadata`` merged into one
(:func:`merge_metadata`)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.ranges import RecordedStorageInfo, plain_info


def _share_sizes(metadata: Metadata) -> dict[torch.Size, torch.Size]:
    """Make equal chunk offsets and sizes of ``metadata`` one object each (there are few
    distinct ones: the chunks of a layout repeat); the pool of them."""
    pool: dict[torch.Size, torch.Size] = {}
    for value in metadata.state_dict_metadata.values():
        for chunk in getattr(value, "chunks", ()):
            chunk.offsets = pool.setdefault(chunk.offsets, chunk.offsets)
            chunk.sizes = pool.setdefault(chunk.sizes, chunk.sizes)
    return pool


def _storage_data(
    results: list[list[DcpWriteResult]],
    sizes: dict[torch.Size, torch.Size],
    keys: dict[str, str],
) -> tuple[dict[MetadataIndex, Any], dict[str, dict[tuple[int, ...], tuple[int, int]]]]:
    """``Metadata.storage_data`` (each item's DCP ``_StorageInfo``, its record dropped)
    and per key the records of its items (``{offsets: (start, nbytes)}``), in one pass.
    Each index's offset and key become the equal ones of ``sizes`` and ``keys`` (the
    items of one key come from several ranks: as one string, pickled once)."""
    storage: dict[MetadataIndex, Any] = {}
    tables: dict[str, dict[tuple[int, ...], tuple[int, int]]] = {}
    points: dict[torch.Size, tuple[int, ...]] = {}  # the records' keys, one tuple each
    for rank in results:
        for result in rank:
            index, info = result.index, result.storage_data
            fqn = keys.get(index.fqn)
            if fqn is not None and fqn is not index.fqn:
                object.__setattr__(index, "fqn", fqn)  # as MetadataIndex sets it
            offset = index.offset
            if offset is not None:
                shared = sizes.get(offset)
                if shared is not None and shared is not offset:
                    object.__setattr__(index, "offset", shared)  # as MetadataIndex sets it
            if type(info) is RecordedStorageInfo:
                record = info.record
                info = _plain_info(info)
                if record is not None and offset is not None:
                    table = tables.get(index.fqn)
                    if table is None:
                        table = tables[index.fqn] = {}
                    point = points.get(offset)
                    if point is None:
                        point = points[offset] = tuple(offset)
                    table[point] = (int(record[0]), int(record[1]))
            storage[index] = info
    return storage, tables


#: building ``_StorageInfo`` from its instance dict is exact only for a dataclass with one
_FAST_INFO = not hasattr(_StorageInfo, "__slots__") and [f.name for f in fields(_StorageInfo)] == [
    "relative_path",
    "offset",
    "length",
    "transform_descriptors",
]


def _plain_info(info: RecordedStorageInfo) -> _StorageInfo:
    """DCP's ``_StorageInfo`` of ``info`` (:func:`~cloudckpt.formats.dcp.ranges.
    plain_info`), its instance dict as the constructor makes it, without calling it."""
    if not _FAST_INFO:
        return plain_info(info)  # type: ignore[no-any-return]
    plain = object.__new__(_StorageInfo)
    plain.__dict__.update(
        relative_path=info.relative_path,
        offset=info.offset,
        length=info.length,
        transform_descriptors=info.transform_descriptors,
    )
    return plain


def merge_metadata(parts: list[Metadata]) -> Metadata:
    """One ``Metadata`` describing the items of several DCP saves into one checkpoint
    (their keys must be distinct)."""
    merged = parts[0]
    for part in parts[1:]:
        clash = set(merged.state_dict_metadata) & set(part.state_dict_metadata)
        if clash:
            raise CheckpointingException(f"keys saved twice: {sorted(clash)[:10]}")
        merged.state_dict_metadata.update(part.state_dict_metadata)
        merged.storage_data = {**(merged.storage_data or {}), **(part.storage_data or {})}
        extra = getattr(part, "mcore_data", None)
        if extra:
            merged.mcore_data = {**getattr(merged, "mcore_data", {}), **extra}  # type: ignore[attr-defined]
    return merged
