"""Writes kept in host memory until :meth:`StagingStorage.upload` sends them: the
blocking half of an async save (``save(..., async_sharded_save=True)``).

A :class:`StagingStorage` is the same checkpoint location as the storage it wraps
(reads, listings and create-only writes go straight to the store), except that plain
writes copy their bytes into host memory and return the size and CRC-32C of those
bytes at once. The strategies therefore run unchanged, collectives included, in the
caller's thread; the copy frees the caller to modify its tensors; and
:meth:`~StagingStorage.upload` (run later, e.g. in a background thread) writes exactly
the staged bytes, so the write results recorded for the manifest stay true.

A torch_dist async save stages its tensors otherwise: as host copies that the request
serializes in the background (``TorchDistSaveShardedStrategy.stage_to``); what comes
here then is the common state (and the objects of strategies without ``stage_to``).

Only buffers the caller may change are copied: ``bytes`` are immutable, and a writer
that serialized its objects into buffers of its own (the torch_dist writer's
``torch.save`` output) hands them over with ``write_many(..., owned=True)``. Staging
then holds the state once, and costs one serialization, not a serialization and a
copy.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable

from cloudckpt.storage.buffers import Buffer, as_bytes_view, crc32c
from cloudckpt.storage.checkpoint import CheckpointStorage
from cloudckpt.storage.types import WriteResult


class StagingStorage(CheckpointStorage):
    """``storage`` with its plain writes staged in host memory (see the module docstring).

    Build one with :meth:`over`; :attr:`staged_bytes` says how much memory it holds.
    """

    _target: CheckpointStorage
    _staged: builtins.list[tuple[str, memoryview]]

    @classmethod
    def over(cls, storage: CheckpointStorage) -> StagingStorage:
        """A staging view of ``storage`` (same filesystem, root, request pool, checks)."""
        staging = cls.__new__(cls)
        staging.__dict__.update(storage.__dict__)
        staging._target = storage
        staging._staged = []
        return staging

    @property
    def staged_bytes(self) -> int:
        """Bytes held for upload."""
        return sum(view.nbytes for _, view in self._staged)

    @property
    def writes_in_place(self) -> bool:
        """Never: every plain write is staged in memory."""
        return False

    @property
    def streams_uploads(self) -> bool:
        """Never: every plain write is staged in memory."""
        return False

    def write(self, relpath: str, data: Buffer, *, exclusive: bool = False) -> WriteResult:
        """Stage ``data`` (a copy); a create-only write goes to the store at once."""
        if exclusive:
            return self._target.write(relpath, data, exclusive=True)
        return self.write_many([(relpath, data)])[0]

    def write_many(
        self, items: Iterable[tuple[str, Buffer]], *, owned: bool = False
    ) -> builtins.list[WriteResult]:
        """Stage every object (a copy, unless ``owned`` or ``bytes``: see the module
        docstring); results as the upload will produce them."""
        results = []
        for relpath, data in items:
            kept = data if owned or isinstance(data, bytes) else bytes(as_bytes_view(data))
            view = as_bytes_view(kept)
            self._staged.append((relpath, view))
            results.append(WriteResult(relpath, view.nbytes, crc32c(view)))
        return results

    def upload(self) -> builtins.list[WriteResult]:
        """Write every staged object to the store (concurrently) and release the copies.

        Raises:
            StorageError: as :meth:`CheckpointStorage.write_many`.
        """
        staged, self._staged = self._staged, []
        return self._target.write_many(staged)
