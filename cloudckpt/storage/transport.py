"""How bytes move to and from one kind of store, chosen once per storage
(:func:`cloudckpt.storage.checkpoint.transport_for`): local disks (``O_EXCL`` creates,
reads straight into buffers), GCS (resumable uploads in part-size chunks, create-only
writes as simple uploads), any other fsspec filesystem, and S3 (:mod:`cloudckpt.storage.s3`).

Besides data, a transport lists, looks up and deletes objects (:meth:`Transport.list_objects`,
:meth:`~Transport.list_level`, :meth:`~Transport.is_file`, :meth:`~Transport.delete`,
:meth:`~Transport.bucket_exists`): :mod:`.listing` and :mod:`.admin` ask it, so these
requests run under the same bounds as the data requests of that store (S3: cloudckpt's
retries and deadlines; GCS: a deadline per call around gcsfs's own retries).

Transports raise the filesystem's own errors; :class:`CheckpointStorage` translates
them at its edge, naming the object.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, TypeVar, cast

import fsspec.exceptions

from cloudckpt.retry_policy import RetryPolicy
from cloudckpt.storage.buffers import plan_parts
from cloudckpt.storage.location import Location
from cloudckpt.storage.pool import RequestPool
from cloudckpt.storage.retry import RequestCounters, RequestDeadlineExceeded, current_rank
from cloudckpt.storage.types import OpenUpload

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event

    from cloudckpt.storage.buffers import Progress
    from cloudckpt.storage.pool import PendingWrite

GCS_CHUNK_MULTIPLE = 256 * 1024  # GCS resumable uploads take chunks in multiples of this

T = TypeVar("T")


class StoreChecksumError(ValueError):
    """The store's own checksum of a whole object differs from the bytes received."""


@dataclass(frozen=True, slots=True)
class Listed:
    """One entry of a listing.

    Attributes:
        name: the filesystem's path of the entry, without protocol (``bucket/key`` on
            object stores), as the store spells it (a directory-marker key keeps its
            trailing ``/``).
        size: bytes (0 for a directory).
        directory: not an object: a "directory" entry (a common prefix; SeaweedFS keeps
            empty ones) or a zero-size directory-marker key ending in ``/``.
    """

    name: str
    size: int
    directory: bool = False


def listed(name: str, info: Mapping[str, Any]) -> Listed:
    """The :class:`Listed` of one entry of an fsspec listing (``detail=True``)."""
    size = int(info.get("size") or 0)
    key = str(info.get("Key") or info.get("name") or name)
    marker = (key.endswith("/") or name.endswith("/")) and not size
    return Listed(name, size, info.get("type") == "directory" or marker)


class Transport:
    """Any fsspec filesystem: whole-object ``pipe_file`` writes, ``cat_file`` reads.

    Every request holds one slot of the process's :class:`RequestPool`. Retries are
    the filesystem's own (gcsfs retries GCS requests); :attr:`counters` counts those
    cloudckpt makes itself (S3).
    """

    multipart = False  # objects above part_size go up in concurrent parts (S3)
    # Reads into caller buffers cost no request of their own (local files): a buffer's
    # whole blocks are read straight into it. Elsewhere the ranges of many buffers are
    # fetched in merged runs of up to a part, streamed straight into them (.scatter).
    reads_in_place = False
    # Objects can be written front to back straight into the store's file
    # (:meth:`open_sequential`): local files only.
    writes_in_place = False
    # Objects can be written front to back into multipart uploads (S3).
    streams_uploads = False

    def __init__(
        self,
        location: Location,
        pool: RequestPool,
        part_size: int,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.location = location
        self.fs = location.fs
        self.pool = pool
        self.part_size = part_size
        self.retry = retry or RetryPolicy()
        self.counters = RequestCounters()

    def put(self, path: str, view: memoryview, checksum: int) -> None:
        """Write a whole object, replacing any previous one."""
        with self.pool.slots:
            self.fs.pipe_file(path, view)

    def create(self, path: str, view: memoryview, checksum: int) -> None:
        """Write a whole object only if none exists (raises ``FileExistsError``)."""
        with self.pool.slots:
            self.fs.pipe_file(path, view, mode="create")

    def open_sequential(self, path: str) -> IO[bytes]:
        """A new unbuffered file at ``path`` to write an object front to back,
        replacing any previous one (transports with ``writes_in_place`` only)."""
        raise NotImplementedError(f"{type(self).__name__} writes whole objects only")

    def remove(self, path: str) -> None:
        """Remove the object at ``path`` (an unfinished sequential write)."""
        self.fs.rm_file(path)

    def fetch(
        self, path: str, start: int, end: int | None, *, store_checked: bool = False
    ) -> bytes:
        """The bytes ``[start, end)`` of an object (``end=None``: to its end). With
        ``store_checked``, a whole object is checked against the checksum the store
        returns with it, where it returns one (S3 only; raises
        :class:`StoreChecksumError`)."""
        with self.pool.slots:
            return bytes(self.fs.cat_file(path, start=start or None, end=end))

    def fetch_into(self, path: str, out: memoryview, start: int) -> int:
        """Fill ``out`` from ``start``; returns the bytes received."""
        with self.pool.slots:
            data = self.fs.cat_file(path, start=start, end=start + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def fetch_scatter(self, path: str, start: int, segments: Sequence[memoryview]) -> int:
        """Fill ``segments``, in order, with the bytes of one range from ``start`` (their
        total length: one request); returns the bytes received."""
        end = start + sum(segment.nbytes for segment in segments)
        with self.pool.slots:
            data = memoryview(self.fs.cat_file(path, start=start, end=end))
        done = 0
        for segment in segments:
            piece = data[done : done + segment.nbytes]
            segment[: piece.nbytes] = piece
            done += piece.nbytes
        return data.nbytes

    def read_segments(
        self,
        path: str,
        start: int,
        views: Sequence[memoryview],
        filled: Callable[[memoryview], None] | None = None,
    ) -> int:
        """Fill ``views`` in order with the bytes of ``path`` from ``start`` on, in one
        request (transports that read in place only); returns the bytes received
        (fewer at the end of the object). ``filled`` is called with each view once it
        is full, before the next one is read."""
        raise NotImplementedError(f"{type(self).__name__} has no scattered reads")

    def read_ranges(self, nbytes: int) -> list[tuple[int, int]]:
        """How a read of ``nbytes`` into one buffer is cut into concurrent requests."""
        return [(0, nbytes)] if nbytes <= self.part_size else plan_parts(nbytes, self.part_size)

    def start_multipart(
        self,
        executor: ThreadPoolExecutor,
        item: PendingWrite,
        path: str,
        progress: Progress,
        cancel: Event,
    ) -> None:
        """Start a multipart upload of ``item`` (transports with ``multipart`` only)."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def complete_multipart(self, item: PendingWrite, path: str) -> None:
        """Complete the multipart upload of ``item`` once its parts are up."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def abort_multipart(self, item: PendingWrite, path: str) -> None:
        """Abort the multipart upload of ``item`` (logs when that fails too)."""
        raise NotImplementedError(f"{type(self).__name__} has no multipart uploads")

    def open_uploads(self) -> list[OpenUpload]:
        """Multipart uploads open below the root (none outside S3)."""
        return []

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort an open multipart upload (none outside S3)."""

    # -- listings, lookups, deletes ------------------------------------------------------

    def list_objects(self, path: str) -> list[Listed]:
        """Every entry below the prefix ``path``, at any depth, in no particular order
        (directory entries may be among them); nothing when it holds nothing."""
        fs = self.fs
        try:
            if not self._metadata_call(fs.exists, path):
                return []
            found = self._metadata_call(fs.find, path, withdirs=False, detail=True)
        except FileNotFoundError:
            return []
        return [listed(fs._strip_protocol(name), info) for name, info in found.items()]

    def list_level(self, path: str) -> list[Listed]:
        """The entries directly below the prefix ``path``: objects, and a directory
        entry per sub-prefix; nothing when it holds nothing."""
        fs = self.fs
        try:
            if not self._metadata_call(fs.exists, path):
                return []
            entries = self._metadata_call(fs.ls, path, detail=True)
        except FileNotFoundError:
            return []
        return [listed(fs._strip_protocol(e["name"]), e) for e in entries]

    def is_file(self, path: str) -> bool:
        """Whether the object ``path`` exists (a prefix or directory is not one)."""
        return bool(self._metadata_call(self.fs.isfile, path))

    def is_directory(self, path: str) -> bool:
        """Whether ``path`` is an existing directory (local disks, where one may exist
        empty); object stores keep no directories of their own: never."""
        return False

    def size(self, path: str) -> int:
        """The size of the object ``path`` (``FileNotFoundError`` without one)."""
        return int(self._metadata_call(self.fs.size, path))

    def delete(self, path: str, recursive: bool = False) -> None:
        """Delete the object ``path`` (with ``recursive``: and everything below it).
        May raise ``FileNotFoundError`` when nothing is there."""
        self._metadata_call(self.fs.rm, path, recursive=recursive)

    def bucket_exists(self) -> bool:
        """Whether the root's bucket exists (object stores only)."""
        bucket = self.fs._strip_protocol(self.location.root).split("/", 1)[0]
        return bool(self._metadata_call(self.fs.exists, bucket))

    def _metadata_call(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One listing, lookup or delete of the filesystem (the seam where a transport
        bounds them)."""
        return call(*args, **kwargs)


class LocalTransport(Transport):
    """Local disks: directories made on demand, real ``O_EXCL`` creates (fsspec's
    ``mode="create"`` checks, then opens: two racing creates could both win), and reads
    straight into the caller's buffer."""

    reads_in_place = True
    writes_in_place = True

    def open_sequential(self, path: str) -> IO[bytes]:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        return cast(IO[bytes], self.fs.open(path, "wb"))

    def put(self, path: str, view: memoryview, checksum: int) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        super().put(path, view, checksum)

    def create(self, path: str, view: memoryview, checksum: int) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with self.pool.slots:
            created = self.fs.open(path, "xb")  # FileExistsError: another's, left alone
            try:
                with created:
                    created.write(view)
            except BaseException:
                # this write's own file (O_EXCL): cut short (a full disk), it must not
                # stand as a claim or manifest that refuses the next create
                with contextlib.suppress(OSError):
                    self.fs.rm_file(path)
                raise

    def fetch_into(self, path: str, out: memoryview, start: int) -> int:
        with self.pool.slots, self.fs.open(path, "rb") as f:
            f.seek(start)
            return int(f.readinto(out))

    def read_segments(
        self,
        path: str,
        start: int,
        views: Sequence[memoryview],
        filled: Callable[[memoryview], None] | None = None,
    ) -> int:
        done = 0
        with self.pool.slots, self.fs.open(path, "rb") as f:
            f.seek(start)
            for view in views:
                got = int(f.readinto(view)) if view.nbytes else 0
                done += got
                if got < view.nbytes:
                    break
                if filled is not None:
                    filled(view)
        return done

    def read_ranges(self, nbytes: int) -> list[tuple[int, int]]:
        return [(0, nbytes)]

    def is_directory(self, path: str) -> bool:
        return bool(self._metadata_call(self.fs.isdir, path))


class GcsTransport(Transport):
    """GCS through gcsfs: resumable uploads in ``part_size`` chunks (GCS's JSON API has
    no parallel parts); create-only writes always as one simple upload.

    Listings, lookups and deletes end by ``retry.request_timeout_s`` (and the opened
    checkpoint's ``retry.operation_timeout_s``): gcsfs retries them itself (up to 6
    attempts, each limited only by aiohttp's 300 s), so a server that stops answering
    held ``cloudckpt ls`` or ``verify`` for many minutes. The call is cancelled on the
    filesystem's event loop at the deadline (fsspec's ``timeout=``)."""

    def __init__(
        self,
        location: Location,
        pool: RequestPool,
        part_size: int,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(location, pool, part_size, retry)
        timeout = self.retry.operation_timeout_s
        self._operation_deadline = None if timeout is None else time.monotonic() + timeout

    def _metadata_call(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        seconds = self.retry.request_timeout_s
        deadline = f"the request deadline retry.request_timeout_s={seconds:g}"
        if self._operation_deadline is not None:
            left = self._operation_deadline - time.monotonic()
            if left < seconds:
                seconds = left
                deadline = (
                    "the deadline of this operation, retry.operation_timeout_s="
                    f"{self.retry.operation_timeout_s:g}"
                )
        if seconds <= 0:
            raise RequestDeadlineExceeded(f"gave up on rank {current_rank()}: {deadline} passed")
        started = time.monotonic()
        try:
            return call(*args, timeout=seconds, **kwargs)
        except fsspec.exceptions.FSTimeoutError as exc:
            raise RequestDeadlineExceeded(
                f"gave up on rank {current_rank()} after {time.monotonic() - started:.1f} s "
                f"({deadline} passed)"
            ) from exc

    def put(self, path: str, view: memoryview, checksum: int) -> None:
        chunk = max(GCS_CHUNK_MULTIPLE, self.part_size - self.part_size % GCS_CHUNK_MULTIPLE)
        with self.pool.slots:
            self.fs.pipe_file(path, view, chunksize=chunk)

    def create(self, path: str, view: memoryview, checksum: int) -> None:
        # gcsfs switches to a resumable upload from ``chunksize`` (50 MiB) on, and a
        # server may apply ifGenerationMatch=0 to simple uploads only (fake-gcs-server
        # does): the claim and the manifest must never take that path.
        with self.pool.slots:
            self.fs.pipe_file(path, view, mode="create", chunksize=view.nbytes + 1)
