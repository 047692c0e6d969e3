"""Reads checked against a manifest: what it recorded of each object (size, CRC-32C,
block CRCs) is compared with what a read returns. A whole object's bytes are checked
against its CRC-32C; a range against the CRC-32C of every block it covers (the reader
widens it to those blocks, :mod:`.blocks`); an object of at most one block is its own
single block. Only ranges of large objects of a version-1 manifest (no block CRCs) are
checked against the recorded size alone."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cloudckpt.errors import CheckpointNotFoundError, CorruptObjectError, StorageError
from cloudckpt.storage.blocks import BLOCK_SIZE, BlockCrcs, block_mismatches
from cloudckpt.storage.buffers import Buffer, as_bytes_view, crc32c
from cloudckpt.storage.retry import current_rank
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
                f"{self.child_uri(relpath)} has {data.nbytes} bytes (read on rank "
                f"{current_rank()}); the manifest recorded {entry.size}"
            )
        actual = crc32c(data)
        if actual != entry.crc32c:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: CRC-32C {actual:#010x} of bytes 0-{entry.size} "
                f"(the whole object, read on rank {current_rank()}) differs from the "
                f"manifest's {entry.crc32c:#010x}; the object is corrupt or was damaged in "
                "transit"
            )

    def blocks_of(self, relpath: str) -> BlockCrcs | None:
        """The blocks a ranged read of ``relpath`` is checked against: the manifest's
        block CRCs; for an object of at most one block, that one block (its CRC is the
        object's); None for an unlisted object or a large one of a version-1 manifest."""
        entry = self.entries.get(relpath)
        if entry is None:
            return None
        if entry.blocks is not None:
            return entry.blocks
        if entry.size > BLOCK_SIZE:
            return None
        return BlockCrcs.of(max(entry.size, 1), [entry.crc32c] if entry.size else [])

    def check_blocks(self, relpath: str, offset: int, data: Buffer) -> None:
        """Raise unless every block of ``data`` (whole blocks of ``relpath`` from block
        boundary ``offset``) has the CRC-32C the manifest recorded for it."""
        self.check_segments(relpath, offset, [data])

    def check_segments(self, relpath: str, offset: int, segments: Sequence[Buffer]) -> None:
        """:meth:`check_blocks` of the concatenation of ``segments`` (a block may span
        several)."""
        blocks = self.blocks_of(relpath)
        if blocks is None:
            return
        bad = block_mismatches(segments, offset, blocks)
        if not bad:
            return
        size = blocks.block_size
        index, actual = bad[0]
        first = index * size
        length = min(size, sum(as_bytes_view(s).nbytes for s in segments) + offset - first)
        raise CorruptObjectError(
            f"{self.child_uri(relpath)}: bytes {first}-{first + length} (block "
            f"{index} of {len(blocks)}, {size}-byte blocks) read on rank {current_rank()} "
            f"have CRC-32C {actual:#010x}; the manifest recorded "
            f"{blocks.crc(index):#010x}; the object is corrupt or was damaged in transit"
            + (f" ({len(bad)} blocks differ)" if len(bad) > 1 else "")
        )

    def check_length(self, relpath: str, start: int, expected: int, got: int) -> None:
        """Raise when a ranged read returned ``got`` bytes instead of ``expected``."""
        if got != expected:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: read {got} bytes at offset {start} on rank "
                f"{current_rank()}, expected {expected}; the object is truncated"
            )

    def checks_blocks(self, request: ReadRequest) -> bool:
        """A non-empty range of a listed object that is not all of it, to be checked
        against its blocks (whole reads are checked against the object's CRC-32C;
        with ``verify_checksums`` objects are read whole)."""
        size = self.size(request.path)
        if size is None or self.verify_checksums:
            return False
        end = size if request.end is None else request.end
        whole = request.start == 0 and end == size
        inside = request.start < end <= size
        return inside and not whole and self.blocks_of(request.path) is not None

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
