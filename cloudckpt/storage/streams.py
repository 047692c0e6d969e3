"""Objects written front to back straight into their files (local disks) or into
multipart uploads (S3: :class:`UploadStream`).

A serializer that produces an object in order (``torch.save`` of one item after
another) can write it through an :class:`ObjectStream` instead of assembling it in
memory first: each large piece goes from the caller's memory (a tensor's storage) to
the file with one ``write()``, and is checksummed on the way (size, CRC-32C and block
CRC-32Cs, the same :class:`~cloudckpt.storage.types.WriteResult` a whole-object write
returns); small pieces (zip headers) are gathered into one write. So an object costs
one copy of its bytes, as a ``torch.save`` to a file does, instead of a copy into a
buffer and a second into the file.

Stores whose transport ``writes_in_place`` (local files) open an :class:`ObjectStream`;
S3 opens an :class:`UploadStream`, whose parts go up while the object is written and
which sends a synchronous save's tensors from their own memory. The file
is the object itself, written in place like a whole-object write of that store: the
commit protocol does not depend on how data objects appear (the claim came first, and
the manifest, written create-only after every rank's data, records their sizes and
CRCs), and a stream that fails or is abandoned removes its file.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from typing import IO, Any, Protocol

from cloudckpt.config import S3_MAX_PART_SIZE, S3_MAX_PARTS
from cloudckpt.storage.blocks import (
    BLOCK_SIZE,
    BlockChecksummer,
    PartChecksum,
    block_size_for,
    join_parts,
    segments_checksum,
)
from cloudckpt.storage.buffers import Buffer, Progress, as_bytes_view
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.pool import AdaptiveLimit, Cancelled, guarded
from cloudckpt.storage.types import WriteResult

logger = logging.getLogger(__name__)

SMALL_WRITE = 64 * 1024
"""Pieces smaller than this are gathered (copied) and written together, up to
:data:`GATHER_LIMIT` bytes; larger ones are written from the caller's memory."""

GATHER_LIMIT = 1024 * 1024


def stream_part_size(part_size: int, size_hint: int | None, max_parts: int, block_size: int) -> int:
    """The part size of a streamed upload of about ``size_hint`` bytes (None: unknown):
    ``part_size``, grown (in whole ``block_size`` blocks, so every part's blocks stay
    whole) until ``size_hint`` fits in ``max_parts`` parts, S3's limit per upload."""
    if size_hint is None or size_hint <= part_size * max_parts:
        return part_size
    per_part = -(-size_hint // max_parts)
    return -(-per_part // block_size) * block_size


def _parts_before_growth(part_size: int, size_hint: int | None, max_parts: int) -> int:
    """How many parts a stream sends before its part size starts doubling: those its
    ``size_hint`` needs (at most three quarters of ``max_parts``), half without one."""
    if size_hint is None:
        return max(1, max_parts // 2)
    needed = -(-size_hint // part_size)
    return max(1, max_parts // 2, min(needed, max_parts * 3 // 4))


def doubled_part_size(part_size: int, block_size: int, largest: int = S3_MAX_PART_SIZE) -> int:
    """``part_size`` doubled, at most ``largest`` (rounded down to whole blocks)."""
    cap = max(block_size, largest - largest % block_size)
    return max(part_size, min(2 * part_size, cap))


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
        progress: Progress | None = None,
    ) -> None:
        super().__init__()
        self.relpath = relpath
        self._progress = progress
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

    @contextlib.contextmanager
    def referencing(self, owner: object) -> Iterator[None]:
        """As :meth:`UploadStream.referencing`; nothing to do: each write is done when
        it returns."""
        yield

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
        nbytes = view.nbytes
        try:
            with self._slots:
                while view.nbytes:
                    written = self._file.write(view)
                    if not written:
                        raise OSError(f"no bytes written to {self._uri}")
                    view = view[written:]
        except io_errors() as exc:
            raise translate(exc, f"failed to write {self._uri}: {exc}") from exc
        if self._progress is not None:
            self._progress.add(nbytes)

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


class PartSink(Protocol):
    """What an :class:`UploadStream` needs of its store (the S3 transport)."""

    def begin_upload(self, path: str, uri: str) -> str: ...

    def send_part(
        self,
        path: str,
        upload_id: str,
        number: int,
        body: Sequence[memoryview],
        checksum: PartChecksum,
        where: tuple[str, int],
    ) -> dict[str, Any]: ...

    def complete_upload(
        self, path: str, uri: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None: ...

    def abort_started(self, path: str, uri: str, upload_id: str) -> None: ...

    def put_pieces(self, path: str, pieces: Sequence[memoryview], checksum: int) -> None: ...


class UploadStream(io.RawIOBase):
    """One object written front to back into a multipart upload (object stores), its
    parts going up while the next bytes are written: the interface of
    :class:`ObjectStream` (``write``, ``tell``, :meth:`finish`, :meth:`abort`).

    Small writes are gathered (copied) into pieces; large ones are copied too, except
    inside :meth:`referencing`, where the caller promises that the memory stays alive
    and unchanged until :meth:`finish` returns (a tensor of a synchronous save): then
    a part's body is a list of pieces of the caller's memory, sent from there, and the
    object costs no copy of those bytes. Parts are exactly ``part_size`` bytes (the
    last may be shorter), so that their block CRCs are whole; an object no larger than
    one part is one PUT. At most ``max_queued`` parts wait or run at once: pieces that
    reference the caller's memory cost nothing, gathered ones at most a part each.
    Errors name the object (and part); :meth:`abort` aborts the upload.

    An upload never needs more than ``max_parts`` parts (S3's 10,000): with the
    object's ``size_hint``, the part size grows (whole blocks) so that it fits; past
    the parts its hint needs (at most three quarters of the limit; half without a
    hint), the part size doubles every ``max_parts // 20`` parts (up to S3's 5 GiB),
    which fits hundreds of thousands of ``part_size`` parts: an object larger than
    its hint still fits.
    """

    def __init__(
        self,
        relpath: str,
        uri: str,
        path: str,
        sink: PartSink,
        executor: AbstractContextManager[ThreadPoolExecutor],
        part_size: int,
        max_queued: int,
        progress: Progress | None = None,
        *,
        size_hint: int | None = None,
        max_parts: int = S3_MAX_PARTS,
    ) -> None:
        super().__init__()
        self.relpath, self._uri, self._path = relpath, uri, path
        self._progress = progress
        self._sink = sink
        self._block_size = block_size_for(part_size)
        self._part_size = stream_part_size(part_size, size_hint, max_parts, self._block_size)
        self._grow_at = _parts_before_growth(self._part_size, size_hint, max_parts)
        self._grow_every = max(1, max_parts // 20)
        self._next_start = 0  # where the next part starts in the object
        self._lease = executor
        self._executor = executor.__enter__()
        self._max_queued = max(1, max_queued)
        self._pending: list[memoryview] = []  # the pieces of the part being filled
        self._pending_bytes = 0
        self._gathered = bytearray()
        self._by_reference = False
        self._kept: list[object] = []  # owners of referenced memory
        self._upload_id: str | None = None
        self._futures: list[Future[tuple[dict[str, Any], PartChecksum]]] = []
        self._cancel = threading.Event()
        self._size = 0
        self._result: WriteResult | None = None
        self._ended = False

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    @contextlib.contextmanager
    def referencing(self, owner: object) -> Iterator[None]:
        """Within the block, large writes are sent from the caller's memory, which
        ``owner`` holds (kept until the stream ends; see the class docstring)."""
        self._kept.append(owner)
        self._by_reference = True
        try:
            yield
        finally:
            self._by_reference = False

    def write(self, data: Buffer) -> int:  # type: ignore[override]
        view = as_bytes_view(data)
        nbytes = view.nbytes
        if self._ended:
            raise ValueError(f"{self._uri}: the stream has ended")
        self._size += nbytes
        if nbytes < SMALL_WRITE or not self._by_reference:
            self._gathered += view
            if len(self._gathered) >= GATHER_LIMIT:
                self._flush_gathered()
            return nbytes
        self._flush_gathered()
        self._add(view)
        return nbytes

    def _flush_gathered(self) -> None:
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._add(memoryview(gathered))

    def _add(self, view: memoryview) -> None:
        self._pending.append(view)
        self._pending_bytes += view.nbytes
        while self._pending_bytes >= self._part_size:
            self._submit(self._take(self._part_size))

    def _take(self, nbytes: int) -> list[memoryview]:
        """The first ``nbytes`` of the pending pieces (a piece cut where needed)."""
        taken: list[memoryview] = []
        while nbytes:
            piece = self._pending[0]
            if piece.nbytes <= nbytes:
                taken.append(self._pending.pop(0))
            else:
                taken.append(piece[:nbytes])
                self._pending[0] = piece[nbytes:]
            nbytes -= taken[-1].nbytes
            self._pending_bytes -= taken[-1].nbytes
        return taken

    def _submit(self, pieces: list[memoryview]) -> None:
        if self._upload_id is None:
            self._upload_id = self._sink.begin_upload(self._path, self._uri)
        self._settle(self._max_queued - 1)
        number = len(self._futures) + 1
        start = self._next_start
        self._next_start += sum(piece.nbytes for piece in pieces)
        if number >= self._grow_at:  # the object outgrew its part budget: larger parts
            self._part_size = doubled_part_size(self._part_size, self._block_size)
            self._grow_at += self._grow_every
        self._futures.append(
            self._executor.submit(guarded, self._cancel, self._send, number, pieces, start)
        )

    def _send(
        self, number: int, pieces: list[memoryview], start: int
    ) -> tuple[dict[str, Any], PartChecksum]:
        checksum = segments_checksum(pieces, self._block_size)  # once: every attempt sends it
        where = (self._uri, start)
        sent = self._sink.send_part(
            self._path, str(self._upload_id), number, pieces, checksum, where
        )
        if self._progress is not None:
            self._progress.add(checksum.length)
        return sent, checksum

    def _settle(self, queued: int) -> None:
        """Wait until at most ``queued`` parts are unfinished; raise the first error."""
        while True:
            running = [f for f in self._futures if not f.done()]
            errors = [f.exception() for f in self._futures if f.done()]
            failed = next((e for e in errors if e and not isinstance(e, Cancelled)), None)
            if failed is not None:
                raise failed
            if len(running) <= queued:
                return
            wait(running, return_when=FIRST_COMPLETED)

    def finish(self) -> WriteResult:
        """Send what is left, complete the upload; the object's size and checksums."""
        if self._result is not None:
            return self._result
        if self._ended:
            raise ValueError(f"{self._uri}: the stream was aborted")
        try:
            self._flush_gathered()
            if self._upload_id is None:
                result = self._put_whole()
            else:
                if self._pending_bytes:
                    self._submit(self._take(self._pending_bytes))
                result = self._complete()
        except BaseException:
            self.abort()
            raise
        self._end()
        self._result = result
        return result

    def _put_whole(self) -> WriteResult:
        pieces, self._pending, self._pending_bytes = self._pending, [], 0
        checksum = segments_checksum(pieces, BLOCK_SIZE)
        crc, blocks = join_parts([checksum], BLOCK_SIZE)
        try:
            self._sink.put_pieces(self._path, pieces, crc)
        except io_errors() as exc:
            raise translate(exc, f"failed to write {self._uri}: {exc}") from exc
        if self._progress is not None:
            self._progress.add(self._size)
        return WriteResult(self.relpath, self._size, crc, blocks)

    def _complete(self) -> WriteResult:
        self._settle(0)
        done = [future.result() for future in self._futures]
        parts = [sent for sent, _ in done]
        self._sink.complete_upload(self._path, self._uri, str(self._upload_id), parts, self._size)
        crc, blocks = join_parts([checksum for _, checksum in done], self._block_size)
        return WriteResult(self.relpath, self._size, crc, blocks)

    def abort(self) -> None:
        """Stop the parts, abort the upload (a failure is logged); a no-op once ended."""
        if self._ended:
            return
        self._cancel.set()
        self._end()
        if self._upload_id is not None:
            self._sink.abort_started(self._path, self._uri, self._upload_id)

    def _end(self) -> None:
        """Wait for the parts in flight, give the threads back, drop the references."""
        self._ended = True
        self._lease.__exit__(None, None, None)
        self._pending, self._gathered, self._kept = [], bytearray(), []
        self.close()


__all__ = [
    "GATHER_LIMIT",
    "SMALL_WRITE",
    "ObjectStream",
    "PartSink",
    "UploadStream",
    "doubled_part_size",
    "stream_part_size",
]
