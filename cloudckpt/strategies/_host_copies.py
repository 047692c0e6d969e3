"""Device-to-host copies of the torch_dist writer, into pinned buffers reused across saves.

``torch.save`` of a CUDA tensor would record its device, so the writer copies every
device tensor to host memory before serializing it. Pinned (page-locked) host memory
takes that copy at the full speed of the link, but pinning is slow (``cudaHostAlloc``
takes milliseconds per buffer), so :class:`HostCopies` keeps the buffers, one per
(dtype, shape), and the next item or the next save of the same state (every save of a
training run holds the same tensors) reuses them. ``torch.save`` writes whole storages,
so a buffer is exactly its tensor's size, never a view of a larger one. At most
``limit_bytes`` are kept; a buffer beyond that is freed after use.

CUDA only: CPU tensors are serialized as they are (:func:`to_host` copies only a view
that does not own its storage). This machine has no GPU: the CUDA branch is checked by
review; the reuse logic is tested with unpinned buffers (``pin=False``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

DEFAULT_LIMIT_BYTES = 1024**3
_Key = tuple[torch.dtype, tuple[int, ...]]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor owning exactly its elements (``torch.save`` writes whole storages)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu").contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    owns = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes
    if owns and tensor.is_contiguous():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


class HostCopies:
    """Reusable host buffers for device tensors (see the module docstring)."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES, pin: bool | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[_Key, torch.Tensor] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes held for reuse."""
        return self._kept

    @contextmanager
    def host(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """``tensor`` on the host for the duration of the block: CPU tensors as
        :func:`to_host` gives them, device tensors copied into a reused buffer."""
        if tensor.device.type == "cpu":
            yield to_host(tensor)
            return
        with self.staged(tensor) as buffer:  # pragma: no cover - needs a GPU
            yield buffer

    @contextmanager
    def staged(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """``tensor`` copied into a kept buffer of its dtype and shape (allocated, and
        pinned when ``pin``, on first use), returned to the pool after the block."""
        key: _Key = (tensor.dtype, tuple(tensor.shape))
        with self._lock:
            buffer = self._free.pop(key, None)
            if buffer is not None:
                self._kept -= _nbytes(buffer)
        if buffer is None:
            buffer = torch.empty(key[1], dtype=key[0], pin_memory=self.pin)
        buffer.copy_(tensor.detach(), non_blocking=self.pin)
        if self.pin and tensor.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(tensor.device).synchronize()  # the bytes are on the host
        try:
            yield buffer
        finally:
            self._give(key, buffer)

    def _give(self, key: _Key, buffer: torch.Tensor) -> None:
        with self._lock:
            if key not in self._free and self._kept + _nbytes(buffer) <= self.limit_bytes:
                self._free[key] = buffer
                self._kept += _nbytes(buffer)

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._free.clear()
            self._kept = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


HOST_COPIES = HostCopies()
"""The process's buffers, shared by every save (pinned when CUDA is available)."""

__all__ = ["HOST_COPIES", "HostCopies", "to_host"]
