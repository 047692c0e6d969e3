"""``torch.save`` bytes of a tensor item, replayed from an earlier item of the same layout.

``torch.save`` of a plain CPU tensor that owns its storage writes a zip archive whose
bytes depend only on the tensor's layout (dtype, shape, strides, storage size) and on
its elements, which fill one record: the writer switches off torch's zip CRC-32
(:func:`~cloudckpt.formats.dcp.objects.without_zip_crc32`), so no header holds
a checksum of the elements. Only the ``.data/serialization_id`` record differs from
one archive to the next (an id no reader checks: ``torch.load``, PyTorch DCP and
Megatron-Core ignore it). A training state holds many tensors of few layouts (every
layer's weights alike, and their optimizer states): ``torch.save`` costs about 0.3 ms
per tensor in Python (pickling, zip records), so :class:`ItemTemplates` keeps, per
layout seen in one save, the item's bytes before and after its elements, and writes
the next tensor of that layout as those bytes around its own elements - the bytes
``torch.save`` would write, with the first item's serialization id.

Only tensors whose pickle cannot hold anything else are replayed: exactly
``torch.Tensor`` (no subclass, no Python attributes, no extra metadata), strided,
on the CPU, without ``requires_grad``, conjugate or negative bits, owning exactly its
storage from offset 0. Anything else is serialized by ``torch.save`` every time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cloudckpt.formats.dcp.ranges import Record
from cloudckpt.storage.buffers import Buffer

Layout = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]


class Sink(Protocol):
    """Where an item's bytes go (a buffer or a stream)."""

    def write(self, data: Buffer) -> int:
        """Append ``data``."""
        ...


def layout_of(tensor: torch.Tensor) -> Layout | None:
    """The layout that determines ``tensor``'s item bytes besides its elements, or
    None when its pickle may depend on more (see the module docstring)."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout is not torch.strided
        or tensor.device.type != "cpu"
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.storage_offset() != 0
        or not tensor.is_contiguous()
        or tensor.__dict__
        or sys.byteorder != "little"
    ):
        return None
    metadata = getattr(torch._utils, "get_tensor_metadata", None)
    if metadata is None or metadata(tensor):
        return None
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes != tensor.numel() * tensor.element_size():
        return None
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), nbytes


def elements_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor's elements (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


@dataclass(frozen=True)
class _Template:
    head: bytes  # the item's bytes before its elements
    tail: bytes  # and after them
    record: Record


class ItemTemplates:
    """The items of one save's tensors, by layout (see the module docstring)."""

    def __init__(self) -> None:
        self._templates: dict[Layout, _Template] = {}

    def write(self, tensor: torch.Tensor, sink: Sink) -> tuple[int, Record] | None:
        """Write ``tensor``'s item to ``sink`` from the template of its layout;
        ``(item size, record)``, or None (nothing written) when there is none."""
        layout = layout_of(tensor)
        template = self._templates.get(layout) if layout is not None else None
        if template is None:
            return None
        sink.write(template.head)
        sink.write(elements_of(tensor))
        sink.write(template.tail)
        size = len(template.head) + template.record[1] + len(template.tail)
        return size, template.record

    def learn(
        self,
        tensor: torch.Tensor,
        record: Record | None,
        size: int,
        read: Callable[[int, int], Buffer | None],
    ) -> None:
        """Keep the item ``torch.save`` just wrote for ``tensor`` (``size`` bytes,
        elements at ``record``, other bytes from ``read(offset, nbytes)``) as the
        template of its layout."""
        layout = layout_of(tensor)
        if layout is None or record is None or layout in self._templates:
            return
        start, nbytes = record
        if nbytes != layout[3]:
            return
        head, tail = read(0, start), read(start + nbytes, size - start - nbytes)
        if head is None or tail is None:
            return
        self._templates[layout] = _Template(bytes(head), bytes(tail), record)


__all__ = ["ItemTemplates", "Layout", "elements_of", "layout_of"]
