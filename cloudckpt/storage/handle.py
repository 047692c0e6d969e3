"""What every part of :class:`~cloudckpt.storage.CheckpointStorage` works with: the
location, its transport, the process's request pool, the manifest's expectations."""

from __future__ import annotations

import fsspec

from cloudckpt.config import CheckpointConfig
from cloudckpt.storage.checked import Expected
from cloudckpt.storage.location import Location
from cloudckpt.storage.pool import RequestPool
from cloudckpt.storage.transport import Transport


class StorageHandle:
    """The state of one open checkpoint location (set by ``CheckpointStorage``)."""

    config: CheckpointConfig
    location: Location
    transport: Transport
    pool: RequestPool
    expected: Expected
    part_size: int
    max_in_flight: int
    uri: str
    root: str
    fs: fsspec.AbstractFileSystem

    def full_path(self, relpath: str) -> str:
        """Filesystem path of ``relpath`` (validated) below the root."""
        return self.location.full_path(relpath)

    def child_uri(self, relpath: str) -> str:
        """A human-readable URI of ``relpath`` for messages."""
        return self.location.child_uri(relpath)
