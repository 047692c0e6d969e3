"""The values the storage layer hands out and takes: what a write produced, a byte
range to read, an open multipart upload. Frozen and slotted; no I/O here."""

from __future__ import annotations

from dataclasses import dataclass

from cloudckpt.storage.blocks import BlockCrcs


@dataclass(frozen=True, slots=True)
class WriteResult:
    """One object of a checkpoint: what a write produced, and what the manifest records.

    Attributes:
        path: object path relative to the checkpoint root (``"layer.w/0.0"``).
        size: bytes written.
        crc32c: CRC-32C (Castagnoli) of the bytes written, as an unsigned int.
        blocks: the CRC-32C of every block of the object (:mod:`.blocks`), measured in
            the same pass; None for objects of at most one block, and for entries of
            version-1 manifests.
    """

    path: str
    size: int
    crc32c: int
    blocks: BlockCrcs | None = None

    def __reduce__(self) -> tuple[type[WriteResult], tuple[str, int, int, BlockCrcs | None]]:
        # pickled by its fields: unpickles several times faster than a slotted
        # dataclass's default (its __setstate__ looks the fields up per object), which
        # matters when a commit gathers every rank's results
        return WriteResult, (self.path, self.size, self.crc32c, self.blocks)


@dataclass(frozen=True, slots=True)
class OpenUpload:
    """A multipart upload started and neither completed nor aborted (S3 only).

    Attributes:
        path: object path relative to the checkpoint root.
        upload_id: the store's id of the upload.
        initiated: when it started, ISO 8601 ("" when the store does not say).
    """

    path: str
    upload_id: str
    initiated: str = ""


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A byte range of one object; ``end=None`` reads to the end of the object."""

    path: str
    start: int = 0
    end: int | None = None
