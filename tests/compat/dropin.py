"""An import hook that makes ``megatron.core.dist_checkpointing`` be cloudckpt.

Run inside a Megatron-Core environment with the repository on ``PYTHONPATH``:
:func:`install` puts a finder first on ``sys.meta_path`` that answers every import of
``megatron.core.dist_checkpointing`` or ``megatron.core.dist_checkpointing.X`` with the
module ``cloudckpt`` or ``cloudckpt.X`` itself (the same module object, registered
under both names), so Megatron-Core's own model, optimizer and training code run
against cloudckpt unchanged, as a user who switched the import would. A name cloudckpt
lacks fails as ``ModuleNotFoundError`` naming the Megatron module and the cloudckpt
module it was redirected to.

This is test harness only: cloudckpt does not install it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

MEGATRON = "megatron.core.dist_checkpointing"
CLOUDCKPT = "cloudckpt"


def target_of(fullname: str) -> str | None:
    """The cloudckpt module a Megatron module name is redirected to (None: not ours)."""
    if fullname == MEGATRON:
        return CLOUDCKPT
    if fullname.startswith(MEGATRON + "."):
        return CLOUDCKPT + fullname[len(MEGATRON) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias: the module is the already-imported cloudckpt module."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._original_spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        try:
            module = importlib.import_module(self.target)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name != self.target:
                raise  # the module exists; something it imports does not
            raise ModuleNotFoundError(
                f"No module named {spec.name!r}: redirected to {self.target!r}, which "
                "cloudckpt does not have",
                name=spec.name,
            ) from exc
        self._original_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module; cloudckpt keeps its own
        module.__spec__ = self._original_spec


class DropInFinder(importlib.abc.MetaPathFinder):
    """Redirects ``megatron.core.dist_checkpointing[.X]`` to ``cloudckpt[.X]``."""

    def __init__(self) -> None:
        self.redirected: list[str] = []

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        module = target_of(fullname)
        if module is None:
            return None
        self.redirected.append(fullname)
        is_package = fullname == MEGATRON or _is_package(module)
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(module), is_package=is_package)


def _is_package(module: str) -> bool:
    found = importlib.util.find_spec(module)
    return found is not None and found.submodule_search_locations is not None


def install() -> DropInFinder:
    """Install the finder (first on ``sys.meta_path``) before Megatron-Core is imported.

    Raises:
        RuntimeError: ``megatron.core.dist_checkpointing`` was already imported.
    """
    if MEGATRON in sys.modules:
        raise RuntimeError(f"{MEGATRON} was imported before the drop-in hook")
    finder = DropInFinder()
    sys.meta_path.insert(0, finder)
    return finder
