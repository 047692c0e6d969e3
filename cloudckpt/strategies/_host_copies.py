"""Device-to-host copies of the torch_dist writer, into pinned buffers reused across saves.

``torch.save`` of a CUDA tensor would record its device, so the writer copies every
device tensor to host memory before serializing it. Pinned (page-locked) host memory
takes that copy at the full speed of the link, but pinning is slow (``cudaHostAlloc``
takes milliseconds per buffer), so :class:`HostCopies` keeps the buffers, one per
(dtype, shape), and the next item or the next save of the same state (every save of a
training run holds the same tensors) reuses them. ``torch.save`` writes whole storages,
so a buffer is exactly its tensor's size, never a view of a larger one. At most
``limit_bytes`` are kept; a buffer beyond that is freed after use.

An async save's staging holds its copies until the upload is done (:meth:`HostCopies.copies`,
:meth:`HostCopies.release`): the next save's staging reuses them, several per (dtype,
shape), within the same limit.

CUDA only: CPU tensors are serialized as they are (:func:`to_host` copies only a view
that does not own its storage) and staged into fresh copies (``keep_cpu`` keeps them
too). This machine has no GPU: the CUDA branch is checked by review; the reuse logic is
tested with unpinned buffers (``pin=False``, ``keep_cpu=True``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
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

    def __init__(
        self,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        pin: bool | None = None,
        keep_cpu: bool = False,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.keep_cpu = keep_cpu  # copies(): CPU tensors into kept buffers too
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lent: set[int] = set()  # ids of the buffers handed out by copies()
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
        buffer = self._take(key)
        buffer.copy_(tensor.detach(), non_blocking=self.pin)
        if self.pin and tensor.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.current_stream(tensor.device).synchronize()  # the bytes are on the host
        try:
            yield buffer
        finally:
            self._give(key, buffer)

    def copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` that the caller holds until :meth:`release` (an
        async save's staging): device tensors (and CPU ones with ``keep_cpu``) copied
        into kept buffers (pinned when ``pin``; all copies issued, then one wait per
        device), other CPU tensors into fresh contiguous ones (by default a process
        training on the CPU keeps no second copy of its state between saves)."""
        out: list[torch.Tensor] = []
        devices: set[torch.device] = set()
        for source in tensors:
            data = source.detach()
            if data.device.type == "cpu" and not self.keep_cpu:
                out.append(data.to("cpu", copy=True, memory_format=torch.contiguous_format))
                continue
            buffer = self._take((data.dtype, tuple(data.shape)))
            buffer.copy_(data, non_blocking=self.pin)
            devices.add(data.device)
            with self._lock:
                self._lent.add(id(buffer))
            out.append(buffer)
        for device in devices:
            if device.type == "cuda":  # pragma: no cover - needs a GPU
                torch.cuda.current_stream(device).synchronize()  # every byte is on the host
        return out

    def release(self, copies: Sequence[torch.Tensor]) -> None:
        """Take back the kept buffers among ``copies`` (from :meth:`copies`) for the next
        save; the others are left to the caller."""
        for buffer in copies:
            with self._lock:
                if id(buffer) not in self._lent:
                    continue
                self._lent.discard(id(buffer))
            self._give((buffer.dtype, tuple(buffer.shape)), buffer)

    def _take(self, key: _Key) -> torch.Tensor:
        """A kept buffer of ``key``, else a new one (pinned when ``pin``)."""
        with self._lock:
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self._kept -= _nbytes(buffer)
                return buffer
        return torch.empty(key[1], dtype=key[0], pin_memory=self.pin)

    def _give(self, key: _Key, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._kept + _nbytes(buffer) <= self.limit_bytes:
                self._free.setdefault(key, []).append(buffer)
                self._kept += _nbytes(buffer)

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._free.clear()
            self._lent.clear()
            self._kept = 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


HOST_COPIES = HostCopies()
"""The process's buffers, shared by every save (pinned when CUDA is available)."""

__all__ = ["HOST_COPIES", "HostCopies", "to_host"]
