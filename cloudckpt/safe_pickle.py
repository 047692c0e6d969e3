"""Loading a checkpoint's pickles without running their code.

``common.pt`` and ShardedObject payloads are ``torch.save`` pickles, and a pickle can
call any importable function while it loads (``__reduce__`` -> ``os.system``). A
checkpoint shared between teams or downloaded from a bucket is untrusted input, so by
default cloudckpt unpickles them as ``torch.load(weights_only=True)`` does: only
tensors, containers, primitive values and an allow-list of types, found by name among
objects already in the process (nothing is imported, nothing outside the list is
called). A pickle that needs anything else raises
:class:`~cloudckpt.errors.UnsafePickleError`, naming the global.

The allow-list is torch's own (``torch.serialization.add_safe_globals``) plus what
training state usually holds (:func:`default_safe_globals`): ``argparse.Namespace``,
``types.SimpleNamespace``, ``pathlib`` paths, ``datetime`` values, ``uuid.UUID``,
``io.BytesIO`` (Megatron-Core's ShardedObject items), ``frozenset`` / ``range`` /
``slice``, torch memory formats and, when numpy is installed, numpy dtypes, scalars
and arrays. Enum members are allowed when their class is already imported (a module
of this process defines it): building one calls nothing but the enum's lookup.

Widening it:

* :func:`add_safe_globals` (``cloudckpt.add_safe_globals``): allow more types or
  functions, process-wide (they go to torch's list too, under a lock);
* ``weights_only=False`` on :func:`cloudckpt.load`, ``load_common_state_dict``,
  ``load_tensors_metadata``, ``load_sharded_metadata``, ``load_plain_tensors`` or a
  load strategy (``TorchCommonLoadStrategy(weights_only=False)``): unpickle without
  restriction, as Megatron-Core does - for checkpoints you trust only;
* ``CLOUDCKPT_TRUST_PICKLES=1`` in the environment: the same, for every load that does
  not pass ``weights_only`` itself.

The innermost explicit setting wins: a strategy's ``weights_only`` over the load
call's, the load call's over the environment. Inside :func:`never_trusted` (``cloudckpt
inspect``) nothing widens it.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import io
import os
import pickle
import re
import sys
import threading
import types
import uuid
from argparse import Namespace
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path, PosixPath, PurePath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.errors import UnsafePickleError

TRUST_ENV = "CLOUDCKPT_TRUST_PICKLES"
_TRUE = frozenset({"1", "true", "yes", "on"})
_MAX_ENUM_ROUNDS = 256  # enum classes allowed while loading one pickle, at most


class _Registry:
    """cloudckpt's allow-list by dotted name (what a pickle's GLOBAL says). ``names`` is
    replaced under the lock, never mutated, so readers need no lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: dict[str, Any] = {}
        self.defaults_added = False


_REGISTRY = _Registry()
_scoped: ContextVar[bool | None] = ContextVar("cloudckpt_weights_only", default=None)
_never_trusted: ContextVar[bool] = ContextVar("cloudckpt_never_trusted", default=False)


# -- the policy -------------------------------------------------------------------------


def trusted_by_environment() -> bool:
    """Whether ``CLOUDCKPT_TRUST_PICKLES`` asks to unpickle without restriction."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in _TRUE


def resolve_weights_only(weights_only: bool | None = None) -> bool:
    """Whether a pickle is loaded restricted: inside :func:`never_trusted` always; else
    ``weights_only`` when given, else the enclosing :func:`weights_only_scope`'s, else
    True unless ``CLOUDCKPT_TRUST_PICKLES`` is set."""
    if _never_trusted.get():
        return True
    if weights_only is not None:
        return weights_only
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    return not trusted_by_environment()


@contextlib.contextmanager
def weights_only_scope(weights_only: bool | None) -> Iterator[None]:
    """Loads in this block (this thread or task) use ``weights_only`` unless they pass
    their own; None leaves the setting as it is."""
    if weights_only is None:
        yield
        return
    token = _scoped.set(weights_only)
    try:
        yield
    finally:
        _scoped.reset(token)


@contextlib.contextmanager
def never_trusted() -> Iterator[None]:
    """Every pickle loaded in this block is restricted, whatever an argument, a
    strategy or the environment says (``cloudckpt inspect``)."""
    token = _never_trusted.set(True)
    try:
        yield
    finally:
        _never_trusted.reset(token)


# -- the allow-list ---------------------------------------------------------------------


def _numpy_safe_globals() -> list[Any]:
    """numpy dtypes, scalars and arrays (numpy's random state is a tuple with an array),
    when numpy is installed; under both the numpy 1 and numpy 2 module names."""
    try:
        import numpy as np  # noqa: PLC0415 - optional
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    out: list[Any] = [np.dtype, np.ndarray]
    out += [
        cls
        for cls in vars(getattr(np, "dtypes", types.SimpleNamespace())).values()
        if isinstance(cls, type) and issubclass(cls, np.dtype)
    ]
    for name in ("scalar", "_reconstruct"):
        fn = getattr(core.multiarray, name)
        out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    return out


def default_safe_globals() -> list[Any]:
    """The types cloudckpt allows besides torch's own: training state's usual values."""
    paths = [PurePath, PurePosixPath, PureWindowsPath, Path, PosixPath, WindowsPath]
    out: list[Any] = [Namespace, types.SimpleNamespace, io.BytesIO, uuid.UUID]
    out += paths + [(cls, f"pathlib._local.{cls.__name__}") for cls in paths]  # Python 3.13
    out += [datetime.datetime, datetime.date, datetime.time, datetime.timedelta]
    out += [datetime.timezone, frozenset, range, slice]
    formats = ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
    out += [(getattr(torch, name), f"torch.{name}") for name in formats]
    return out + _numpy_safe_globals()


def _dotted_name(entry: Any) -> tuple[str, Any]:
    if isinstance(entry, tuple):
        if len(entry) != 2 or not isinstance(entry[1], str):
            raise TypeError(f"a safe global is an object or (object, 'dotted.name'): {entry!r}")
        return entry[1], entry[0]
    module, name = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(name, str):
        raise TypeError(f"{entry!r} has no __module__ / __qualname__: pass (object, 'dotted.name')")
    return f"{module}.{name}", entry


def _add_locked(entries: list[Any]) -> None:
    named = dict(_dotted_name(e) for e in entries)
    torch.serialization.add_safe_globals(entries)
    _REGISTRY.names = {**_REGISTRY.names, **named}


def add_safe_globals(safe_globals: Iterable[Any]) -> None:
    """Allow more types or functions in the pickles of every checkpoint this process
    loads (``common.pt``, ShardedObjects, DCP ``.metadata``).

    Args:
        safe_globals: classes or functions, each found by its ``__module__`` and
            ``__qualname__``, or ``(object, "dotted.name")`` for an object stored under
            another name. They are added to torch's list too
            (``torch.serialization.add_safe_globals``), so ``torch.load(weights_only=True)``
            accepts them as well. Allow only what building cannot abuse: a class whose
            ``__new__``, ``__setstate__`` or ``__reduce__`` target runs arbitrary code
            makes every checkpoint able to run it.
    """
    entries = list(safe_globals)
    for entry in entries:
        _dotted_name(entry)  # fail before adding any
    _ensure_defaults()
    with _REGISTRY.lock:
        _add_locked(entries)


def _ensure_defaults() -> None:
    if _REGISTRY.defaults_added:
        return
    with _REGISTRY.lock:
        if not _REGISTRY.defaults_added:
            _add_locked(default_safe_globals())
            _REGISTRY.defaults_added = True


def allowed_globals() -> dict[str, Any]:
    """``{dotted name: object}`` of what cloudckpt allows beyond torch's built-in list
    (the defaults and every :func:`add_safe_globals`)."""
    _ensure_defaults()
    return dict(_REGISTRY.names)


def _imported_enum(dotted: str) -> type[enum.Enum] | None:
    """The Enum class ``dotted`` names, if a module already imported defines it
    (nothing is imported here)."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj: Any = module
        for attr in parts[cut:]:
            obj = vars(obj).get(attr) if hasattr(obj, "__dict__") else None
            if obj is None:
                return None
        is_enum = isinstance(obj, type) and issubclass(obj, enum.Enum)
        return obj if is_enum else None
    return None


# -- loading ----------------------------------------------------------------------------

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_FUNCTION = re.compile(r"unrecognized function ([\w.<>]+)")
_CLASS = re.compile(r"but got <class '([\w.]+)'>")
_REASON = re.compile(r"WeightsUnpickler error:\s*(.*?)(?: Please use |\n|$)")


def forbidden_global(error: BaseException) -> str:
    """The global a failed weights-only load names (the first found), else ''."""
    text = str(error)
    for pattern in (_GLOBAL, _FUNCTION, _CLASS):
        found = pattern.search(text)
        if found:
            return found.group(1)
    return ""


def _reason(error: BaseException) -> str:
    found = _REASON.search(str(error))
    return (found.group(1) if found else str(error).splitlines()[0]).strip()


def _is_allowed(dotted: str) -> bool:
    """Whether ``dotted`` is on cloudckpt's or torch's list already."""
    if dotted in allowed_globals():
        return True
    for entry in torch.serialization.get_safe_globals():
        try:
            if _dotted_name(entry)[0] == dotted:
                return True
        except TypeError:
            continue
    return False


def unsafe_pickle_error(where: str, what: str, forbidden: str, reason: str) -> UnsafePickleError:
    """The error for a pickle that needs ``forbidden`` (a dotted name, may be '')."""
    trust = f"weights_only=False on the load, or {TRUST_ENV}=1, unpickles it without restriction"
    head = f"rank {dist.get_rank()}: {what} in {where}"
    if forbidden and _is_allowed(forbidden):
        return UnsafePickleError(
            f"{head} holds a {forbidden!r} that the restricted unpickler cannot build "
            f"({reason}). If you trust this checkpoint: {trust}",
            forbidden,
        )
    needs = f"needs {forbidden!r}, which" if forbidden else "needs something that"
    allow = f"cloudckpt.add_safe_globals([{forbidden}]) allows it; " if forbidden else ""
    return UnsafePickleError(
        f"{head} {needs} is not allowed in an untrusted checkpoint: unpickling it could run "
        f"code ({reason}). If you trust this checkpoint: {allow}{trust}",
        forbidden,
    )


def _restricted_load(raw: bytes | memoryview) -> Any:
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def load_torch_pickle(
    raw: bytes | memoryview, where: str, what: str, weights_only: bool | None = None
) -> Any:
    """``torch.load`` of ``torch.save`` bytes, restricted unless trusted (see the module).

    Args:
        raw: the stored bytes.
        where: the object's URI (for the error; it is redacted there).
        what: what it holds, e.g. ``"common state"``, ``"sharded object 'k/shard_0_1'"``.
        weights_only: True restricts, False trusts, None follows the scope / environment.

    Raises:
        UnsafePickleError: restricted, and the pickle needs a global outside the list.
    """
    if not resolve_weights_only(weights_only):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
    _ensure_defaults()
    tried: set[str] = set()
    while True:
        try:
            return _restricted_load(raw)
        except pickle.UnpicklingError as exc:
            forbidden = forbidden_global(exc)
            cls = _imported_enum(forbidden) if forbidden not in tried else None
            if cls is None or len(tried) >= _MAX_ENUM_ROUNDS:
                raise unsafe_pickle_error(where, what, forbidden, _reason(exc)) from exc
            tried.add(forbidden)
            with _REGISTRY.lock:
                _add_locked([(cls, forbidden)])
