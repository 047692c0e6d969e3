"""A DCP checkpoint's stored items: ``.metadata`` (:data:`METADATA_FNAME`) records
where each item lies in its ``.distcp`` object (:func:`item_request` turns that into a
ranged read), and an item's bytes decode as a tensor (``torch.save`` bytes,
:func:`load_tensor_item`) or as an object as Megatron-Core writes it
(:func:`load_object_item`)."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    MalformedCheckpointError,
)
from cloudckpt.formats.dcp.metadata_check import check_storage_info
from cloudckpt.safe_pickle import load_torch_pickle
from cloudckpt.storage import CheckpointStorage, ReadRequest

METADATA_FNAME = ".metadata"


def item_request(
    storage: CheckpointStorage, metadata: Metadata, index: MetadataIndex
) -> ReadRequest:
    """The ranged read of one stored item."""
    info = (metadata.storage_data or {}).get(index)
    if not isinstance(info, _StorageInfo):
        raise CheckpointNotFoundError(
            f"checkpoint {storage.uri!r}: no stored item for {index.fqn!r} at offset "
            f"{tuple(index.offset) if index.offset is not None else None}"
        )
    check_storage_info(index.fqn, info, storage.child_uri(METADATA_FNAME))
    if info.transform_descriptors:
        raise CheckpointingException(
            f"checkpoint {storage.uri!r}: item {index.fqn!r} uses DCP stream transforms "
            f"{list(info.transform_descriptors)}, which cloudckpt does not read"
        )
    return ReadRequest(info.relative_path, info.offset, info.offset + info.length)


def load_tensor_item(raw: bytes, where: str) -> torch.Tensor:
    """Decode a tensor item (``torch.save`` bytes, tensors only)."""
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointingException(f"{where}: cannot decode the tensor item: {exc}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointingException(f"{where}: item holds a {type(tensor).__name__}")
    return tensor


def load_object_item(
    raw: bytes, where: str, weights_only: bool | None = None, what: str = "sharded object"
) -> Any:
    """Decode a bytes item as Megatron-Core writes it, ``torch.save([data])``: the
    one-element list is unwrapped (a ``BytesIO`` inside is decoded too). Restricted
    unless trusted (:func:`cloudckpt.safe_pickle.load_torch_pickle`); ``where`` and
    ``what`` name the item in an error (:class:`MalformedCheckpointError` for bytes
    that do not decode: a ``.metadata`` whose item range is wrong, say)."""
    try:
        value = load_torch_pickle(raw, where, what, weights_only)
        if isinstance(value, io.BytesIO):
            value = load_torch_pickle(value.getvalue(), where, what, weights_only)
    except CheckpointingException:
        raise
    except Exception as exc:  # what a damaged pickle raises is open-ended
        raise MalformedCheckpointError(f"{where}: cannot decode the {what}: {exc!r}") from exc
    if isinstance(value, list) and value:
        value = value[0]
    return value
