"""The storage layer: the only package of cloudckpt that talks to fsspec.

A checkpoint lives under one URI prefix (``/data/run/iter_10``, ``file:///...``,
``memory://run/iter_10``, ``s3://bucket/run/iter_10``, ``gs://...``: any fsspec
protocol). :class:`CheckpointStorage` binds such a URI to a filesystem and a root
path and offers the operations the strategies and the commit protocol need, on paths
*relative* to the checkpoint root: :meth:`~CheckpointStorage.write` /
:meth:`~CheckpointStorage.write_many` return a :class:`WriteResult` (path, size,
CRC-32C of the bytes that went out, and of each of their blocks); :meth:`~CheckpointStorage.read`,
:meth:`~CheckpointStorage.read_many` (byte ranges) and
:meth:`~CheckpointStorage.read_into_many` (straight into tensor memory);
:meth:`~CheckpointStorage.exists`, :meth:`~CheckpointStorage.list`,
:meth:`~CheckpointStorage.delete`.

**One knob for concurrency.** Every request (a whole-object PUT, one part of a
multipart upload, one ranged GET) holds one slot of the process's pool of
``max_in_flight`` (:mod:`.pool`).

**Streaming uploads.** Buffers are never copied by this layer. On S3 an object larger
than ``part_size`` goes up as a multipart upload whose parts are sent concurrently,
each straight from a slice of the tensor's memory, with its CRC-32C for the server to
verify; a failed upload is aborted (:mod:`.s3`). GCS objects go up as gcsfs resumable
uploads in ``part_size`` chunks (:mod:`.transport`).

Modules: :mod:`.location` (URI -> filesystem, root, kind; key validation),
:mod:`.transport` and :mod:`.s3` (one transport per kind of store), :mod:`.pool`
(requests in flight), :mod:`.checked` (manifest-checked reads), :mod:`.blocks` (block
CRCs: a CRC-32C per 1 MiB block, so ranged reads are checked too), :mod:`.edge` (error
translation), :mod:`.listing`, :mod:`.reads`, :mod:`.admin`, :mod:`.checkpoint` (the
facade), :mod:`.streams` (objects written front to back into local files),
:mod:`.scatter` (reads into many buffers in merged runs of blocks, checked in place; filled
by ranged GETs or from local files), :mod:`.buffers` (pure byte helpers), :mod:`.types`.
"""

from __future__ import annotations

import fsspec

from cloudckpt.storage.buffers import crc32c
from cloudckpt.storage.checkpoint import CheckpointStorage, open_checkpoint
from cloudckpt.storage.location import MissingDependencyError, validate_relpath
from cloudckpt.storage.types import OpenUpload, ReadRequest, WriteResult

FileSystem = fsspec.AbstractFileSystem
"""The filesystem type strategies accept (``fs=``); other modules never import fsspec."""

__all__ = [
    "CheckpointStorage",
    "FileSystem",
    "MissingDependencyError",
    "OpenUpload",
    "ReadRequest",
    "WriteResult",
    "crc32c",
    "open_checkpoint",
    "validate_relpath",
]
