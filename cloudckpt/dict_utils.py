"""Helpers for nested dicts and lists (state dicts).

Every function here walks dicts and lists recursively. Anything else (tuples, tensors,
sharded tensors, plain objects) is a *leaf*: it is never traversed. Key paths in
results and error messages are tuples of dict keys and list indices, outermost first.

This module sits below :mod:`cloudckpt.mapping` and must not import it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any, TypeVar, overload

import numpy as np
import torch

from cloudckpt.errors import CheckpointingException

logger = logging.getLogger(__name__)

U = TypeVar("U")
V = TypeVar("V")
K = TypeVar("K", bound=Hashable)

Nested = dict[Any, Any] | list[Any]
KeyPath = tuple[Any, ...]


def _new_container(as_dict: bool) -> Nested:
    return {} if as_dict else []


def _put(target: Nested, key: Any, value: Any) -> None:
    if isinstance(target, dict):
        target[key] = value
    else:
        target.append(value)


@overload
def extract_matching_values(
    x: dict[Any, Any], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[dict[Any, Any], dict[Any, Any]]: ...
@overload
def extract_matching_values(
    x: list[Any], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[Nested, Nested]: ...
def extract_matching_values(
    x: Nested,
    predicate: Callable[[Any], bool],
    return_lists_as_dicts: bool = False,
) -> tuple[Nested, Nested]:
    """Split a nested dict or list into the leaves that match a predicate and the rest.

    Both results keep the nesting of ``x``. A sub-container with no matching leaf does
    not appear in the matching result, and one whose leaves all match does not appear
    in the non-matching result. Empty sub-containers of ``x`` are kept on the
    non-matching side (they carry structure, e.g. an empty optimizer state list).

    Args:
        x: the top-level dict or list to split.
        predicate: called on every leaf; True puts the leaf on the matching side.
        return_lists_as_dicts: if True, every list in the results becomes a dict from
            the original index to the value, so the original positions survive the
            split (needed to put the two halves back together with :func:`merge`).

    Returns:
        ``(matching, nonmatching)``, each shaped like ``x``.

    Raises:
        CheckpointingException: ``x`` is neither a dict nor a list.
    """
    if isinstance(x, dict):
        items: Iterable[tuple[Any, Any]] = x.items()
        as_dict = True
    elif isinstance(x, list):
        items = enumerate(x)
        as_dict = return_lists_as_dicts
    else:
        raise CheckpointingException(
            "extract_matching_values expects a dict or a list at the top level, "
            f"got {type(x).__name__}"
        )
    matching, nonmatching = _new_container(as_dict), _new_container(as_dict)
    for k, v in items:
        if isinstance(v, (dict, list)) and v:
            sub_match, sub_nonmatch = extract_matching_values(v, predicate, return_lists_as_dicts)
            if sub_match:
                _put(matching, k, sub_match)
            if sub_nonmatch:
                _put(nonmatching, k, sub_nonmatch)
        elif isinstance(v, (dict, list)):
            _put(nonmatching, k, _new_container(isinstance(v, dict) or return_lists_as_dicts))
        elif predicate(v):
            _put(matching, k, v)
        else:
            _put(nonmatching, k, v)
    return matching, nonmatching


def _leaves_differ(x1: Any, x2: Any) -> bool:
    """True when two leaves are not equal (tensors: as Megatron-Core, unless every element
    compares equal with ``==``, after its type promotion and broadcasting)."""
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)):
            return True
        if x1.device != x2.device:
            x1, x2 = x1.cpu(), x2.cpu()
        try:
            return not bool(torch.all(x1 == x2))
        except (RuntimeError, TypeError, ValueError):  # shapes that do not broadcast
            return True
    if isinstance(x1, np.ndarray) or isinstance(x2, np.ndarray):
        return not (type(x1) is type(x2) and np.array_equal(x1, x2))
    try:
        return bool(x1 != x2)
    except (RuntimeError, TypeError, ValueError):
        return True


def diff(
    x1: Any, x2: Any, prefix: KeyPath = ()
) -> tuple[list[KeyPath], list[KeyPath], list[tuple[Any, ...]]]:
    """Compare two nested structures recursively.

    Dicts are compared by key, lists and tuples element by element (extra trailing
    elements count as present on one side only). Tensors are equal, as in Megatron-Core,
    when every element compares equal with ``==`` (so ``arange(4)`` equals its float
    copy, and a tensor equals one it broadcasts to; compared on CPU when devices
    differ). Objects with both ``replica_id`` and ``data`` attributes (sharded tensors
    and objects) are compared through their ``data``.

    Args:
        x1: left structure.
        x2: right structure.
        prefix: key path of ``x1`` and ``x2`` inside the outermost structures.

    Returns:
        ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, key
        paths present only in ``x2``, and one ``(key_path, type(left), type(right))``
        tuple per pair of leaves that differ.
    """
    only_left: list[KeyPath] = []
    only_right: list[KeyPath] = []
    mismatch: list[tuple[Any, ...]] = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [(*prefix, k) for k in x1 if k not in x2]
        only_right = [(*prefix, k) for k in x2 if k not in x1]
        pairs: Iterable[tuple[Any, Any, Any]] = ((k, x1[k], x2[k]) for k in x1 if k in x2)
    elif isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = [(*prefix, i) for i in range(len(x2), len(x1))]
        only_right = [(*prefix, i) for i in range(len(x1), len(x2))]
        pairs = ((i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2, strict=False)))
    elif _is_sharded_like(x1) and type(x1) is type(x2):
        return diff(x1.data, x2.data, (*prefix, type(x1)))
    else:
        if _leaves_differ(x1, x2):
            mismatch.append((prefix, type(x1), type(x2)))
        return only_left, only_right, mismatch
    for k, v1, v2 in pairs:
        sub_left, sub_right, sub_mismatch = diff(v1, v2, (*prefix, k))
        only_left.extend(sub_left)
        only_right.extend(sub_right)
        mismatch.extend(sub_mismatch)
    return only_left, only_right, mismatch


def _is_sharded_like(x: Any) -> bool:
    return hasattr(x, "replica_id") and hasattr(x, "data")


def nested_values(x: Nested) -> Iterator[Any]:
    """Iterate over the leaves of a nested dict or list, depth first, in insertion order."""
    values = x.values() if isinstance(x, dict) else x
    for v in values:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[tuple[Nested, Any, Any]]:
    """Iterate over ``(container, key, leaf)`` for every leaf of a nested dict or list.

    ``container[key] is leaf`` holds for each item, so callers can replace leaves in
    place while iterating (the structure itself must not change meanwhile).
    """
    items: Iterable[tuple[Any, Any]] = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(k, v)``, in place.

    ``k`` is the leaf's own key (dict key or list index), not the full key path.
    """
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Map every leaf of nested dicts and lists through ``f``, in place.

    Args:
        f: applied to each leaf.
        x: a dict, a list, or a single leaf.

    Returns:
        ``x`` itself for a dict or list (mutated), else ``f(x)``.
    """
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


@overload
def dict_list_map_outplace(f: Callable[[Any], Any], x: dict[str, Any]) -> dict[str, Any]: ...


@overload
def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any: ...


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Map every leaf of nested dicts and lists through ``f`` into new containers.

    Args:
        f: applied to each leaf.
        x: a dict, a list, or a single leaf; it is not modified.

    Returns:
        New dicts and lists with the same structure as ``x``, or ``f(x)`` for a leaf.
    """
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


@overload
def merge(x1: dict[Any, Any], x2: Nested, key: KeyPath = ()) -> dict[Any, Any]: ...
@overload
def merge(x1: list[Any], x2: Nested, key: KeyPath = ()) -> list[Any]: ...
def merge(x1: Nested, x2: Nested, key: KeyPath = ()) -> Nested:
    """Merge ``x2`` into ``x1`` recursively, in place.

    Dict keys missing from ``x1`` are copied from ``x2``; keys present in both are
    merged recursively. Two lists must have the same length and are merged element by
    element. Two leaves at the same key path are a conflict, even when equal.

    Args:
        x1: structure to merge into (modified).
        x2: structure to merge from.
        key: key path of ``x1`` and ``x2``, used in error messages.

    Returns:
        ``x1``.

    Raises:
        CheckpointingException: conflicting leaves, lists of different lengths or a
            dict meeting a list; the message names the key path.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, (*key, k)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(
                f"Cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, (*key, i))
        return x1
    raise CheckpointingException(
        f"Cannot merge {type(x1).__name__} with {type(x2).__name__}: conflicting values "
        f"at key {key}"
    )


def map_reduce(
    xs: Iterable[U],
    key_fn: Callable[[U], K] = lambda x: x,  # type: ignore[assignment,return-value]
    value_fn: Callable[[U], V] = lambda x: x,  # type: ignore[assignment,return-value]
    reduce_fn: Callable[[list[V]], Any] = lambda x: x,
) -> dict[K, Any]:
    """Group ``xs`` by a key and reduce each group (like ``more_itertools.map_reduce``).

    Args:
        xs: items to group.
        key_fn: gives the group key of an item (default: the item itself).
        value_fn: gives the value an item contributes to its group (default: the item).
        reduce_fn: turns a group's list of values, in input order, into its result
            (default: the list itself).

    Returns:
        A dict from group key to reduced value, keys in order of first appearance.
    """
    groups: defaultdict[K, list[V]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(vs) for k, vs in groups.items()}
