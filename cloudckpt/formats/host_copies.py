"""Device-to-host copies of the torch_dist writer, into pinned buffers reused across saves.

``torch.save`` of a CUDA tensor would record its device, so the writer copies every
device tensor to host memory before serializing it. Pinned (page-locked) host memory
takes that copy at the full speed of the link, but pinning is slow (measured on an H200:
1.2 s to pin 2.1 GB, against 0.08 s to copy it), so :class:`HostCopies` keeps the
buffers, one per (dtype, shape), and the next item or the next save of the same state
(every save of a training run holds the same tensors) reuses them. ``torch.save``
writes whole storages, so a buffer is exactly its tensor's size, never a view of a
larger one.

Pinned exactly: ``tensor.pin_memory()`` / ``torch.empty(..., pin_memory=True)`` go
through PyTorch's caching host allocator, which rounds every block up to a power of two
(a 1.1 GB tensor takes 2 GB of page-locked memory) and keeps freed blocks. A buffer of
``register_min_bytes`` or more is instead anonymous memory of its own pages
(``mmap``), registered with CUDA (``cudaHostRegister``, as PyTorch DCP's staging does)
for exactly its size and unregistered when dropped. Smaller ones use the caching
allocator (their rounding costs little). If registering fails, the caching allocator is
used from then on (logged once).

Bounded: at most ``max(limit_bytes, the last staging)`` bytes are kept. An async save's
staging (:meth:`HostCopies.copies`, held until :meth:`HostCopies.release`) keeps its
buffers for the next one: the state once, the bound the issue asks for. Buffers of
shapes the last staging did not use are dropped then (the structure changed). A sync
save's items (:meth:`HostCopies.host`) keep at most ``limit_bytes`` (one buffer per
shape in use).

CUDA only: CPU tensors are serialized as they are (:func:`to_host` copies only a view
that does not own its storage) and staged into fresh copies (``keep_cpu`` keeps them
too). The CUDA branches are checked on a GPU by ``benchmarks/check_cuda.py`` (never by
the test suite: CI has no GPU); the reuse and bounds logic is tested with unpinned
buffers and with registering functions that record their calls.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.errors import CheckpointingException

logger = logging.getLogger(__name__)

DEFAULT_LIMIT_BYTES = 1024**3
REGISTER_MIN_BYTES = 1 << 20
_Key = tuple[torch.dtype, tuple[int, ...]]
_CUDA_HOST_REGISTER_PORTABLE = 1


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_register(data_ptr: int, nbytes: int) -> None:
    code = int(_cudart().cudaHostRegister(data_ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if code != 0:
        raise CheckpointingException(f"cudaHostRegister of {nbytes} bytes failed: error {code}")


def _cuda_unregister(data_ptr: int) -> None:
    code = int(_cudart().cudaHostUnregister(data_ptr))
    if code != 0:
        logger.warning("cudaHostUnregister failed: error %s", code)


@dataclass(frozen=True)
class Registrar:
    """How a buffer's own memory is pinned and unpinned (CUDA's by default)."""

    register: Callable[[int, int], None] = _cuda_register
    unregister: Callable[[int], None] = _cuda_unregister


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
        register_min_bytes: int = REGISTER_MIN_BYTES,
        registrar: Registrar | None = None,
    ) -> None:
        self.limit_bytes = limit_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.keep_cpu = keep_cpu  # copies(): CPU tensors into kept buffers too
        self.register_min_bytes = register_min_bytes
        self._registrar = registrar or Registrar()
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lent: set[int] = set()  # ids of the buffers handed out by copies()
        # data_ptr -> (bytes registered, the mapping): held here too, so a registered
        # mapping is never unmapped before it is unregistered
        self._registered: dict[int, tuple[int, mmap.mmap]] = {}
        self._register_ok = True
        self._kept = 0
        self._staged = 0  # bytes of the last copies(): kept up to that much
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes held for reuse."""
        return self._kept

    @property
    def registered_bytes(self) -> int:
        """Bytes of the buffers pinned by registering their own memory (kept or lent)."""
        with self._lock:
            return sum(nbytes for nbytes, _ in self._registered.values())

    def kept_buffers(self) -> list[torch.Tensor]:
        """The buffers held for reuse (for checks and benchmarks)."""
        with self._lock:
            return [b for free in self._free.values() for b in free]

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
        keys: set[_Key] = set()
        staged = 0
        for source in tensors:
            data = source.detach()
            if data.device.type == "cpu" and not self.keep_cpu:
                out.append(data.to("cpu", copy=True, memory_format=torch.contiguous_format))
                continue
            key: _Key = (data.dtype, tuple(data.shape))
            buffer = self._take(key)
            buffer.copy_(data, non_blocking=self.pin)
            devices.add(data.device)
            keys.add(key)
            staged += _nbytes(buffer)
            with self._lock:
                self._lent.add(id(buffer))
            out.append(buffer)
        self._staged = staged
        self._drop_other_shapes(keys)
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
        return self._allocate(key)

    def _allocate(self, key: _Key) -> torch.Tensor:
        dtype, shape = key
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        numel = 1
        for size in shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        if self._register_ok and nbytes >= max(self.register_min_bytes, 1):
            try:
                return self._registered_buffer(dtype, shape, numel, nbytes)
            except (
                CheckpointingException,
                RuntimeError,
                AttributeError,
                TypeError,
                ValueError,
            ) as exc:
                logger.warning(
                    "pinning host buffers by registering them failed (%s): using PyTorch's "
                    "pinned allocator from now on (its blocks are rounded up to a power of two)",
                    exc,
                )
                self._register_ok = False
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _registered_buffer(
        self, dtype: torch.dtype, shape: tuple[int, ...], numel: int, nbytes: int
    ) -> torch.Tensor:
        """A tensor over anonymous memory of its own pages, exactly ``nbytes`` long (the
        storage owns exactly its elements), registered with CUDA."""
        region = mmap.mmap(-1, nbytes)  # the tensor's storage keeps the mapping alive
        buffer = torch.frombuffer(region, dtype=dtype, count=numel).view(shape)
        self._registrar.register(buffer.data_ptr(), nbytes)
        with self._lock:
            self._registered[buffer.data_ptr()] = (nbytes, region)
        return buffer

    def _drop(self, buffer: torch.Tensor) -> None:
        """Let ``buffer`` go, unregistering its memory first if it was registered."""
        with self._lock:
            registered = self._registered.pop(buffer.data_ptr(), None)
        if registered is not None:
            self._registrar.unregister(buffer.data_ptr())

    def _give(self, key: _Key, buffer: torch.Tensor) -> None:
        with self._lock:
            keep = self._kept + _nbytes(buffer) <= max(self.limit_bytes, self._staged)
            if keep:
                self._free.setdefault(key, []).append(buffer)
                self._kept += _nbytes(buffer)
        if not keep:
            self._drop(buffer)

    def _drop_other_shapes(self, keys: set[_Key]) -> None:
        """Drop the kept buffers of shapes a staging did not use (the state changed)."""
        with self._lock:
            stale = [k for k in self._free if k not in keys]
            dropped = [b for k in stale for b in self._free.pop(k)]
            self._kept -= sum(_nbytes(b) for b in dropped)
        for buffer in dropped:
            self._drop(buffer)

    def clear(self) -> None:
        """Free every kept buffer (lent ones are dropped when released)."""
        with self._lock:
            dropped = [b for free in self._free.values() for b in free]
            self._free.clear()
            self._kept = 0
            self._staged = 0
        for buffer in dropped:
            self._drop(buffer)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


HOST_COPIES = HostCopies()
"""The process's buffers, shared by every save (pinned when CUDA is available)."""

__all__ = ["HOST_COPIES", "HostCopies", "to_host"]
