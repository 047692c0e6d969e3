"""The storage layer: the only module of cloudckpt that talks to fsspec.

A checkpoint lives under one URI prefix (``/data/run/iter_10``, ``file:///...``,
``memory://run/iter_10``, ``s3://bucket/run/iter_10``, ``gs://...``: any fsspec
protocol). :class:`CheckpointStorage` binds such a URI to a filesystem and a root
path and offers the handful of operations the strategies need, on paths *relative*
to the checkpoint root:

* :meth:`~CheckpointStorage.write` / :meth:`~CheckpointStorage.write_many` return a
  :class:`WriteResult` (path, size, crc32c computed from the bytes that went out),
* :meth:`~CheckpointStorage.read` / :meth:`~CheckpointStorage.read_many` (byte ranges),
* :meth:`~CheckpointStorage.exists`, :meth:`~CheckpointStorage.list`,
  :meth:`~CheckpointStorage.delete`.

Many requests run concurrently in a thread pool bounded by one knob,
``max_in_flight``. Checkpoint locations stay ``str`` URIs end to end.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import posixpath
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
from crc32c import crc32c as _crc32c
from fsspec.implementations.local import LocalFileSystem

from cloudckpt.errors import CheckpointNotFoundError, InvalidKeyError, StorageError

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
FileSystem = fsspec.AbstractFileSystem
"""The filesystem type strategies accept (``fs=``); other modules never import fsspec."""
T = TypeVar("T")
R = TypeVar("R")

DEFAULT_MAX_IN_FLIGHT = 16


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What one object write produced.

    Attributes:
        path: object path relative to the checkpoint root (``"layer.w/0.0"``).
        size: bytes written.
        crc32c: CRC-32C (Castagnoli) of the bytes written, as an unsigned int.
    """

    path: str
    size: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A byte range of one object; ``end=None`` reads to the end of the object."""

    path: str
    start: int = 0
    end: int | None = None


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (pass the previous value to extend)."""
    return int(_crc32c(data, crc))


def validate_relpath(key: str, uri: str = "") -> str:
    """Check that ``key`` is usable as an object path below a checkpoint root.

    Keys come from user state dicts. They must be relative, with no empty, ``.`` or
    ``..`` segments and no backslashes, so that no key can escape the checkpoint
    prefix or alias another key.

    Raises:
        InvalidKeyError: naming the key and the checkpoint URI.
    """
    where = f" in checkpoint {uri!r}" if uri else ""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}{where}: keys must be non-empty strings")
    if key.startswith("/") or "\\" in key:
        raise InvalidKeyError(
            f"invalid key {key!r}{where}: keys must be relative paths without backslashes"
        )
    bad = [seg for seg in key.split("/") if seg in ("", ".", "..")]
    if bad:
        raise InvalidKeyError(
            f"invalid key {key!r}{where}: empty, '.' or '..' path segments are not allowed"
        )
    return key


class _BufferReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview, without copying it.

    botocore takes bytes or a file-like body, not a memoryview; this lets s3fs send
    tensor memory as is. Slicing (``reader[a:b]``), which s3fs uses to cut multipart
    parts, returns another reader over the same memory.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, index: slice) -> _BufferReader:
        return _BufferReader(self._view[index])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(memoryview(buffer).cast("B"))]
        memoryview(buffer).cast("B")[: chunk.nbytes] = chunk
        self._pos += chunk.nbytes
        return chunk.nbytes

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _as_bytes_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class CheckpointStorage:
    """One checkpoint location: an fsspec filesystem plus a root path.

    Args:
        uri: checkpoint URI or local path. Kept verbatim for messages.
        fs: an fsspec filesystem to use instead of resolving one from the URI (the
            URI's path part is still used as the root).
        storage_options: options for the filesystem resolved from the URI
            (ignored when ``fs`` is given).
        max_in_flight: the most requests this object keeps in flight at once.
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        fs: fsspec.AbstractFileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self.uri = os.fspath(uri)
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        if fs is None:
            options = dict(storage_options or {})
            fs, root = fsspec.core.url_to_fs(self.uri, **options)
        else:
            root = fs._strip_protocol(self.uri)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root not in ("/", "") else root
        self._is_local = isinstance(fs, LocalFileSystem)
        protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
        self._wants_file_body = any(p in ("s3", "s3a") for p in protocols)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.uri!r})"

    # -- paths -----------------------------------------------------------------

    def full_path(self, relpath: str) -> str:
        """Filesystem path of ``relpath`` (validated) below the root."""
        validate_relpath(relpath, self.uri)
        return posixpath.join(self.root, relpath) if self.root else relpath

    def child_uri(self, relpath: str) -> str:
        """A human-readable URI of ``relpath`` for messages."""
        return self.uri.rstrip("/") + "/" + relpath

    # -- writes ------------------------------------------------------------------

    def write(self, relpath: str, data: Buffer) -> WriteResult:
        """Write one whole object, replacing any previous one.

        ``data`` is any buffer (``bytes``, a ``memoryview`` of a tensor's memory); it is
        not copied by this layer. Returns the size and CRC-32C of what was written.
        """
        path = self.full_path(relpath)
        view = _as_bytes_view(data)
        checksum = crc32c(view)
        try:
            if self._is_local:
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self.fs.pipe_file(path, _BufferReader(view) if self._wants_file_body else view)
        except Exception as exc:
            raise StorageError(f"failed to write {self.child_uri(relpath)}: {exc}") from exc
        return WriteResult(relpath, view.nbytes, checksum)

    def write_many(self, items: Iterable[tuple[str, Buffer]]) -> builtins.list[WriteResult]:
        """Write several objects concurrently (at most ``max_in_flight`` at once).

        Returns results in the order of ``items``. The first failure is raised after
        the requests already started have finished.
        """
        items = list(items)
        started = time.perf_counter()
        results: builtins.list[WriteResult] = self.map(lambda item: self.write(*item), items)
        _log_throughput("wrote", self.uri, sum(r.size for r in results), len(results), started)
        return results

    # -- reads -------------------------------------------------------------------

    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        """Read a whole object or the byte range ``[start, end)`` of it.

        Raises:
            CheckpointNotFoundError: the object does not exist.
            StorageError: any other failure.
        """
        path = self.full_path(relpath)
        try:
            return bytes(self.fs.cat_file(path, start=start or None, end=end))
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.child_uri(relpath)} does not exist") from exc
        except Exception as exc:
            raise StorageError(f"failed to read {self.child_uri(relpath)}: {exc}") from exc

    def read_into(self, relpath: str, out: memoryview, start: int = 0) -> None:
        """Fill ``out`` with the bytes of ``relpath`` starting at ``start``.

        Local files are read straight into ``out`` (no intermediate copy); other
        filesystems fetch the range and copy it once.

        Raises:
            CheckpointNotFoundError: the object does not exist.
            StorageError: the object is shorter than requested, or any other failure.
        """
        out = _as_bytes_view(out)
        path = self.full_path(relpath)
        try:
            if self._is_local:
                with self.fs.open(path, "rb") as f:
                    f.seek(start)
                    got = f.readinto(out)
            else:
                data = self.fs.cat_file(path, start=start, end=start + out.nbytes)
                got = len(data)
                out[:got] = data
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{self.child_uri(relpath)} does not exist") from exc
        except Exception as exc:
            raise StorageError(f"failed to read {self.child_uri(relpath)}: {exc}") from exc
        if got != out.nbytes:
            raise StorageError(
                f"{self.child_uri(relpath)}: read {got} bytes at offset {start}, expected "
                f"{out.nbytes}; the object is truncated"
            )

    def read_into_many(self, items: Sequence[tuple[ReadRequest, memoryview]]) -> None:
        """:meth:`read_into` for many (request, buffer) pairs, concurrently."""
        started = time.perf_counter()
        self.map(lambda item: self.read_into(item[0].path, item[1], item[0].start), items)
        nbytes = sum(memoryview(buf).nbytes for _, buf in items)
        _log_throughput("read", self.uri, nbytes, len(items), started)

    def read_many(self, requests: Sequence[ReadRequest]) -> builtins.list[bytes]:
        """Read several objects or ranges concurrently; results follow ``requests``."""
        started = time.perf_counter()
        results: builtins.list[bytes] = self.map(
            lambda r: self.read(r.path, r.start, r.end), requests
        )
        _log_throughput("read", self.uri, sum(len(b) for b in results), len(results), started)
        return results

    # -- metadata ----------------------------------------------------------------

    def exists(self, relpath: str) -> bool:
        """True when the object ``relpath`` exists."""
        path = self.full_path(relpath)
        try:
            return bool(self.fs.exists(path))
        except Exception as exc:
            raise StorageError(f"failed to stat {self.child_uri(relpath)}: {exc}") from exc

    def list(self, prefix: str = "") -> builtins.list[str]:
        """All object paths below the root (or below ``prefix``), relative, sorted."""
        base = self.full_path(prefix) if prefix else self.root
        try:
            found = self.fs.find(base, withdirs=False) if self.fs.exists(base) else []
        except FileNotFoundError:
            found = []
        except Exception as exc:
            raise StorageError(f"failed to list {self.uri}: {exc}") from exc
        root = self.fs._strip_protocol(self.root).rstrip("/")
        prefix_len = len(root) + 1 if root else 0
        return sorted(self.fs._strip_protocol(p)[prefix_len:] for p in found)

    def is_empty(self) -> bool:
        """True when no object exists below the root."""
        return not self.list()

    def delete(self, relpath: str, recursive: bool = False) -> None:
        """Delete one object, or everything below ``relpath`` with ``recursive``."""
        path = self.full_path(relpath)
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise StorageError(f"failed to delete {self.child_uri(relpath)}: {exc}") from exc

    # -- concurrency -------------------------------------------------------------

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> builtins.list[R]:
        """Apply ``fn`` to ``items`` with at most ``max_in_flight`` running at once."""
        if len(items) <= 1 or self.max_in_flight == 1:
            return [fn(item) for item in items]
        workers = min(self.max_in_flight, len(items))
        with ThreadPoolExecutor(workers, thread_name_prefix="cloudckpt-io") as pool:
            futures = [pool.submit(fn, item) for item in items]
            return [f.result() for f in futures]


def _log_throughput(verb: str, uri: str, nbytes: int, count: int, started: float) -> None:
    elapsed = max(time.perf_counter() - started, 1e-9)
    logger.debug(
        "%s %d objects, %.1f MB in %.3f s (%.1f MB/s) at %s",
        verb,
        count,
        nbytes / 1e6,
        elapsed,
        nbytes / 1e6 / elapsed,
        uri,
    )


def open_checkpoint(
    uri: str | os.PathLike[str],
    fs: fsspec.AbstractFileSystem | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointStorage:
    """Resolve a checkpoint URI (or use ``fs``) into a :class:`CheckpointStorage`."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise CheckpointNotFoundError(f"checkpoint location must be a non-empty URI, got {uri!r}")
    return CheckpointStorage(uri, fs=fs, storage_options=storage_options)
