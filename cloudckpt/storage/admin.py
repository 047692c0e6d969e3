"""What operators and the commit protocol ask of a location besides data: existence,
listings (objects only), open multipart uploads, deletes. Every request is the
transport's, so on S3 it runs under cloudckpt's retries and deadlines."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from typing import TypeVar

from cloudckpt.errors import StorageError
from cloudckpt.storage import listing
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.handle import StorageHandle
from cloudckpt.storage.types import OpenUpload

T = TypeVar("T")
R = TypeVar("R")


class StorageAdmin(StorageHandle):
    """The metadata half of :class:`~cloudckpt.storage.CheckpointStorage`."""

    def exists(self, relpath: str) -> bool:
        """True when the object ``relpath`` exists (a prefix or directory is not one)."""
        path = self.full_path(relpath)
        try:
            return self.transport.is_file(path)
        except io_errors() as exc:
            raise translate(exc, f"failed to stat {self.child_uri(relpath)}: {exc}") from exc

    def list(self, prefix: str = "") -> builtins.list[str]:
        """All object paths below the root (or below ``prefix``), relative, sorted.
        Objects only, on every store (see :meth:`list_sizes`)."""
        return builtins.list(self.list_sizes(prefix))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``{relative path: size}`` of every object below the root (or ``prefix``),
        sorted, from one recursive listing (no object is opened). Objects only: no
        "directory" entries, directory-marker keys or the root itself."""
        base = self.full_path(prefix) if prefix else self.root
        return listing.list_sizes(self.transport, base)

    def list_children(self) -> builtins.list[str]:
        """Names of the immediate sub-prefixes (directories) of the root, sorted.

        On a store that keeps empty "directories" (SeaweedFS) a prefix whose objects
        were all deleted may still be listed here; it holds no object (:meth:`list`)."""
        return listing.list_children(self.transport)

    def root_is_directory(self) -> bool:
        """True when the root is an existing directory (local disks: one may exist
        empty; object stores have no directories)."""
        try:
            return self.transport.is_directory(self.root)
        except io_errors() as exc:
            raise translate(exc, f"failed to stat {self.uri}: {exc}") from exc

    def is_empty(self) -> bool:
        """True when no object exists below the root."""
        return not self.list()

    def open_uploads(self) -> builtins.list[OpenUpload]:
        """Multipart uploads open below the root (S3 only; other stores have none)."""
        try:
            return self.transport.open_uploads()
        except io_errors() as exc:
            raise translate(exc, f"failed to list the uploads of {self.uri}: {exc}") from exc

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort an open multipart upload (its parts are deleted by the store)."""
        try:
            self.transport.abort_upload(upload)
        except io_errors() as exc:
            raise translate(
                exc,
                f"failed to abort multipart upload {upload.upload_id} of "
                f"{self.child_uri(upload.path)}: {exc}",
            ) from exc

    def delete(self, relpath: str, recursive: bool = False) -> None:
        """Delete one object, or everything below ``relpath`` with ``recursive``."""
        path = self.full_path(relpath)
        try:
            self.transport.delete(path, recursive=recursive)
        except FileNotFoundError:
            return
        except io_errors() as exc:
            raise translate(exc, f"failed to delete {self.child_uri(relpath)}: {exc}") from exc
        except ValueError as exc:  # fsspec's local rm refuses a directory so
            raise StorageError(f"failed to delete {self.child_uri(relpath)}: {exc}") from exc

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> builtins.list[R]:
        """Apply ``fn`` to ``items`` with at most ``max_in_flight`` running at once
        (after the first failure the rest are skipped; the first error is raised)."""
        return self.pool.map(fn, items)
