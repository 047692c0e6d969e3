"""Reading DCP ``.metadata`` (a plain pickle of a ``Metadata``) without running its code.

:class:`MetadataUnpickler` resolves a pickle's globals from a fixed table of DCP's
metadata types and ``planner.py``'s data classes (``Metadata``, ``SavePlan``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``,
``BytesStorageMetadata``, ``TensorProperties`` and its memory-format enum,
``MetadataIndex``, ``StorageMeta``, ``_StorageInfo``), ``torch.Size``, torch dtypes,
layouts (and ``torch.serialization._get_layout``, which looks one up by name) and memory
formats, ``pathlib`` paths, a few builtins, Megatron-Core 0.15's ``MCoreMetadata`` /
``MCoreSavePlan`` (read as cloudckpt's dataclasses of the same fields), plus whatever
:func:`cloudckpt.add_safe_globals` allowed. It imports nothing: a name not in the
table raises :class:`~cloudckpt.errors.UnsafePickleError` before anything is called.
It reads what cloudckpt, Megatron-Core's torch_dist backend and
``torch.distributed.checkpoint.save`` (``FileSystemWriter``) write. With the opt-out
(``weights_only=False``, ``CLOUDCKPT_TRUST_PICKLES=1``) ``.metadata`` is unpickled
without restriction.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import pathlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from cloudckpt.safe_pickle import allowed_globals, resolve_weights_only, unsafe_pickle_error

WHAT = "DCP metadata"
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], Any]:
    """``{(module, name): object}`` a ``.metadata`` pickle may name."""
    # Megatron-Core 0.19 also pickles its cached SavePlan (planner.py's dataclasses).
    classes: list[Any] = [
        obj
        for module in (dcp_metadata, dcp_planner)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and obj.__module__ == module.__name__
        and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
    ]
    classes += [_StorageInfo, torch.Size, collections.OrderedDict]
    classes += [pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
    classes += [pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath]  # a checkpoint_id
    classes += [set, frozenset, complex, slice, range]
    table = {(cls.__module__, cls.__qualname__): cls for cls in classes}
    table["torch.serialization", "_get_layout"] = torch.serialization._get_layout  # by name
    for name, value in vars(torch).items():  # torch.float32 is pickled as torch.float32
        if isinstance(value, _TORCH_VALUES):
            table["torch", name] = value
    return table


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals from the table above only (never imports)."""

    def __init__(
        self, file: io.BytesIO, where: str, aliases: Mapping[tuple[str, str], Any]
    ) -> None:
        super().__init__(file)
        self.where = where
        self.aliases = aliases

    def find_class(self, module: str, name: str) -> Any:
        found = _dcp_globals().get((module, name)) or self.aliases.get((module, name))
        if found is None:
            found = allowed_globals().get(f"{module}.{name}")
        if found is None:
            raise unsafe_pickle_error(
                self.where, WHAT, f"{module}.{name}", "not a DCP metadata type"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise unsafe_pickle_error(self.where, WHAT, "", "a persistent id, which DCP never writes")


class _TrustedUnpickler(pickle.Unpickler):
    """The opt-out: any global, with ``aliases`` for classes that cannot be imported
    (Megatron-Core's, in a checkpoint it wrote, read without it installed)."""

    def __init__(self, file: io.BytesIO, aliases: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self.aliases = aliases

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if (module, name) in self.aliases:
                return self.aliases[module, name]
            raise


def load_dcp_metadata(
    raw: bytes,
    where: str,
    weights_only: bool | None = None,
    aliases: Mapping[tuple[str, str], Any] | None = None,
) -> Any:
    """Unpickle ``.metadata`` bytes: restricted (see the module) unless trusted.

    ``aliases`` maps ``(module, name)`` to a local class: allowed when restricted, and
    the fallback when trusted and the name cannot be imported.

    Raises:
        UnsafePickleError: restricted, and the pickle names a global outside the table.
        Exception: whatever unpickling malformed bytes raises.
    """
    if not resolve_weights_only(weights_only):
        return _TrustedUnpickler(io.BytesIO(raw), aliases or {}).load()
    return MetadataUnpickler(io.BytesIO(raw), where, aliases or {}).load()
