"""Pure helpers for moving bytes: buffers, part plans, checksums and progress.

Nothing here does I/O; :mod:`cloudckpt.storage` uses these to stream tensor memory
to object stores without copying it:

* :func:`as_bytes_view` turns any buffer into a flat byte ``memoryview``;
* :class:`BufferReader` is a seekable file over a memoryview (botocore wants a file
  or ``bytes`` as a request body; a memoryview slice is neither);
* :func:`plan_parts` cuts an object into multipart-upload parts (or a download into
  ranges) within S3's limits;
* :class:`Progress` logs bytes, objects and MB/s of a long transfer at a bounded rate.
"""

from __future__ import annotations

import base64
import io
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from crc32c import crc32c as _crc32c

from cloudckpt.config import S3_MAX_PARTS, MiB

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

PROGRESS_INTERVAL_S = 10.0
"""How often a long transfer logs its progress at INFO."""


def crc32c(data: Buffer, crc: int = 0) -> int:
    """CRC-32C of ``data``, continuing from ``crc`` (pass the previous value to extend)."""
    return int(_crc32c(data, crc))


def crc32c_base64(value: int) -> str:
    """A CRC-32C as S3 expects it in ``x-amz-checksum-crc32c``: big-endian, base64."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat, byte-formatted view of ``data`` (no copy)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def plan_parts(size: int, part_size: int, max_parts: int = S3_MAX_PARTS) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` that cut ``size`` bytes into parts of ``part_size``.

    When ``size`` would need more than ``max_parts`` parts, the part size grows (in
    whole MiB) until it does not. The last part may be shorter; a zero-byte object
    is one empty part.
    """
    if part_size < 1:
        raise ValueError(f"part_size must be >= 1, got {part_size}")
    if size > part_size * max_parts:
        part_size = -(-size // (max_parts * MiB)) * MiB
    if size == 0:
        return [(0, 0)]
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


class BufferReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview, without copying it.

    Slicing (``reader[a:b]``) returns another reader over the same memory.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = as_bytes_view(view)
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def __getitem__(self, index: slice) -> BufferReader:
        return BufferReader(self._view[index])

    def remaining(self) -> memoryview:
        """The bytes from the current position on (no copy)."""
        return self._view[self._pos :]

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all the rest for -1), copied once into ``bytes``."""
        end = self._view.nbytes if size is None or size < 0 else self._pos + size
        chunk = self._view[self._pos : end]
        self._pos += chunk.nbytes
        return chunk.tobytes()

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._view[self._pos : self._pos + target.nbytes]
        target[: chunk.nbytes] = chunk
        self._pos += chunk.nbytes
        return chunk.nbytes

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class SegmentsReader(io.RawIOBase):
    """A seekable, read-only file over the concatenation of several memoryviews (one
    request body made of pieces of different buffers), without joining them."""

    def __init__(self, segments: Sequence[memoryview]) -> None:
        super().__init__()
        self._segments = [as_bytes_view(s) for s in segments if s.nbytes]
        self._size = sum(s.nbytes for s in self._segments)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def remaining(self) -> list[memoryview]:
        """The pieces from the current position on (no copy)."""
        out, skip = [], self._pos
        for segment in self._segments:
            if skip >= segment.nbytes:
                skip -= segment.nbytes
                continue
            out.append(segment[skip:])
            skip = 0
        return out

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all the rest for -1), copied into ``bytes``."""
        left = self._size - self._pos if size is None or size < 0 else size
        out = bytearray()
        for segment in self.remaining():
            if len(out) >= left:
                break
            out += segment[: left - len(out)]
        self._pos += len(out)
        return bytes(out)

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        data = self.read(target.nbytes)
        target[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(self._size, max(0, base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos


class Progress:
    """Thread-safe byte counter for one transfer; logs at most every ``interval`` s.

    Args:
        verb: "wrote" or "read", for the messages.
        uri: the checkpoint URI (already redacted).
        total_bytes: bytes the transfer will move.
        count: objects (or ranges) in the transfer.
    """

    def __init__(
        self,
        verb: str,
        uri: str,
        total_bytes: int,
        count: int,
        interval: float = PROGRESS_INTERVAL_S,
    ) -> None:
        self.verb, self.uri, self.total, self.count = verb, uri, total_bytes, count
        self.done = 0
        self._interval = interval
        self._started = self._last_log = time.perf_counter()
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """Record ``nbytes`` more moved; log progress when the interval has passed."""
        with self._lock:
            self.done += nbytes
            now = time.perf_counter()
            if now - self._last_log < self._interval:
                return
            self._last_log = now
            done, elapsed = self.done, now - self._started
        logger.info(
            "%s %.1f of %.1f MB (%.0f%%, %.1f MB/s) at %s",
            self.verb,
            done / 1e6,
            self.total / 1e6,
            100.0 * done / max(self.total, 1),
            done / 1e6 / max(elapsed, 1e-9),
            self.uri,
        )

    def finish(self) -> None:
        """Log the totals at DEBUG."""
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        logger.debug(
            "%s %d objects, %.1f MB in %.3f s (%.1f MB/s) at %s",
            self.verb,
            self.count,
            self.done / 1e6,
            elapsed,
            self.done / 1e6 / elapsed,
            self.uri,
        )
