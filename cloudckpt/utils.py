"""Helpers for sharded state dicts (Megatron-Core's ``dist_checkpointing.utils``).

Splitting a sharded state dict by the kind of its leaves (``extract_*``), renaming the
keys of its sharded leaves (``add_prefix_for_sharding``, ``replace_prefix_for_sharding``,
``apply_prefix_mapping``), shard ids that identify one piece of data on every rank that
holds a replica of it, and the timing / debug logging helpers Megatron's code uses
(``debug_time`` as a context manager or a decorator, ``debug_msg``, ``logger_stack``).

Every ``extract_*`` function returns ``(matching, other)``, both shaped like the input
(see :func:`cloudckpt.dict_utils.extract_matching_values`). The prefix functions edit
the state dict in place and return None, as Megatron-Core's do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from cloudckpt.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

logger = logging.getLogger(__name__)
#: Megatron-Core's name for the logger used when no logger is on the stack.
fallback_logger = logger

#: Identifies the data of one shard: ``(key, global_offset, flattened range or None)``
#: for a ShardedTensor, ``(key, global_offset, global_shape)`` for a ShardedObject.
_ShardId = tuple[str, tuple[int, ...], tuple[int, ...] | None]

_RENAMED = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def zip_strict(*args: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """``zip`` of iterables that must have equal lengths; the error names the lengths.

    Raises:
        ValueError: the iterables differ in length (Megatron-Core asserts instead).
    """
    lists = [list(a) for a in args]
    lengths = [len(a) for a in lists]
    if len(set(lengths)) > 1:
        raise ValueError(f"Tried to zip iterables of unequal lengths: {lengths}!")
    return zip(*lists, strict=True)


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """Id of a ShardedTensor's data, the same on every rank holding a replica of it."""
    rng = sharded_tensor.flattened_range
    return (
        sharded_tensor.key,
        tuple(sharded_tensor.global_offset),
        None if rng is None else (rng.start, rng.stop),
    )


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """Id of a ShardedObject's data, the same on every rank holding a replica of it."""
    return (
        sharded_object.key,
        tuple(sharded_object.global_offset),
        tuple(sharded_object.global_shape),
    )


def _extract(
    sharded_state_dict: ShardedStateDict, kinds: tuple[type, ...]
) -> tuple[ShardedStateDict, StateDict]:
    matching, other = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, kinds))
    return matching, other


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Split off the ShardedTensors: ``(sharded tensors, everything else)``."""
    return _extract(sharded_state_dict, (ShardedTensor,))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Split off ShardedTensors and ShardedTensorFactories: ``(those, everything else)``."""
    return _extract(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Split off ShardedTensors, factories and LocalNonpersistentObjects."""
    return _extract(
        sharded_state_dict, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)
    )


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Split off every ShardedBase (tensors, objects, factories): ``(sharded, common)``."""
    return _extract(sharded_state_dict, (ShardedBase,))


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, StateDict]:
    """Split off the LocalNonpersistentObjects: ``(nonpersistent, everything else)``."""
    return _extract(sharded_state_dict, (LocalNonpersistentObject,))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every ShardedBase in the state dict, in place."""

    def add(value: Any) -> Any:
        if isinstance(value, ShardedBase):
            value.key = f"{prefix}{value.key}"
        return value

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf, in place.

    Raises:
        ValueError: a ShardedTensor, factory or ShardedObject key does not start with
            ``old_prefix`` (keys renamed before it stay renamed, as in Megatron-Core).
    """

    def replace(value: Any) -> Any:
        if isinstance(value, _RENAMED):
            if not value.key.startswith(old_prefix):
                raise ValueError(f"Expected {value.key} to begin with prefix {old_prefix}")
            value.key = new_prefix + value.key.removeprefix(old_prefix)
        return value

    dict_list_map_inplace(replace, sharded_state_dict)


def apply_prefix_mapping(
    sharded_state_dict: ShardedStateDict, prefix_map: Mapping[str, str]
) -> None:
    """Rename the keys that start with a prefix of ``prefix_map`` (old -> new), in place.

    The first matching prefix, in the mapping's order, is used; keys matching none are
    left as they are.
    """

    def replace(value: Any) -> Any:
        if not isinstance(value, _RENAMED):
            return value
        for old_prefix, new_prefix in prefix_map.items():
            if value.key.startswith(old_prefix):
                value.key = new_prefix + value.key.removeprefix(old_prefix)
                break
        return value

    dict_list_map_inplace(replace, sharded_state_dict)


def is_float8tensor(tensor: Any) -> bool:
    """True for a quantized FP8 tensor object (Transformer Engine's ``Float8Tensor``).

    Recognised by duck typing (a ``torch.Tensor`` subclass whose class name contains
    ``Float8`` and that has ``dequantize``), so this works without importing
    Transformer Engine, which needs CUDA. Plain tensors of torch's own ``float8_*``
    dtypes are not quantized objects: they are stored as they are.
    """
    return (
        isinstance(tensor, torch.Tensor)
        and type(tensor) is not torch.Tensor
        and "Float8" in type(tensor).__name__
        and callable(getattr(tensor, "dequantize", None))
    )


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace the FP8 ``data`` of every leaf by its dequantized tensor, in place.

    Leaves with a ``data`` attribute (ShardedTensor, factories) holding an FP8 tensor
    object (see :func:`is_float8tensor`) get ``data.dequantize()``; nothing else changes.
    On a CPU-only installation there are no such tensors and this does nothing.
    """
    for value in nested_values(sharded_state_dict):
        data: Any = getattr(value, "data", None)
        if is_float8tensor(data):
            value.data = data.dequantize()


_NAME_STACK: list[str] = []
_LOGGER_STACK: list[logging.Logger] = []


@contextmanager
def logger_stack(
    name: str | None = None, current_logger: logging.Logger | None = None
) -> Iterator[tuple[str, logging.Logger]]:
    """Push a name and/or a logger for the duration of the block.

    Yields ``(dotted names on the stack, innermost logger)``; the innermost logger is
    ``current_logger``, else the last one pushed, else this module's logger.
    """
    if name:
        _NAME_STACK.append(name)
    if current_logger is not None:
        _LOGGER_STACK.append(current_logger)
    active = _LOGGER_STACK[-1] if _LOGGER_STACK else fallback_logger
    try:
        yield ".".join(_NAME_STACK), active
    finally:
        if name and _NAME_STACK:
            _NAME_STACK.pop()
        if current_logger is not None and _LOGGER_STACK:
            _LOGGER_STACK.pop()


@contextmanager
def debug_time(
    name: str,
    logger: logging.Logger | None = None,
    threshold: float = float("-inf"),
    level: int | None = None,
) -> Iterator[None]:
    """Log how long the block (or, used as a decorator, each call) took.

    Args:
        name: label pushed on the name stack; the message is ``"<names> took <s>s"``.
        logger: logger to use; default: the innermost one on the stack.
        threshold: seconds below which nothing is logged.
        level: log level; default DEBUG without a threshold, WARNING with one.
    """
    with logger_stack(name, logger) as (stacked_name, active):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                active.log(level, "%s took %.4fs", stacked_name, elapsed)


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG, prefixed with the names on the stack, to the innermost logger."""
    with logger_stack(None, None) as (stacked_name, active):
        active.debug("%s %s", stacked_name, msg)


def _clean_metadata_for_serialization(metadata: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of save metadata without what cannot be pickled (a ``dp_cp_group``)."""
    if metadata is None:
        return None
    clean = dict(metadata)
    clean.pop("dp_cp_group", None)
    return clean


__all__ = [
    "add_prefix_for_sharding",
    "apply_prefix_mapping",
    "debug_msg",
    "debug_time",
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "fallback_logger",
    "force_all_tensors_to_non_fp8",
    "is_float8tensor",
    "logger_stack",
    "replace_prefix_for_sharding",
    "zip_strict",
]
