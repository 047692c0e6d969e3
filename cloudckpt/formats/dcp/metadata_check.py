"""The fields of a DCP ``.metadata`` checked for their types before the reader uses
them (pure, no I/O).

The restricted unpickler (:mod:`cloudckpt.formats.dcp.unpickler`) admits only DCP's
metadata classes, but their fields can hold anything a pickle can: a ``.metadata``
whose ``state_dict_metadata`` is None, or a chunk's offsets a dict, would otherwise
fail deep in the reader with a raw ``TypeError`` or ``AttributeError``. Each check
raises :class:`~cloudckpt.errors.MalformedCheckpointError` naming the file and the
field instead.

The checks cost what the reader spends on the same fields anyway: the top level once
per ``.metadata`` (:func:`check_top`), a tensor's entry and chunks when the reader
first looks that key up (:func:`check_tensor`), an item's storage record when its
read is planned (:func:`check_storage_info`). A checkpoint of millions of chunks is
not walked as a whole to load a few keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import add, le
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from cloudckpt.errors import MalformedCheckpointError


def _malformed(where: str, field: str, value: Any, expected: str) -> MalformedCheckpointError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return MalformedCheckpointError(
        f"{where}: field {field} is {shown} ({type(value).__name__}), not {expected}"
    )


def check_top(metadata: Metadata, where: str) -> None:
    """``state_dict_metadata`` a dict of str keys to DCP storage metadata,
    ``storage_data`` a dict (or None), ``mcore_data`` a dict of dicts (or None)."""
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise _malformed(where, "state_dict_metadata", entries, "a dict")
    for key, md in entries.items():
        if not isinstance(key, str):
            raise _malformed(where, "state_dict_metadata's key", key, "a str")
        if not isinstance(md, TensorStorageMetadata | BytesStorageMetadata):
            raise _malformed(
                where, f"state_dict_metadata[{key!r}]", md, "Tensor- or BytesStorageMetadata"
            )
    storage_data = metadata.storage_data
    if storage_data is not None and not isinstance(storage_data, dict):
        raise _malformed(where, "storage_data", storage_data, "a dict")
    extra = getattr(metadata, "mcore_data", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise _malformed(where, "mcore_data", extra, "a dict")
        for key, value in extra.items():
            if not isinstance(value, dict):
                raise _malformed(where, f"mcore_data[{key!r}]", value, "a dict")


def _shape(where: str, field: str, value: Any, ndim: int | None = None) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (of ``ndim`` of them)."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise _malformed(where, field, value, "a sequence of non-negative ints")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value):
        raise _malformed(where, field, value, "a sequence of non-negative ints")
    if ndim is not None and len(value) != ndim:
        raise _malformed(where, field, value, f"{ndim} ints (the tensor's dimensions)")
    return tuple(value)


def check_tensor(key: str, md: TensorStorageMetadata, where: str) -> None:
    """A tensor's dtype, global size and chunks: each chunk's offsets and sizes as many
    non-negative ints as the size has dimensions, and inside it. About 0.9 us per chunk
    where they are ``torch.Size`` (as DCP and cloudckpt write them; 1.5x the reader's
    own pass over a key's chunks), the precise checks only for a chunk that fails."""
    field = f"state_dict_metadata[{key!r}]"
    properties = md.properties
    if not isinstance(properties, TensorProperties):
        raise _malformed(where, f"{field}.properties", properties, "TensorProperties")
    if not isinstance(properties.dtype, torch.dtype):
        raise _malformed(where, f"{field}.properties.dtype", properties.dtype, "a torch.dtype")
    size = _shape(where, f"{field}.size", md.size)
    chunks = md.chunks
    if not isinstance(chunks, list):
        raise _malformed(where, f"{field}.chunks", chunks, "a list")
    ndim = len(size)
    for i, chunk in enumerate(chunks):
        if type(chunk) is ChunkStorageMetadata:
            offsets, sizes = chunk.offsets, chunk.sizes
            if (
                type(offsets) is torch.Size  # its items are ints
                and type(sizes) is torch.Size
                and len(offsets) == ndim
                and len(sizes) == ndim
                and (not ndim or (min(offsets) >= 0 and min(sizes) >= 0))
                and all(map(le, map(add, offsets, sizes), size))
            ):
                continue
        _check_chunk(f"{field}.chunks[{i}]", chunk, size, where)  # raises: which field


def _check_chunk(at: str, chunk: Any, size: tuple[int, ...], where: str) -> None:
    if not isinstance(chunk, ChunkStorageMetadata):
        raise _malformed(where, at, chunk, "ChunkStorageMetadata")
    offsets = _shape(where, f"{at}.offsets", chunk.offsets, len(size))
    sizes = _shape(where, f"{at}.sizes", chunk.sizes, len(size))
    if any(o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)):
        raise MalformedCheckpointError(
            f"{where}: {at} (offsets {offsets}, sizes {sizes}) lies outside the "
            f"tensor's size {size}"
        )


def check_orig_shape(key: str, value: Any, where: str) -> tuple[int, ...]:
    """The original global shape an N-D flattened tensor records in ``mcore_data``."""
    return _shape(where, f"mcore_data[{key!r}]'s original shape", value)


def check_storage_info(fqn: str, info: Any, where: str) -> None:
    """An item's storage record: a relative path (str), offset and length (ints >= 0)."""
    field = f"storage_data[{fqn!r}]"
    path = getattr(info, "relative_path", None)
    if not isinstance(path, str) or not path:
        raise _malformed(where, f"{field}.relative_path", path, "a non-empty str")
    for name in ("offset", "length"):
        value = getattr(info, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _malformed(where, f"{field}.{name}", value, "a non-negative int")
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and not isinstance(descriptors, Sequence):
        raise _malformed(where, f"{field}.transform_descriptors", descriptors, "a sequence")
