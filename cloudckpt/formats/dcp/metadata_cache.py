"""The process-wide cache of one DCP ``.metadata`` (Megatron-Core 0.19's
``cache_metadata``): a training job that loads the same checkpoint again, with a new
load strategy or reader each time, unpickles its ``.metadata`` once.

A cached ``.metadata`` is reused only for the same checkpoint: the same URI, the same
manifest CRC-32C of ``.metadata`` (so a checkpoint saved again at that URI is read
afresh; Megatron-Core's checkpoints have no manifest and are told apart by URI only, as
Megatron-Core's cache does) and the same unpickling (metadata trusted once is not reused
by a restricted load). Only the last checkpoint's is kept.
"""

from __future__ import annotations

import threading

from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.safe_pickle import resolve_weights_only
from cloudckpt.storage import CheckpointStorage

CacheKey = tuple[str, int | None, bool]

_lock = threading.Lock()
_last: tuple[CacheKey, Metadata] | None = None


def cache_key(storage: CheckpointStorage, weights_only: bool | None) -> CacheKey:
    """A checkpoint's ``.metadata`` identity: its URI, the manifest's CRC-32C of it (None
    without a manifest entry) and whether it is unpickled restricted."""
    entry = storage.expected.entries.get(METADATA_FNAME)
    return storage.uri, None if entry is None else entry.crc32c, resolve_weights_only(weights_only)


def cached(key: CacheKey) -> Metadata | None:
    """The ``.metadata`` cached under ``key``, or None."""
    with _lock:
        return _last[1] if _last is not None and _last[0] == key else None


def remember(key: CacheKey, metadata: Metadata) -> None:
    """Cache ``metadata`` under ``key`` (replacing the checkpoint cached before)."""
    global _last  # noqa: PLW0603 - one cache per process, as Megatron-Core's
    with _lock:
        _last = (key, metadata)


def clear() -> None:
    """Forget the cached ``.metadata``."""
    global _last  # noqa: PLW0603
    with _lock:
        _last = None
