"""Reads of a checkpoint's objects: whole or ranged, into new bytes or straight into
tensor memory, concurrent within the process's request pool, checked against the
manifest (:mod:`.checked`)."""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage.buffers import Buffer, Progress, as_bytes_view, crc32c, plan_parts
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.handle import StorageHandle
from cloudckpt.storage.types import ReadRequest, WriteResult


class StorageReads(StorageHandle):
    """The read half of :class:`~cloudckpt.storage.CheckpointStorage`."""

    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        """Read a whole object or the byte range ``[start, end)`` of it.

        Objects the manifest lists are checked: whole reads against size and CRC-32C,
        ranges against the size (and, with ``verify_checksums``, the object is read whole
        and checked).

        Raises:
            CheckpointNotFoundError: the object does not exist.
            CorruptObjectError: size or CRC-32C differ from the manifest's.
            StorageError: any other failure of the store.
        """
        size = self.expected.size(relpath)
        if size is None:
            return self._read(relpath, start, end)
        if start == 0 and end is None:
            data = self._read(relpath)
            self.expected.check_whole(relpath, memoryview(data))
            return data
        self.expected.check_range(relpath, start, size if end is None else end)
        if self.expected.verify_checksums:
            return self.read(relpath)[start:end]
        return self._read(relpath, start, end)

    def _read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        path = self.full_path(relpath)
        if end is not None and end <= start:
            # an empty range; some filesystems (s3fs) read the whole object for it
            if self.fs.isfile(path):
                return b""
            raise self.expected.not_found(relpath)
        try:
            return self.transport.fetch(path, start, end)
        except FileNotFoundError as exc:
            raise self.expected.not_found(relpath) from exc
        except io_errors() as exc:
            if start and end is None and 0 <= self._size(path) <= start:
                return b""  # reading from the end: S3 answers 416 where files give b""
            raise translate(exc, f"failed to read {self.child_uri(relpath)}: {exc}") from exc

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(path))
        except io_errors():  # only a hint for the caller's error path
            return -1

    def read_into(self, relpath: str, out: Buffer, start: int = 0) -> None:
        """Fill ``out`` with the bytes of ``relpath`` starting at ``start``.

        Local files are read straight into ``out`` (no intermediate copy); other
        filesystems fetch the range and copy it once. Buffers larger than
        ``part_size`` are fetched as concurrent ranged GETs.
        """
        self.read_into_many([(ReadRequest(relpath, start), out)])

    def read_into_many(self, items: Sequence[tuple[ReadRequest, Buffer]]) -> None:
        """:meth:`read_into` for many (request, buffer) pairs, concurrently.

        Objects the manifest lists are checked: a buffer covering the whole object
        against size and CRC-32C, a partial one against the size (and, with
        ``verify_checksums``, against the CRC-32C of the whole object, read in full).
        """
        views = [(request, as_bytes_view(buffer)) for request, buffer in items]
        checked = [(r, v) for r, v in views if self.expected.needs_whole_read(r, v.nbytes)]
        direct = [(r, v) for r, v in views if not self.expected.needs_whole_read(r, v.nbytes)]
        for request, view in direct:
            self.expected.check_range(request.path, request.start, request.start + view.nbytes)
        ranges = [
            (request.path, request.start + a, view[a:b])
            for request, view in direct
            for a, b in self.transport.read_ranges(view.nbytes)
        ]
        progress = Progress("read", self.uri, sum(v.nbytes for _, _, v in ranges), len(items))
        self.pool.map(lambda r: self._read_range_into(r[0], r[2], r[1], progress), ranges)
        for request, view in direct:
            if self.expected.is_whole(request, view.nbytes):
                self.expected.check_whole(request.path, view)
        by_object: dict[str, builtins.list[tuple[ReadRequest, memoryview]]] = {}
        for request, view in checked:
            by_object.setdefault(request.path, []).append((request, view))
        self.pool.map(lambda path: self._read_whole_into(by_object[path]), builtins.list(by_object))
        progress.finish()

    def _read_whole_into(self, requests: builtins.list[tuple[ReadRequest, memoryview]]) -> None:
        """Read one object whole (checked against the manifest) once and fill every
        buffer that needs a part of it."""
        for request, view in requests:
            self.expected.check_range(request.path, request.start, request.start + view.nbytes)
        data = memoryview(self.read(requests[0][0].path))
        for request, view in requests:
            view[:] = data[request.start : request.start + view.nbytes]

    def _read_range_into(
        self, relpath: str, out: memoryview, start: int, progress: Progress
    ) -> None:
        if out.nbytes == 0:  # no GET: servers refuse empty ranges (416)
            self.read(relpath, start, start)
            return
        try:
            got = self.transport.fetch_into(self.full_path(relpath), out, start)
        except FileNotFoundError as exc:
            raise self.expected.not_found(relpath) from exc
        except io_errors() as exc:
            raise translate(exc, f"failed to read {self.child_uri(relpath)}: {exc}") from exc
        if got != out.nbytes:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: read {got} bytes at offset {start}, expected "
                f"{out.nbytes}; the object is truncated"
            )
        progress.add(got)

    def read_many(self, requests: Sequence[ReadRequest]) -> builtins.list[bytes]:
        """Read several objects or ranges concurrently; results follow ``requests``."""
        progress = Progress("read", self.uri, 0, len(requests))

        def read(request: ReadRequest) -> bytes:
            data = self.read(request.path, request.start, request.end)
            progress.add(len(data))
            return data

        results: builtins.list[bytes] = self.pool.map(read, requests)
        progress.finish()
        return results

    def checksum(self, relpath: str, size: int) -> WriteResult:
        """Size and CRC-32C of an object of ``size`` bytes, read in ``part_size`` ranges
        (so memory stays at one part per call however large the object)."""
        crc, done = 0, 0
        for start, end in plan_parts(size, self.part_size):
            if end > start:
                data = self._read(relpath, start, end)
                crc = crc32c(data, crc)
                done += len(data)
        return WriteResult(relpath, done, crc)
