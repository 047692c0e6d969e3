"""Objects written front to back straight into their files (local disks).

A serializer that produces an object in order (``torch.save`` of one item after
another) can write it through an :class:`ObjectStream` instead of assembling it in
memory first: each large piece goes from the caller's memory (a tensor's storage) to
the file with one ``write()``, and is checksummed on the way (size, CRC-32C and block
CRC-32Cs, the same :class:`~cloudckpt.storage.types.WriteResult` a whole-object write
returns); small pieces (zip headers) are gathered into one write. So an object costs
one copy of its bytes, as a ``torch.save`` to a file does, instead of a copy into a
buffer and a second into the file.

Only stores whose transport ``writes_in_place`` (local files) open streams. The file
is the object itself, written in place like a whole-object write of that store: the
commit protocol does not depend on how data objects appear (the claim came first, and
the manifest, written create-only after every rank's data, records their sizes and
CRCs), and a stream that fails or is abandoned removes its file.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable
from typing import IO

from cloudckpt.storage.blocks import BlockChecksummer
from cloudckpt.storage.buffers import Buffer, as_bytes_view
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.pool import AdaptiveLimit
from cloudckpt.storage.types import WriteResult

logger = logging.getLogger(__name__)

SMALL_WRITE = 64 * 1024
"""Pieces smaller than this are gathered (copied) and written together, up to
:data:`GATHER_LIMIT` bytes; larger ones are written from the caller's memory."""

GATHER_LIMIT = 1024 * 1024


class ObjectStream(io.RawIOBase):
    """One object being written front to back (open one with
    :meth:`CheckpointStorage.open_stream <cloudckpt.storage.CheckpointStorage.open_stream>`).

    ``write`` / ``tell`` as a file (``torch.save`` writes into it); :meth:`finish`
    closes it and returns what was written; :meth:`abort` closes it and removes the
    file. Errors of the file are raised as ``StorageError`` naming the object.
    """

    def __init__(
        self,
        relpath: str,
        uri: str,
        file: IO[bytes],
        slots: AdaptiveLimit,
        remove: Callable[[], None],
    ) -> None:
        super().__init__()
        self.relpath = relpath
        self._uri = uri
        self._file = file
        self._slots = slots
        self._remove = remove
        self._checksum = BlockChecksummer()
        self._gathered = bytearray()
        self._result: WriteResult | None = None
        self._aborted = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._checksum.size + len(self._gathered)

    def write(self, data: Buffer) -> int:  # type: ignore[override]
        view = as_bytes_view(data)
        nbytes = view.nbytes
        if nbytes < SMALL_WRITE:
            self._gathered += view
            if len(self._gathered) >= GATHER_LIMIT:
                self._flush_gathered()
            return nbytes
        self._flush_gathered()
        self._put(view)
        return nbytes

    def _flush_gathered(self) -> None:
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._put(memoryview(gathered))

    def _put(self, view: memoryview) -> None:
        """Checksum ``view`` and write all of it to the file."""
        self._checksum.update(view)
        try:
            with self._slots:
                while view.nbytes:
                    written = self._file.write(view)
                    if not written:
                        raise OSError(f"no bytes written to {self._uri}")
                    view = view[written:]
        except io_errors() as exc:
            raise translate(exc, f"failed to write {self._uri}: {exc}") from exc

    def finish(self) -> WriteResult:
        """Write what is gathered, close the file; the object's size and checksums."""
        if self._result is not None:
            return self._result
        if self._aborted:
            raise ValueError(f"{self._uri}: the stream was aborted")
        try:
            self._flush_gathered()
            try:
                self._file.close()
            except io_errors() as exc:
                raise translate(exc, f"failed to write {self._uri}: {exc}") from exc
        except BaseException:
            self.abort()
            raise
        crc, blocks = self._checksum.result()
        self._result = WriteResult(self.relpath, self._checksum.size, crc, blocks)
        self.close()
        return self._result

    def abort(self) -> None:
        """Close the file and remove it (a failed or abandoned object; errors logged)."""
        if self._result is not None or self._aborted:
            return
        self._aborted = True
        self._gathered = bytearray()
        with contextlib.suppress(OSError):
            self._file.close()
        try:
            self._remove()
        except OSError as exc:
            logger.warning("could not remove the unfinished %s: %s", self._uri, exc)
        self.close()


__all__ = ["GATHER_LIMIT", "SMALL_WRITE", "ObjectStream"]
