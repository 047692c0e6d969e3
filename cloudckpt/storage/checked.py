"""Reads checked against a manifest: what it recorded of each object (size, CRC-32C)
is compared with what a read returns, at no extra I/O (a whole object's bytes are
checksummed as they arrive; a range is checked against the recorded size)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cloudckpt.errors import CheckpointNotFoundError, CorruptObjectError, StorageError
from cloudckpt.storage.buffers import crc32c
from cloudckpt.storage.types import ReadRequest, WriteResult


@dataclass(frozen=True)
class Expected:
    """What a manifest recorded, by relative path, and how strictly to check reads.

    Attributes:
        entries: path -> the object's size and CRC-32C.
        verify_checksums: check the CRC-32C of objects only partly needed too (they
            are then read whole).
        child_uri: names an object in messages.
    """

    entries: Mapping[str, WriteResult] = field(default_factory=dict)
    verify_checksums: bool = False
    child_uri: Callable[[str], str] = str

    def __contains__(self, relpath: object) -> bool:
        return relpath in self.entries

    def check_whole(self, relpath: str, data: memoryview) -> None:
        """Raise unless ``data`` is the object's recorded size and CRC-32C."""
        entry = self.entries.get(relpath)
        if entry is None:
            return
        if data.nbytes != entry.size:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)} has {data.nbytes} bytes; the manifest recorded "
                f"{entry.size}"
            )
        actual = crc32c(data)
        if actual != entry.crc32c:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: CRC-32C {actual:#010x} differs from the "
                f"manifest's {entry.crc32c:#010x}; the object is corrupt"
            )

    def check_range(self, relpath: str, start: int, end: int) -> None:
        """Raise when ``[start, end)`` goes past the object's recorded size."""
        entry = self.entries.get(relpath)
        if entry is not None and end > entry.size:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: bytes {start}-{end} requested, but the manifest "
                f"recorded {entry.size} bytes for this object"
            )

    def size(self, relpath: str) -> int | None:
        """The recorded size, or None when the manifest does not list the object."""
        entry = self.entries.get(relpath)
        return None if entry is None else entry.size

    def is_whole(self, request: ReadRequest, nbytes: int) -> bool:
        """True when ``nbytes`` from ``request.start`` cover the whole listed object."""
        return request.start == 0 and nbytes == self.size(request.path)

    def needs_whole_read(self, request: ReadRequest, nbytes: int) -> bool:
        """A partial read of a listed object, when checksums must be verified anyway."""
        listed = request.path in self.entries
        return listed and self.verify_checksums and not self.is_whole(request, nbytes)

    def not_found(self, relpath: str) -> StorageError | CheckpointNotFoundError:
        """A missing object: damage when the manifest lists it (a ``CorruptObjectError``,
        deliberately not a ``FileNotFoundError``: a training loop's ``except
        FileNotFoundError: start fresh`` must not restart on a damaged checkpoint)."""
        if relpath in self.entries:
            return CorruptObjectError(
                f"{self.child_uri(relpath)} is listed in the manifest but does not exist; "
                "the checkpoint is damaged (`cloudckpt verify` shows what is missing)"
            )
        return CheckpointNotFoundError(f"{self.child_uri(relpath)} does not exist")
