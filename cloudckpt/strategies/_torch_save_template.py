"""A tensor's ``torch.save`` bytes without running ``torch.save``: cached zip records
around the tensor's own elements.

With the zip CRC-32s off (the torch_dist writer's ``_without_zip_crc32``), what
``torch.save`` writes for a plain CPU tensor that is contiguous and owns exactly its
storage depends only on its dtype and shape: the records before the elements (the
pickle, the byte order, the storage record's zip header) and those after them (the
format version, the serialization id, the central directory) are the same bytes for
every tensor of that dtype and shape. ``tests/test_torch_save_template.py`` checks it
against ``torch.save`` for every dtype.

So the first tensor of each (dtype, shape) is saved with ``torch.save`` and its bytes
split around its storage record (:func:`~cloudckpt.strategies._dcp_ranges.storage_record`);
every later one costs a dictionary lookup instead of ``torch.save``'s pickler and zip
writer (it also builds a class per call) and the parse of its zip: about 0.4 ms per
tensor, measured on this project's machine with 774 tensors per rank, which a
training state of thousands of tensors pays at every save. Its elements are then
written from the tensor's own memory. Tensors of any other kind (a subclass such as
``nn.Parameter``, Python attributes, a view, a gradient-requiring tensor,
conjugate/negative bits, non-CPU) and a process with the CRCs on get None: the caller
runs ``torch.save``.
"""

from __future__ import annotations

import io
import sys
import threading
from dataclasses import dataclass

import torch

from cloudckpt.strategies._dcp_ranges import Record, storage_record
from cloudckpt.strategies._zarr_format import tensor_bytes

_Key = tuple[torch.dtype, tuple[int, ...], int]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor's ``torch.save`` bytes: ``head + elements + tail``."""

    head: bytes
    elements: memoryview
    tail: bytes

    @property
    def nbytes(self) -> int:
        """The length of the whole item."""
        return len(self.head) + self.elements.nbytes + len(self.tail)

    @property
    def record(self) -> Record:
        """Where the elements lie within the item: ``(start, nbytes)``."""
        return len(self.head), self.elements.nbytes


def _crc32_off() -> bool:
    get_options = getattr(torch.serialization, "get_crc32_options", None)
    return get_options is not None and not get_options()


def _alignment() -> int:
    """torch's storage alignment setting (part of the records' layout)."""
    config = getattr(torch.utils.serialization, "config", None)
    save = getattr(config, "save", None)
    return int(getattr(save, "storage_alignment", 64))


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``torch.save`` of ``tensor`` is fixed records around its elements."""
    return (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
        and not tensor.is_quantized
        and tensor.numel() > 0
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and not tensor.__dict__
    )


class TemplateCache:
    """The records of each (dtype, shape) seen, at most ``max_entries`` of them."""

    def __init__(self, max_entries: int = 65536) -> None:
        self.max_entries = max_entries
        self._templates: dict[_Key, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._templates)

    def saved(self, tensor: torch.Tensor) -> SavedTensor | None:
        """``tensor``'s ``torch.save`` bytes as parts, or None where they cannot be had
        this way (see the module docstring)."""
        if sys.byteorder != "little" or not _crc32_off() or not _plain(tensor):
            return None
        key = (tensor.dtype, tuple(tensor.shape), _alignment())
        elements = tensor_bytes(tensor)
        template = self._templates.get(key)
        if template is None:
            template = _template_of(tensor)
            if template is None:
                return None
            with self._lock:
                if len(self._templates) < self.max_entries:
                    self._templates[key] = template
        return SavedTensor(template[0], elements, template[1])


def _template_of(tensor: torch.Tensor) -> tuple[bytes, bytes] | None:
    """The records around ``tensor``'s elements in its ``torch.save`` bytes."""
    stream = io.BytesIO()
    torch.save(tensor, stream)
    item = stream.getbuffer()
    try:
        record = storage_record(item)
        if record is None or record[1] != tensor.numel() * tensor.element_size():
            return None
        start, nbytes = record
        return bytes(item[:start]), bytes(item[start + nbytes :])
    finally:
        item.release()


TEMPLATES = TemplateCache()
"""The writer's cache: one per process, shared by every save."""
