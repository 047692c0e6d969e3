"""The ``.distcp`` objects of the torch_dist writer, one item appended after another.

Each tensor item is ``torch.save`` bytes (DCP's format), each bytes item the planner's
bytes. An object is assembled one of two ways:

* :class:`BufferedObject`: in an :class:`~cloudckpt.formats.dcp.append_buffer.AppendBuffer`
  sized from the plan, then written whole (object stores, and async saves, whose
  staging keeps the buffers);
* :class:`StreamedObject`: straight into its file through an
  :class:`~cloudckpt.storage.streams.ObjectStream` (local disks): a tensor's storage
  goes from its memory to the file with one ``write()``, as with a ``torch.save`` to a
  file, checksummed on the way. Only the zip headers ``torch.save`` writes around it
  are kept (:class:`_ItemHeaders`), to find where the elements lie within the item
  (:func:`~cloudckpt.formats.dcp.ranges.storage_record_from`).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import IO, Any, Protocol, cast

import torch
from torch.distributed.checkpoint.planner import WriteItem

from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.append_buffer import AppendBuffer
from cloudckpt.formats.dcp.item_templates import ItemTemplates
from cloudckpt.formats.dcp.ranges import (
    RecordedStorageInfo,
    storage_record,
    storage_record_from,
)
from cloudckpt.formats.host_copies import HOST_COPIES
from cloudckpt.storage import WriteResult
from cloudckpt.storage.buffers import Buffer, as_bytes_view
from cloudckpt.storage.streams import SMALL_WRITE, ObjectStream, UploadStream

ITEM_OVERHEAD = 2048  # torch.save's zip records around a tensor's bytes: 1.55-1.58 KB (torch 2.13)


def estimated_size(data: torch.Tensor | io.BytesIO) -> int:
    """The bytes a resolved item will take in its object (a tensor's: at most)."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size() + ITEM_OVERHEAD
    return data.getbuffer().nbytes


def planned_size(item: WriteItem) -> int:
    """The bytes a tensor item will take in its object, from the plan (a bytes item's
    size is known only once it is serialized: 0)."""
    if item.tensor_data is None:
        return 0
    return (
        math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
        + ITEM_OVERHEAD
    )


@contextmanager
def without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each zip record (torch >= 2.6).

    Serializing a tensor into memory ran at 0.95 GB/s with it and 3.0 GB/s without it
    (256 MiB float32, this machine): the CRC was two thirds of the work, and of an async
    save's blocking time. PyTorch's reader never checks it (its miniz is built with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``, since before 1.10), so ``torch.load``,
    PyTorch DCP and Megatron-Core read these items as before; cloudckpt checks every
    byte against its own CRC-32Cs (manifest, blocks). Python's ``zipfile`` would
    refuse to extract such a record (it checks): no reader of DCP items uses it. The
    switch is torch's process-wide setting, restored afterwards (the writer holds it
    for all of its items: switching per item cost about 0.1 ms each); a ``torch.save``
    in another thread meanwhile also skips its CRCs, and is read by torch just as well.
    """
    set_options = getattr(torch.serialization, "set_crc32_options", None)
    get_options = getattr(torch.serialization, "get_crc32_options", None)
    if set_options is None or get_options is None:
        yield
        return
    before = get_options()
    set_options(False)
    try:
        yield
    finally:
        set_options(before)


class DcpObject(Protocol):
    """One ``.distcp`` object being written."""

    path: str

    @property
    def size(self) -> int:
        """Bytes appended so far."""
        ...

    def append(
        self, data: torch.Tensor | io.BytesIO | Any, templates: ItemTemplates
    ) -> RecordedStorageInfo:
        """Append one resolved write item (tensors of a known layout written from
        ``templates``); where it lies in the object."""
        ...


def _slicer(item: memoryview) -> Callable[[int, int], memoryview]:
    def read(offset: int, nbytes: int) -> memoryview:
        return item[offset : offset + nbytes]

    return read


def _not_an_item(data: Any) -> CheckpointingException:
    return CheckpointingException(f"cannot store a {type(data).__name__} as a DCP item")


class BufferedObject:
    """One ``.distcp`` object assembled in memory: items appended to one buffer."""

    def __init__(self, path: str, capacity: int = 0) -> None:
        self.path = path
        self.buffer = AppendBuffer(capacity)

    @property
    def size(self) -> int:
        return self.buffer.tell()

    def append(
        self, data: torch.Tensor | io.BytesIO | Any, templates: ItemTemplates
    ) -> RecordedStorageInfo:
        """Append one resolved write item; returns where it lies in the object (and,
        for a tensor, where its elements lie within the item: see
        :mod:`cloudckpt.formats.dcp.ranges`). A tensor of a layout seen before
        is written from ``templates``."""
        offset = self.size
        record = None
        if isinstance(data, torch.Tensor):
            self.buffer.reserve(estimated_size(data))  # torch.save writes in one pass
            with HOST_COPIES.host(data) as host:
                replayed = templates.write(host, self.buffer)
                if replayed is None:
                    torch.save(host, cast(IO[bytes], self.buffer))  # it only writes
                    with self.buffer.view(offset, self.size) as item:
                        record = storage_record(item)
                        templates.learn(host, record, item.nbytes, _slicer(item))
                else:
                    record = replayed[1]
        elif isinstance(data, io.BytesIO):
            self.buffer.write(data.getbuffer())
        else:
            raise _not_an_item(data)
        return RecordedStorageInfo(self.path, offset, self.size - offset, record=record)

    def payload(self) -> memoryview:
        """The object's bytes (no copy)."""
        return self.buffer.view()


class StreamedObject:
    """One ``.distcp`` object written straight into its file (see the module docstring)."""

    def __init__(self, path: str, stream: ObjectStream | UploadStream) -> None:
        self.path = path
        self.stream = stream

    @property
    def size(self) -> int:
        return self.stream.tell()

    def append(
        self, data: torch.Tensor | io.BytesIO | Any, templates: ItemTemplates
    ) -> RecordedStorageInfo:
        """As :meth:`BufferedObject.append`."""
        offset = self.size
        record = None
        if isinstance(data, torch.Tensor):
            with HOST_COPIES.host(data) as host, self._sent_from(data, host):
                replayed = templates.write(host, self.stream)
                if replayed is None:
                    headers = _ItemHeaders(self.stream)
                    headers.save(host)
                    record = storage_record_from(headers.bytes_at, headers.size)
                    templates.learn(host, record, headers.size, headers.bytes_at)
                else:
                    record = replayed[1]
        elif isinstance(data, io.BytesIO):
            self.stream.write(data.getbuffer())
        else:
            raise _not_an_item(data)
        return RecordedStorageInfo(self.path, offset, self.size - offset, record=record)

    def _sent_from(self, data: torch.Tensor, host: torch.Tensor) -> AbstractContextManager[None]:
        """An upload stream sends a CPU tensor's bytes from its own memory (``host`` is
        the caller's tensor or a copy made for this item alone, kept alive by the
        stream until it ends); a device tensor's host copy is a reused buffer, which
        the next item overwrites: its bytes are copied."""
        if data.device.type == "cpu":
            return self.stream.referencing(host)
        return nullcontext()

    def finish(self) -> WriteResult:
        """Close the object; its size and checksums."""
        return self.stream.finish()

    def abort(self) -> None:
        """Close and remove the object (a no-op once finished)."""
        self.stream.abort()


class _ItemHeaders(io.RawIOBase):
    """Passes one ``torch.save`` item on to a stream, keeping a copy of its small
    writes (the zip headers and directory, and small tensors' bytes) by offset within
    the item: what :func:`~cloudckpt.formats.dcp.torch_zip.find_storage` reads.

    The stream's first error is kept and raised by :meth:`save`: ``torch.save``'s zip
    writer does not pass on an exception of its write callback, it fails later with an
    error of its own (``[enforce fail at inline_container.cc:672] . unexpected pos 704
    vs 598``: a full disk under torch_dist), which names neither the cause nor the
    object."""

    def __init__(self, sink: ObjectStream | UploadStream) -> None:
        super().__init__()
        self._sink = sink
        self.size = 0
        self._runs: list[tuple[int, bytearray]] = []  # (offset, consecutive small writes)
        self._open = False  # whether the last run is still growing
        self._failure: Exception | None = None

    def save(self, tensor: torch.Tensor) -> None:
        """``torch.save(tensor)`` into the stream; the stream's first error (a
        ``StorageError`` naming the object) is raised in place of torch's."""
        try:
            torch.save(tensor, cast(IO[bytes], self))  # it only writes
        except Exception:
            if self._failure is None:
                raise
        if self._failure is not None:
            raise self._failure from self._failure.__cause__

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data: Buffer) -> int:  # type: ignore[override]
        view = as_bytes_view(data)
        nbytes = view.nbytes
        if nbytes < SMALL_WRITE:
            if not self._open:
                self._runs.append((self.size, bytearray()))
                self._open = True
            self._runs[-1][1].extend(view)
        else:
            self._open = False
        if self._failure is not None:  # torch writes on after an error it ignored
            raise self._failure
        try:
            self._sink.write(view)
        except Exception as exc:
            self._failure = exc
            raise
        self.size += nbytes
        return nbytes

    def bytes_at(self, offset: int, nbytes: int) -> memoryview | None:
        """The item's bytes ``[offset, offset + nbytes)`` if one run holds them."""
        for start, run in reversed(self._runs):
            if start <= offset and offset + nbytes <= start + len(run):
                return memoryview(run)[offset - start : offset - start + nbytes]
        return None


__all__ = [
    "ITEM_OVERHEAD",
    "BufferedObject",
    "DcpObject",
    "StreamedObject",
    "estimated_size",
    "planned_size",
    "without_zip_crc32",
]
