"""A write-only, growable byte buffer for ``torch.save`` (the torch_dist writer's objects).

``torch.save`` into an ``io.BytesIO`` ran at 0.19 GB/s here (256 MiB float32, 2-core
machine), against 3.8 GB/s for a memcpy of the same bytes: the BytesIO grows in small
steps, copying what it holds each time. Into a buffer reserved for the item's size it
ran at 0.95 GB/s (the rest is the CRC-32 that torch's zip writer computes for each
record; 3.0 GB/s without it). :class:`AppendBuffer` is that buffer: the caller
:meth:`~AppendBuffer.reserve` s the bytes it expects before each item, or sizes it up
front; a write past the capacity still succeeds, at the cost of one copy into a buffer
twice as large. Its memory is an uninitialized ``torch.empty`` block: not zeroed (a
``bytearray`` of 256 MiB took 0.26 s to zero, ``torch.empty`` 7 ms), and pages never
written stay unallocated, so an object sized for ``object_size`` costs only what it
holds.
"""

from __future__ import annotations

import io

import torch

from cloudckpt.storage.buffers import Buffer, as_bytes_view


class AppendBuffer(io.RawIOBase):
    """Bytes appended at the end (``write``), viewed without a copy (:meth:`view`)."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self._block = torch.empty(capacity, dtype=torch.uint8)
        self._data = _view_of(self._block)
        self._size = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds without growing."""
        return len(self._data)

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` more bytes (a copy only when it grows)."""
        needed = self._size + nbytes
        if needed > len(self._data):
            block = torch.empty(max(needed, 2 * len(self._data)), dtype=torch.uint8)
            block[: self._size].copy_(self._block[: self._size])
            self._block, self._data = block, _view_of(block)

    def write(self, data: Buffer) -> int:  # type: ignore[override]
        view = as_bytes_view(data)
        nbytes = view.nbytes
        self.reserve(nbytes)
        self._data[self._size : self._size + nbytes] = view
        self._size += nbytes
        return nbytes

    def view(self, start: int = 0, end: int | None = None) -> memoryview:
        """The bytes written, or those of ``[start, end)`` (no copy; while a view is
        alive the buffer cannot grow: take it when writing is done)."""
        end = self._size if end is None else end
        return self._data[start:end]


def _view_of(block: torch.Tensor) -> memoryview:
    return block.numpy().data.cast("B")


__all__ = ["AppendBuffer"]
