"""One checkpoint location: :class:`CheckpointStorage` binds a URI to a filesystem and
a root (:mod:`.location`), picks the transport for its kind of store once
(:mod:`.transport`, :mod:`.s3`), takes the process's request pool (:mod:`.pool`) and
checks reads against a manifest (:mod:`.checked`). Paths are relative to the root;
errors are translated at this edge (:mod:`.edge`) and name the object's URI."""

from __future__ import annotations

import builtins
import copy
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar, cast

import fsspec

from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import (
    CheckpointNotFoundError,
    ObjectExistsError,
    StorageError,
)
from cloudckpt.retry_policy import RetryPolicy
from cloudckpt.storage.admin import StorageAdmin
from cloudckpt.storage.blocks import block_size_for, object_checksum
from cloudckpt.storage.buffers import Buffer, Progress, as_bytes_view, crc32c, plan_parts
from cloudckpt.storage.checked import Expected
from cloudckpt.storage.edge import PRECONDITION_FAILED, error_code, io_errors, translate
from cloudckpt.storage.location import (
    Location,
    StoreKind,
    enforces_exclusive_writes,
    resolve,
)
from cloudckpt.storage.pool import PendingWrite, RequestPool, guarded
from cloudckpt.storage.reads import StorageReads
from cloudckpt.storage.scatter import RunCheck, ScatterRun, plan_reads
from cloudckpt.storage.streams import ObjectStream, PartSink, UploadStream
from cloudckpt.storage.transport import GcsTransport, LocalTransport, Transport
from cloudckpt.storage.types import ReadRequest, WriteResult

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class CheckpointStorage(StorageReads, StorageAdmin):
    """One checkpoint location: an fsspec filesystem plus a root path.

    Args:
        uri: checkpoint URI or local path. Messages show it with secrets redacted.
        fs: an fsspec filesystem to use instead of resolving one from the URI (the
            URI's path part is still used as the root).
        storage_options: options for the filesystem resolved from the URI (ignored
            when ``fs`` is given); they override ``config.storage_options`` and the
            environment.
        max_in_flight: requests in flight in this process (default: the config's).
        config: part size, in-flight requests and storage options of a training config.
        expected: what a manifest recorded, by relative path: every object read whole
            is checked against its size and CRC-32C, every ranged read against its size.
        verify_checksums: also check the CRC-32C of objects only partly needed (they
            are then read whole).
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        fs: fsspec.AbstractFileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        max_in_flight: int | None = None,
        *,
        config: CheckpointConfig | None = None,
        expected: Mapping[str, WriteResult] | None = None,
        verify_checksums: bool = False,
    ) -> None:
        self.config = config or CheckpointConfig()
        limit = self.config.max_in_flight if max_in_flight is None else max_in_flight
        self.pool = RequestPool.for_process(limit)
        self.max_in_flight = self.pool.max_in_flight
        self.part_size = self.config.part_size
        self.location = resolve(
            os.fspath(uri), fs, storage_options, self.config, self.max_in_flight
        )
        self.uri, self.fs, self.root = self.location.uri, self.location.fs, self.location.root
        self.expected = Expected(dict(expected or {}), verify_checksums, self.child_uri)
        self.transport = transport_for(self.location, self.pool, self.part_size, self.config.retry)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.uri!r})"

    def with_expected(
        self, expected: Mapping[str, WriteResult] | None, verify_checksums: bool = False
    ) -> CheckpointStorage:
        """This storage (same filesystem, same request slots) with its reads checked
        against ``expected`` (a manifest's path -> size and CRC-32C)."""
        bound = copy.copy(self)
        bound.expected = Expected(dict(expected or {}), verify_checksums, self.child_uri)
        return bound

    @property
    def verify_checksums(self) -> bool:
        """Whether partly needed objects are read whole to check their CRC-32C."""
        return self.expected.verify_checksums

    @property
    def process_local(self) -> bool:
        """True for a store only this process sees (fsspec's ``memory://``)."""
        return self.location.kind is StoreKind.MEMORY

    @property
    def enforces_exclusive_writes(self) -> bool | None:
        """Whether create-only writes are known to be enforced by this store (see
        :func:`cloudckpt.storage.location.enforces_exclusive_writes`)."""
        return enforces_exclusive_writes(self.location)

    # -- reads in place ----------------------------------------------------------------

    def read_into_many(self, items: Sequence[tuple[ReadRequest, Buffer]]) -> None:
        """:meth:`StorageReads.read_into_many`; on stores that read in place (local
        files), the ranges of each object are read in runs of whole blocks straight
        into their buffers and checked there (:mod:`cloudckpt.storage.scatter`,
        :meth:`_read_local_run`)."""
        if not self.transport.reads_in_place or self.expected.verify_checksums:
            super().read_into_many(items)
            return
        # a large object of a version-1 manifest has no block CRCs: its whole reads are
        # checked against the object's CRC on the general path
        whole = [
            r.path in self.expected.entries and not self.expected.blocks_of(r.path)
            for r, _ in items
        ]
        if any(whole):
            super().read_into_many([item for item, w in zip(items, whole, strict=True) if w])
            items = [item for item, w in zip(items, whole, strict=True) if not w]
        views = [(request, as_bytes_view(buffer)) for request, buffer in items]
        runs = plan_reads(self.expected, views, self.part_size)
        for request, view in views:
            if not view.nbytes:  # no read, but the object must exist
                self.read(request.path, request.start, request.start)
        self.pool.map(self._read_local_run, runs)

    def _read_local_run(self, run: ScatterRun) -> None:
        """The local fill: one run's segments read from its object with ``readinto``,
        piece by piece, each block checked as soon as it is read
        (:meth:`~cloudckpt.storage.scatter.RunCheck.pieces`), then its copies."""
        check = RunCheck(run, self.expected)
        with self._translated(run.path):
            got = self.transport.read_segments(
                self.full_path(run.path), run.start, check.pieces(), check.add
            )
        self._count_read(got)
        self.expected.check_length(run.path, run.start, run.nbytes, got)
        check.finish()
        run.copy_out()

    # -- writes ------------------------------------------------------------------------

    def write(self, relpath: str, data: Buffer, *, exclusive: bool = False) -> WriteResult:
        """Write one whole object, replacing any previous one (unless ``exclusive``).

        ``data`` is any buffer (``bytes``, a ``memoryview`` of a tensor's memory); it is
        not copied by this layer. Returns the size and CRC-32C of what was written.
        With ``exclusive``, the write is create-only, as one request: S3
        ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, a local ``O_EXCL`` open.

        Raises:
            ObjectExistsError: ``exclusive`` and the object exists.
            StorageError: any other failure of the store.
        """
        if not exclusive:
            return self.write_many([(relpath, data)])[0]
        view = as_bytes_view(data)
        checksum, blocks = object_checksum(view)
        try:
            self.transport.create(self.full_path(relpath), view, checksum)
        except FileExistsError as exc:
            raise ObjectExistsError(f"{self.child_uri(relpath)} already exists") from exc
        except io_errors() as exc:
            if error_code(exc) not in PRECONDITION_FAILED:
                raise translate(exc, f"failed to create {self.child_uri(relpath)}: {exc}") from exc
            if not self._is_our_object(relpath, view.nbytes, checksum):
                raise ObjectExistsError(f"{self.child_uri(relpath)} already exists") from exc
        return WriteResult(relpath, view.nbytes, checksum, blocks)

    @property
    def streams_uploads(self) -> bool:
        """Whether :meth:`open_stream` writes objects front to back into multipart
        uploads (S3), sending large writes made inside its ``referencing`` block from
        the caller's memory."""
        return self.transport.streams_uploads

    @property
    def writes_in_place(self) -> bool:
        """Whether :meth:`open_stream` writes objects straight into the store (local
        files); elsewhere objects are assembled in memory and written whole."""
        return self.transport.writes_in_place

    def open_stream(
        self, relpath: str, progress: Progress | None = None, size_hint: int | None = None
    ) -> ObjectStream | UploadStream:
        """Start writing the object ``relpath`` front to back, straight into the
        store, replacing any previous one (stores that :attr:`writes_in_place` or
        :attr:`streams_uploads` only): see :mod:`cloudckpt.storage.streams`. The caller
        ends it with ``finish()`` (returns its :class:`WriteResult`) or ``abort()``.
        ``progress`` (shared by the streams of one transfer) counts the bytes as they
        reach the store. ``size_hint`` (the object's expected size, when known) sizes an
        upload's parts so that it stays within S3's 10,000 parts.

        Raises:
            StorageError: the file cannot be created.
        """
        path = self.full_path(relpath)
        uri = self.child_uri(relpath)
        if self.streams_uploads:  # S3: a multipart upload (storage.streams.UploadStream)
            sink = cast(PartSink, self.transport)
            executor = self.pool.executor(self.pool.max_in_flight)
            return UploadStream(
                relpath,
                uri,
                path,
                sink,
                executor,
                self.part_size,
                self.pool.max_in_flight,
                progress,
                size_hint=size_hint,
            )
        try:
            file = self.transport.open_sequential(path)
        except io_errors() as exc:
            raise translate(exc, f"failed to write {uri}: {exc}") from exc
        return ObjectStream(
            relpath, uri, file, self.pool.slots, lambda: self.transport.remove(path), progress
        )

    def _is_our_object(self, relpath: str, size: int, checksum: int) -> bool:
        """After a 412: did an earlier attempt of this very request (retried by botocore
        when its response was lost) create the object? Same size and CRC-32C: yes."""
        try:
            stored = self._read(relpath)
        except (StorageError, CheckpointNotFoundError):
            return False
        ours = len(stored) == size and crc32c(stored) == checksum
        if ours:
            logger.info("%s: a retried create found its own first attempt", self.child_uri(relpath))
        return ours

    def write_many(
        self, items: Iterable[tuple[str, Buffer]], *, owned: bool = False
    ) -> builtins.list[WriteResult]:
        """Write several objects, at most ``max_in_flight`` requests at once.

        Objects larger than ``part_size`` on S3 go up as multipart uploads with
        concurrent parts. Returns results in the order of ``items``. On failure,
        requests not yet started are skipped, unfinished multipart uploads are
        aborted, and the first error is raised.

        ``owned``: the caller hands the buffers over and will not change them (a
        :class:`~cloudckpt.storage.staging.StagingStorage` keeps them instead of a
        copy); written at once here, so it changes nothing.

        Raises:
            StorageError: naming the object URI (and part, for multipart uploads).
        """
        jobs = [(relpath, as_bytes_view(data)) for relpath, data in items]
        paths = [self.full_path(relpath) for relpath, _ in jobs]
        before = self.transport.counters.snapshot()
        progress = Progress("wrote", self.uri, sum(v.nbytes for _, v in jobs), len(jobs))
        cancel = threading.Event()
        pending: builtins.list[PendingWrite] = []
        with self.pool.executor(sum(self._request_count(view) for _, view in jobs)) as pool:
            try:
                for (relpath, view), path in zip(jobs, paths, strict=True):
                    pending.append(self._submit_write(pool, relpath, path, view, progress, cancel))
            except BaseException:
                cancel.set()
                raise
            finally:
                self._settle(pending, cancel)
        retried = self.transport.counters.snapshot() - before
        if retried.retries or retried.gave_up:
            logger.info("writing %d object(s) to %s: %s", len(jobs), self.uri, retried.summary())
        failed = [item for item in pending if item.errors]
        if failed:
            for item in failed[1:]:
                logger.error("also failed: %s", item.errors[0])
            raise failed[0].errors[0]
        progress.finish()
        return [item.result() for item in pending]

    def _uses_multipart(self, view: memoryview) -> bool:
        return self.transport.multipart and view.nbytes > self.part_size

    def _request_count(self, view: memoryview) -> int:
        return len(plan_parts(view.nbytes, self.part_size)) if self._uses_multipart(view) else 1

    def _submit_write(
        self,
        pool: ThreadPoolExecutor,
        relpath: str,
        path: str,
        view: memoryview,
        progress: Progress,
        cancel: threading.Event,
    ) -> PendingWrite:
        item = PendingWrite(relpath, view, [])
        if self._uses_multipart(view):
            first_part = plan_parts(view.nbytes, self.part_size)[0]
            item.block_size = block_size_for(first_part[1] - first_part[0])
            self.transport.start_multipart(pool, item, path, progress, cancel)
        else:
            item.futures.append(pool.submit(guarded, cancel, self._put, item, path, progress))
        return item

    def _put(self, item: PendingWrite, path: str, progress: Progress) -> None:
        item.crc, item.blocks = object_checksum(item.view)  # one pass: blocks and whole
        try:
            self.transport.put(path, item.view, item.crc)
        except io_errors() as exc:
            message = f"failed to write {self.child_uri(item.relpath)}: {exc}"
            if self.transport.writes_in_place:  # a partial file (a full disk: ENOSPC)
                self._remove_partial(path)  # is not left to fill it, as a stream's
            raise translate(exc, message) from exc
        progress.add(item.view.nbytes)

    def _remove_partial(self, path: str) -> None:
        """Remove what a failed whole-object write left in place (errors logged)."""
        try:
            self.transport.remove(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove the unfinished %s: %s", path, exc)

    def _settle(self, pending: builtins.list[PendingWrite], cancel: threading.Event) -> None:
        """Wait for every request; complete multipart uploads or abort the failed ones."""
        wait([future for item in pending for future in item.futures])
        for item in pending:
            item.settle_errors()
            if item.upload_id is None:
                continue
            path = self.full_path(item.relpath)
            if item.errors or cancel.is_set():
                self.transport.abort_multipart(item, path)
                continue
            try:
                self.transport.complete_multipart(item, path)
            except StorageError as exc:
                item.errors.append(exc)
                self.transport.abort_multipart(item, path)


def open_checkpoint(
    uri: str | os.PathLike[str],
    fs: fsspec.AbstractFileSystem | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    config: CheckpointConfig | None = None,
    expected: Mapping[str, WriteResult] | None = None,
    verify_checksums: bool = False,
) -> CheckpointStorage:
    """Resolve a checkpoint URI (or use ``fs``) into a :class:`CheckpointStorage`."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise CheckpointNotFoundError(f"checkpoint location must be a non-empty URI, got {uri!r}")
    return CheckpointStorage(
        uri,
        fs=fs,
        storage_options=storage_options,
        config=config,
        expected=expected,
        verify_checksums=verify_checksums,
    )


def transport_for(
    location: Location, pool: RequestPool, part_size: int, retry: RetryPolicy | None = None
) -> Transport:
    """The transport for ``location``'s kind of store (S3 requests retried by ``retry``)."""
    retry = retry or RetryPolicy()
    if location.kind is StoreKind.S3:
        from cloudckpt.storage.s3 import S3Transport  # noqa: PLC0415 - needs s3fs

        return S3Transport(location, pool, part_size, retry)
    kinds: dict[StoreKind, type[Transport]] = {
        StoreKind.LOCAL: LocalTransport,
        StoreKind.GCS: GcsTransport,
    }
    return kinds.get(location.kind, Transport)(location, pool, part_size, retry)
