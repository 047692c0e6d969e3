"""cloudckpt in place of ``megatron.core.dist_checkpointing``, for Megatron-LM's own code.

:func:`install` puts an import finder first on ``sys.meta_path`` that answers every import
of ``megatron.core.dist_checkpointing`` or ``megatron.core.dist_checkpointing.X`` with the
module ``cloudckpt`` or ``cloudckpt.X`` itself (one module object registered under both
names, so classes and ``isinstance`` checks agree between Megatron's code and cloudckpt's).
Megatron-Core's model and optimizer code and Megatron-LM's training loop then checkpoint
through cloudckpt unchanged. A module cloudckpt lacks fails as ``ModuleNotFoundError``
naming both the Megatron module and the cloudckpt module it was redirected to.

``python -m cloudckpt.megatron SCRIPT [ARGS...]`` (:mod:`cloudckpt.megatron.__main__`)
installs the finder and runs a training script, e.g. Megatron-LM's ``pretrain_gpt.py``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

from cloudckpt.errors import CheckpointingException

__all__ = ["MEGATRON", "DropInFinder", "MegatronAlreadyImportedError", "install", "installed"]

#: The Megatron-Core package cloudckpt stands in for.
MEGATRON = "megatron.core.dist_checkpointing"
_CLOUDCKPT = "cloudckpt"


class MegatronAlreadyImportedError(CheckpointingException):
    """``megatron.core.dist_checkpointing`` was imported before :func:`install`."""


def target_of(fullname: str) -> str | None:
    """The cloudckpt module a Megatron module name is redirected to (None: not ours)."""
    if fullname == MEGATRON:
        return _CLOUDCKPT
    if fullname.startswith(MEGATRON + "."):
        return _CLOUDCKPT + fullname[len(MEGATRON) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias: the module is the (imported) cloudckpt module itself."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own_spec: Any = None

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
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module; cloudckpt keeps its own
        module.__spec__ = self._own_spec


class DropInFinder(importlib.abc.MetaPathFinder):
    """Redirects ``megatron.core.dist_checkpointing[.X]`` to ``cloudckpt[.X]``."""

    def __init__(self) -> None:
        #: The Megatron module names redirected so far, in import order.
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


def installed() -> DropInFinder | None:
    """The finder :func:`install` put on ``sys.meta_path``, or None."""
    return next((f for f in sys.meta_path if isinstance(f, DropInFinder)), None)


def install() -> DropInFinder:
    """Make ``megatron.core.dist_checkpointing`` be cloudckpt in this process.

    Call it before anything imports Megatron-Core's ``dist_checkpointing`` (``import
    megatron.core`` does). Installing twice returns the finder already installed.

    Raises:
        MegatronAlreadyImportedError: Megatron-Core's own ``dist_checkpointing`` is already
            imported (its classes are in use; replacing them now would mix two libraries).
    """
    finder = installed()
    if finder is not None:
        return finder
    own = sys.modules.get(MEGATRON)
    if own is not None and own.__name__ == MEGATRON:
        raise MegatronAlreadyImportedError(
            f"{MEGATRON} was imported before cloudckpt.megatron.install(): call install() "
            "first (or run the script with `python -m cloudckpt.megatron SCRIPT`)"
        )
    finder = DropInFinder()
    sys.meta_path.insert(0, finder)
    return finder
