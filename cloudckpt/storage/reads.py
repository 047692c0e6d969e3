"""Reads of a checkpoint's objects: whole or ranged, into new bytes or straight into
tensor memory, concurrent within the process's request pool, checked against the
manifest (:mod:`.checked`).

A ranged read of a listed object is verified against the CRC-32C of every block it
covers: the part of a buffer made of whole blocks is read straight into it and checked
in place; only a partly needed block at either end of a range is fetched whole (once
per call, however many ranges share it) and copied from. Every byte returned has been
checked against a CRC-32C the writer measured."""

from __future__ import annotations

import bisect
import builtins
import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Sequence

from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage.blocks import (
    BlockCrcs,
    block_runs,
    combine,
    covering,
    inner,
    part_checksum,
    whole_blocks,
)
from cloudckpt.storage.buffers import Buffer, Progress, as_bytes_view
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.handle import StorageHandle
from cloudckpt.storage.retry import current_rank
from cloudckpt.storage.scatter import ScatterRun, check_run, plan_reads
from cloudckpt.storage.transport import StoreChecksumError
from cloudckpt.storage.types import ReadRequest, WriteResult


class StorageReads(StorageHandle):
    """The read half of :class:`~cloudckpt.storage.CheckpointStorage`."""

    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        """Read a whole object or the byte range ``[start, end)`` of it.

        Objects the manifest lists are checked: whole reads (``[0, size)`` too) against
        size and CRC-32C, ranges against the size and the CRC-32C of every block they
        cover (with ``verify_checksums``, the object is read whole and checked).

        Raises:
            CheckpointNotFoundError: the object does not exist.
            CorruptObjectError: size or CRC-32C differ from the manifest's.
            StorageError: any other failure of the store.
        """
        size = self.expected.size(relpath)
        if size is None:  # no manifest CRC: the store's, where it returns one
            return self._read(relpath, start, end, store_checked=True)
        end = size if end is None else end
        if start == 0 and end == size:
            data = self._read(relpath)
            self.expected.check_whole(relpath, memoryview(data))
            return data
        self.expected.check_range(relpath, start, end)
        if self.expected.verify_checksums:
            return self.read(relpath)[start:end]
        if self.expected.checks_blocks(ReadRequest(relpath, start, end)):
            return self._read_checked([ReadRequest(relpath, start, end)])[0]
        return self._read(relpath, start, end)

    def _read_checked(self, requests: Sequence[ReadRequest]) -> builtins.list[bytes]:
        """Ranges of listed objects (``end`` set), each widened to the blocks it
        overlaps; per object, the blocks needed are fetched once, in runs of at most a
        part, concurrently, and checked before any byte is returned."""
        wanted: dict[str, builtins.list[ReadRequest]] = {}
        for request in requests:
            wanted.setdefault(request.path, []).append(request)
        runs: builtins.list[tuple[str, int, int]] = []
        for path, ranges in wanted.items():
            blocks, size = self.expected.blocks_of(path), self.expected.size(path)
            if blocks is None or size is None:  # callers pass what checks_blocks accepts
                raise ValueError(f"{self.child_uri(path)} has no block CRCs to check")
            spans = [covering(r.start, r.end or size, size, blocks.block_size) for r in ranges]
            runs += [(path, a, b) for a, b in block_runs(spans, blocks.block_size, self.part_size)]
        fetched = self.pool.map(self._fetch_checked, runs)
        by_path: dict[str, builtins.list[tuple[int, bytes]]] = {}
        for (path, start, _), data in zip(runs, fetched, strict=True):
            by_path.setdefault(path, []).append((start, data))
        return [_cut(by_path[r.path], r.start, r.end or 0) for r in requests]

    def _fetch_checked(self, run: tuple[str, int, int]) -> bytes:
        path, start, end = run
        data = self._read(path, start, end)
        self.expected.check_length(path, start, end - start, len(data))
        self.expected.check_blocks(path, start, data)
        return data

    def _read(
        self, relpath: str, start: int = 0, end: int | None = None, *, store_checked: bool = False
    ) -> bytes:
        path = self.full_path(relpath)
        if end is not None and end <= start:
            # an empty range; some filesystems (s3fs) read the whole object for it
            try:
                found = self.transport.is_file(path)
            except io_errors() as exc:
                raise translate(exc, f"failed to read {self.child_uri(relpath)}: {exc}") from exc
            if found:
                return b""
            raise self.expected.not_found(relpath)
        try:
            data = self.transport.fetch(path, start, end, store_checked=store_checked)
        except FileNotFoundError as exc:
            raise self.expected.not_found(relpath) from exc
        except StoreChecksumError as exc:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)} (read on rank {current_rank()}): {exc}"
            ) from exc
        except io_errors() as exc:
            if start and end is None and 0 <= self._size(path) <= start:
                return b""  # reading from the end: S3 answers 416 where files give b""
            raise translate(exc, f"failed to read {self.child_uri(relpath)}: {exc}") from exc
        self._count_read(len(data))
        return data

    def _count_read(self, nbytes: int) -> None:
        """Count one read of ``nbytes`` in the process's and this location's counters."""
        for counters in (self.pool.counters, self.transport.counters):
            counters.add("reads")
            counters.add("bytes_read", nbytes)

    def _size(self, path: str) -> int:
        try:
            return self.transport.size(path)
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
        against size and CRC-32C, a partial one against the size and the CRC-32C of
        every block it covers (with ``verify_checksums``, against the CRC-32C of the
        whole object, read in full). Where reads cost a request each (object stores),
        the buffers of one object are filled by GETs of merged runs of their blocks
        streamed straight into them (:mod:`.scatter`, :meth:`_read_run`).
        """
        views = [(request, as_bytes_view(buffer)) for request, buffer in items]
        checked = [(r, v) for r, v in views if self.expected.needs_whole_read(r, v.nbytes)]
        direct: builtins.list[tuple[ReadRequest, memoryview]] = []
        edges: builtins.list[tuple[ReadRequest, memoryview]] = []
        scattered: builtins.list[tuple[ReadRequest, memoryview]] = []
        for request, view in views:
            if self.expected.needs_whole_read(request, view.nbytes):
                continue
            if self.transport.reads_in_place or self.expected.blocks_of(request.path) is None:
                self._split(request, view, direct, edges)
            else:  # fetched with the others in merged runs of blocks (see Transport)
                scattered.append((request, view))
        ranges = [
            (request.path, request.start + a, view[a:b])
            for request, view in direct
            for a, b in self.transport.read_ranges(view.nbytes)
        ]
        runs = plan_reads(self.expected, scattered, self.part_size)
        total = sum(v.nbytes for _, _, v in ranges) + sum(run.nbytes for run in runs)
        progress = Progress("read", self.uri, total, len(items))
        tasks: builtins.list[Callable[[], None]] = [
            functools.partial(self._read_range_into, path, view, start, progress)
            for path, start, view in ranges
        ]
        tasks += [functools.partial(self._read_run, run, progress) for run in runs]
        self.pool.map(_call, tasks)
        for request, view in direct:
            if self.expected.blocks_of(request.path) is not None:
                self.expected.check_blocks(request.path, request.start, view)
            elif self.expected.is_whole(request, view.nbytes):
                self.expected.check_whole(request.path, view)
        for (_, view), data in zip(edges, self._read_checked([r for r, _ in edges]), strict=True):
            view[:] = data
        by_object: dict[str, builtins.list[tuple[ReadRequest, memoryview]]] = {}
        for request, view in checked:
            by_object.setdefault(request.path, []).append((request, view))
        self.pool.map(lambda path: self._read_whole_into(by_object[path]), builtins.list(by_object))
        progress.finish()

    def _read_run(self, run: ScatterRun, progress: Progress) -> None:
        """The object-store fill: one ranged GET of a run streamed into its segments;
        its blocks checked (:func:`~cloudckpt.storage.scatter.check_run`), then its
        copies."""
        with self._translated(run.path):
            got = self.transport.fetch_scatter(self.full_path(run.path), run.start, run.segments)
        self._count_read(got)
        self.expected.check_length(run.path, run.start, run.nbytes, got)
        check_run(run, self.expected)
        run.copy_out()
        progress.add(got)

    @contextlib.contextmanager
    def _translated(self, relpath: str) -> Iterator[None]:
        """Translate a read's errors at the edge, naming ``relpath``."""
        try:
            yield
        except FileNotFoundError as exc:
            raise self.expected.not_found(relpath) from exc
        except io_errors() as exc:
            raise translate(exc, f"failed to read {self.child_uri(relpath)}: {exc}") from exc

    def _split(
        self,
        request: ReadRequest,
        view: memoryview,
        direct: builtins.list[tuple[ReadRequest, memoryview]],
        edges: builtins.list[tuple[ReadRequest, memoryview]],
    ) -> None:
        """Cut one buffer's range: its whole blocks go straight into the buffer
        (``direct``, checked in place afterwards), a partly needed block at either end
        goes to ``edges`` (fetched whole, checked, then copied)."""
        path, start, end = request.path, request.start, request.start + view.nbytes
        self.expected.check_range(path, start, end)
        blocks, size = self.expected.blocks_of(path), self.expected.size(path)
        if blocks is None or size is None or view.nbytes == 0:
            direct.append((request, view))
            return
        first, last = inner(start, end, size, blocks.block_size)
        if first >= last:
            edges.append((ReadRequest(path, start, end), view))
            return
        if start < first:
            edges.append((ReadRequest(path, start, first), view[: first - start]))
        direct.append((ReadRequest(path, first), view[first - start : last - start]))
        if last < end:
            edges.append((ReadRequest(path, last, end), view[last - start :]))

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
        with self._translated(relpath):
            got = self.transport.fetch_into(self.full_path(relpath), out, start)
        self._count_read(got)
        self.expected.check_length(relpath, start, out.nbytes, got)
        progress.add(got)

    def read_many(self, requests: Sequence[ReadRequest]) -> builtins.list[bytes]:
        """Read several objects or ranges concurrently; results follow ``requests``."""
        progress = Progress("read", self.uri, 0, len(requests))

        def read(request: ReadRequest) -> bytes:
            data = self.read(request.path, request.start, request.end)
            progress.add(len(data))
            return data

        results: builtins.list[bytes] = [b""] * len(requests)
        blocked = [i for i, r in enumerate(requests) if self.expected.checks_blocks(r)]
        bounded = [_bounded(requests[i], self.expected.size(requests[i].path)) for i in blocked]
        for i, data in zip(blocked, self._read_checked(bounded), strict=True):
            results[i] = data
            progress.add(len(data))
        others = sorted(set(range(len(requests))) - set(blocked))
        for i, data in zip(others, self.pool.map(read, [requests[i] for i in others]), strict=True):
            results[i] = data
        progress.finish()
        return results

    def checksum(self, relpath: str, size: int, block_size: int | None = None) -> WriteResult:
        """Size and CRC-32C of an object of ``size`` bytes (and its block CRCs, for a
        ``block_size``), read in ranges of about ``part_size`` (so memory stays at one
        part per call however large the object), in one pass."""
        step = whole_blocks(self.part_size, block_size or self.part_size)
        crc, done = 0, 0
        crcs: builtins.list[int] = []
        for start in range(0, size, step):
            data = self._read(relpath, start, min(start + step, size))
            part = part_checksum(data, block_size or max(len(data), 1))
            crc = combine(crc, part.crc, len(data))
            crcs += part.blocks
            done += len(data)
        if block_size is None or size <= block_size:
            return WriteResult(relpath, done, crc)
        return WriteResult(relpath, done, crc, BlockCrcs.of(block_size, crcs))

    def sha256(self, relpath: str, size: int) -> str:
        """Hex SHA-256 of an object of ``size`` bytes (Megatron-Core 0.19's integrity
        digest), read in ranges of ``part_size`` as :meth:`checksum` reads."""
        digest = hashlib.sha256()
        for start in range(0, size, self.part_size):
            digest.update(self._read(relpath, start, min(start + self.part_size, size)))
        return digest.hexdigest()


def _call(task: Callable[[], None]) -> None:
    task()


def _bounded(request: ReadRequest, size: int | None) -> ReadRequest:
    """``request`` with its end set (``None`` reads to the object's ``size``)."""
    end = request.end if request.end is not None else size
    return ReadRequest(request.path, request.start, end)


def _cut(runs: builtins.list[tuple[int, bytes]], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object from its fetched ``runs`` (start, data),
    which are sorted, contiguous where they meet, and cover the range."""
    first = bisect.bisect_right([s for s, _ in runs], start) - 1
    pieces = []
    for run_start, data in runs[first:]:
        if run_start >= end:
            break
        a, b = max(start - run_start, 0), min(end - run_start, len(data))
        pieces.append(data if (a, b) == (0, len(data)) else data[a:b])
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
