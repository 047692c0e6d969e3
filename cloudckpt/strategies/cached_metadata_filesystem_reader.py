"""A DCP storage reader that reads a checkpoint's ``.metadata`` once per process
(Megatron-Core 0.19's ``strategies.cached_metadata_filesystem_reader``).

:class:`CachedMetadataFileSystemReader` is cloudckpt's
:class:`~cloudckpt.dcp.CloudStorageReader` (any URI, reads checked against the
manifest) with ``.metadata`` kept in the process-wide cache that
``TorchDistLoadShardedStrategy(cache_metadata=True)`` uses too
(:mod:`cloudckpt.formats.dcp.metadata_cache`: the last checkpoint's, reused only for the
same checkpoint). :meth:`~CachedMetadataFileSystemReader.clear_metadata_cache` empties
it; Megatron-LM's training loop calls it when it resets its async worker.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.dcp import CloudStorageReader
from cloudckpt.formats.dcp import metadata_cache
from cloudckpt.storage import CheckpointStorage


class CachedMetadataFileSystemReader(CloudStorageReader):
    """``CloudStorageReader`` whose ``.metadata`` is read once per process.

    Args:
        path: the checkpoint (a URI or a local path).
        cache_metadata: False reads ``.metadata`` at every load, as the plain reader.
        **kwargs: :class:`~cloudckpt.dcp.CloudStorageReader`'s (``storage_options``,
            ``config``, ``verify_checksums``).
    """

    def __init__(
        self, path: str | os.PathLike[str], cache_metadata: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(path, **kwargs)
        self.cache_metadata = cache_metadata

    def _metadata_of(self, storage: CheckpointStorage) -> Metadata:
        if not self.cache_metadata:
            return super()._metadata_of(storage)
        key = metadata_cache.cache_key(storage, True)  # this reader unpickles restricted
        metadata = metadata_cache.cached(key)
        if metadata is None:
            metadata = super()._metadata_of(storage)
            metadata_cache.remember(key, metadata)
        return metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget the cached ``.metadata`` (of this reader and of the load strategy)."""
        metadata_cache.clear()


__all__ = ["CachedMetadataFileSystemReader"]
