"""Megatron-Core 0.19's helpers for NVIDIA Resiliency Extension's async checkpointing
(``strategies.nvrx``).

cloudckpt runs its own async save for ``async_strategy="nvrx"`` as for ``"mcore"``
(:mod:`cloudckpt.strategies.async_utils`; NVRx's writer forks processes that write
POSIX files, which an object store is not), so neither function here is needed for a
torch_dist save. They behave as Megatron-Core's: :func:`has_nvrx_async_support` says
whether NVRx itself is installed with the symbols Megatron-Core's NVRx path uses,
:func:`make_nvrx_async_request` builds a request of the class given.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import Any

from cloudckpt.errors import CheckpointingException

NVRX_MIN_VERSION = "0.6.0"
"""The oldest NVIDIA Resiliency Extension whose async API Megatron-Core 0.19 uses."""

_NVRX = "nvidia_resiliency_ext.checkpointing.async_ckpt"
_REQUIRED = {
    "core": ("AsyncCallsQueue", "AsyncRequest"),
    "cached_metadata_filesystem_reader": ("CachedMetadataFileSystemReader",),
    "filesystem_async": ("FileSystemWriterAsync", "get_write_results_queue", "_results_queue"),
    "state_dict_saver": (
        "CheckpointMetadataCache",
        "save_state_dict_async_finalize",
        "save_state_dict_async_plan",
    ),
}


class NvrxVersionError(CheckpointingException):
    """NVIDIA Resiliency Extension is installed, older than :data:`NVRX_MIN_VERSION`."""


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string ("0.6.0rc1" -> (0, 6, 0))."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def is_nvrx_min_version(version: str = NVRX_MIN_VERSION) -> bool:
    """Whether NVIDIA Resiliency Extension ``>= version`` (its release numbers) is
    installed."""
    try:
        installed = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return False
    return _release(installed) >= _release(version)


def has_nvrx_async_support() -> bool:
    """Whether NVIDIA Resiliency Extension's async checkpointing modules import and hold
    every symbol Megatron-Core's NVRx path uses.

    Raises:
        NvrxVersionError: NVRx imports but is older than :data:`NVRX_MIN_VERSION`
            (Megatron-Core asserts).
    """
    try:
        modules = {name: importlib.import_module(f"{_NVRX}.{name}") for name in _REQUIRED}
    except ImportError:
        return False
    if not is_nvrx_min_version():
        raise NvrxVersionError(
            f"nvidia-resiliency-ext >= {NVRX_MIN_VERSION} is required for its async "
            "checkpointing; cloudckpt's own async save needs none (async_strategy='mcore')"
        )
    return all(hasattr(modules[m], name) for m, names in _REQUIRED.items() for name in names)


def make_nvrx_async_request(
    async_request_cls: type,
    async_fn: Callable[..., Any] | None,
    async_fn_args: Any,
    finalize_fns: list[Callable[[], Any]],
    async_fn_kwargs: dict[str, Any] | None = None,
    preload_fn: Callable[[], Any] | None = None,
) -> Any:
    """``async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=...,
    preload_fn=...)``: a request of the class :func:`~cloudckpt.strategies.torch.
    get_async_strategy` returned (cloudckpt's
    :class:`~cloudckpt.strategies.async_utils.AsyncRequest` for either strategy)."""
    return async_request_cls(
        async_fn,
        async_fn_args,
        finalize_fns,
        async_fn_kwargs=async_fn_kwargs or {},
        preload_fn=preload_fn,
    )


__all__ = [
    "NVRX_MIN_VERSION",
    "NvrxVersionError",
    "has_nvrx_async_support",
    "is_nvrx_min_version",
    "make_nvrx_async_request",
]
