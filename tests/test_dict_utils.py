"""Tests for cloudckpt.dict_utils: nested dict/list traversal helpers."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from cloudckpt import dict_utils
from cloudckpt.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
)
from cloudckpt.errors import CheckpointingException


def _is_int(x: Any) -> bool:
    return isinstance(x, int)


# ---------------------------------------------------------------- extract_matching_values


def test_extract_matching_values_splits_nested_dict_keeping_structure() -> None:
    x = {"a": 1, "b": "s", "c": {"d": 2, "e": "t"}, "f": {"g": 3}, "h": {"i": "u"}}
    matching, nonmatching = extract_matching_values(x, _is_int)
    assert matching == {"a": 1, "c": {"d": 2}, "f": {"g": 3}}
    assert nonmatching == {"b": "s", "c": {"e": "t"}, "h": {"i": "u"}}


def test_extract_matching_values_lists_without_and_with_dicts() -> None:
    x = {"l": [1, "a", 2, ["b", 3]]}
    matching, nonmatching = extract_matching_values(x, _is_int)
    assert matching == {"l": [1, 2, [3]]}
    assert nonmatching == {"l": ["a", ["b"]]}
    matching, nonmatching = extract_matching_values(x, _is_int, return_lists_as_dicts=True)
    assert matching == {"l": {0: 1, 2: 2, 3: {1: 3}}}
    assert nonmatching == {"l": {1: "a", 3: {0: "b"}}}


def test_extract_matching_values_top_level_list() -> None:
    matching, nonmatching = extract_matching_values([1, "x", 2], _is_int)
    assert (matching, nonmatching) == ([1, 2], ["x"])


@pytest.mark.parametrize(
    ("as_dicts", "expected_nonmatching"),
    [
        (False, {"empty_d": {}, "empty_l": [], "l": [[]]}),
        (True, {"empty_d": {}, "empty_l": {}, "l": {0: {}}}),
    ],
)
def test_extract_matching_values_keeps_empty_containers_on_nonmatching_side(
    as_dicts: bool, expected_nonmatching: dict[str, Any]
) -> None:
    x = {"empty_d": {}, "empty_l": [], "l": [[]], "n": 1}
    matching, nonmatching = extract_matching_values(x, _is_int, return_lists_as_dicts=as_dicts)
    assert matching == {"n": 1}
    assert nonmatching == expected_nonmatching


def test_extract_matching_values_round_trips_with_merge() -> None:
    x = {"a": [1, "x", {"b": 2, "c": "y"}], "d": 3}
    matching, nonmatching = extract_matching_values(x, _is_int, return_lists_as_dicts=True)
    merged = merge(matching, nonmatching)
    assert merged == {"a": {0: 1, 1: "x", 2: {"b": 2, "c": "y"}}, "d": 3}


@pytest.mark.parametrize("bad", [1, "s", (1, 2), None])
def test_extract_matching_values_rejects_non_container(bad: Any) -> None:
    with pytest.raises(CheckpointingException, match="dict or a list"):
        extract_matching_values(bad, _is_int)


# ---------------------------------------------------------------- diff


def test_diff_equal_structures_reports_nothing() -> None:
    x = {"a": torch.arange(4), "b": [1, (2, 3)], "c": {"d": "s"}, "n": np.arange(3)}
    y = {"a": torch.arange(4), "b": [1, (2, 3)], "c": {"d": "s"}, "n": np.arange(3)}
    assert diff(x, y) == ([], [], [])


def test_diff_reports_only_left_only_right_and_mismatch_paths() -> None:
    x = {"a": 1, "only_l": 2, "n": {"t": torch.zeros(2), "s": "x"}}
    y = {"a": 1, "only_r": 2, "n": {"t": torch.ones(2), "s": "x"}}
    only_left, only_right, mismatch = diff(x, y)
    assert only_left == [("only_l",)]
    assert only_right == [("only_r",)]
    assert mismatch == [(("n", "t"), torch.Tensor, torch.Tensor)]


def test_diff_lists_of_different_length_use_index_paths() -> None:
    only_left, only_right, mismatch = diff({"l": [1, 2, 3]}, {"l": [1, 5]})
    assert only_left == [("l", 2)]
    assert only_right == []
    assert mismatch == [(("l", 1), int, int)]
    assert diff([1], [1, 2, 3], prefix=("p",))[1] == [("p", 1), ("p", 2)]


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (torch.zeros(2), torch.zeros(3)),  # shapes that do not broadcast
        (torch.zeros(2), torch.tensor([0.0, 0.5], dtype=torch.float64)),  # values
        (torch.zeros(2), [0.0, 0.0]),  # tensor vs list
        (torch.zeros(2), 0.0),  # tensor vs scalar
        (np.zeros(2), np.ones(2)),
        ([1, 2], (1, 2)),  # list vs tuple
        ("a", "b"),
    ],
)
def test_diff_detects_leaf_mismatches(left: Any, right: Any) -> None:
    assert diff({"k": left}, {"k": right})[2][0][0] == ("k",)


def test_diff_compares_tensor_values_as_megatron_does() -> None:
    """Megatron-Core's ``diff`` compares values with ``==``: dtype and broadcasting aside
    (its own tests load an int64 checkpoint into float32 tensors and diff them)."""
    same = {"i": torch.arange(4), "b": torch.ones(1)}
    other = {"i": torch.arange(4.0), "b": torch.ones(3)}
    assert diff(same, other) == ([], [], [])
    assert diff({"k": torch.arange(4)}, {"k": torch.arange(4).reshape(2, 2)})[2]


def test_diff_compares_sharded_like_objects_by_data() -> None:
    a = SimpleNamespace(replica_id=0, data=torch.ones(2))
    b = SimpleNamespace(replica_id=1, data=torch.ones(2))
    c = SimpleNamespace(replica_id=0, data=torch.zeros(2))
    assert diff({"s": a}, {"s": b}) == ([], [], [])
    mismatch = diff({"s": a}, {"s": c})[2]
    assert mismatch == [(("s", SimpleNamespace), torch.Tensor, torch.Tensor)]


def test_diff_uncomparable_objects_count_as_mismatch() -> None:
    class Weird:
        def __ne__(self, other: object) -> bool:
            raise TypeError("no")

    assert len(diff(Weird(), Weird())[2]) == 1


# ---------------------------------------------------------------- iteration


def test_nested_values_yields_leaves_in_order() -> None:
    x = {"a": 1, "b": [2, {"c": 3}, []], "d": {"e": (4, 5)}}
    assert list(nested_values(x)) == [1, 2, 3, (4, 5)]
    assert list(nested_values([[], {}])) == []


def test_nested_items_iter_yields_container_and_key() -> None:
    inner = {"c": 3}
    lst = [2, inner]
    x = {"a": 1, "b": lst}
    items = list(nested_items_iter(x))
    assert items == [(x, "a", 1), (lst, 0, 2), (inner, "c", 3)]
    assert all(container[k] is v for container, k, v in items)


# ---------------------------------------------------------------- maps


def test_dict_map_replaces_leaves_in_place() -> None:
    x = {"a": 1, "b": [2, {"c": 3}]}
    assert dict_map(lambda v: v * 10, x) is None
    assert x == {"a": 10, "b": [20, {"c": 30}]}


def test_dict_map_with_key_passes_leaf_key() -> None:
    x = {"a": 1, "b": [2, {"c": 3}]}
    dict_map_with_key(lambda k, v: (k, v), x)
    assert x == {"a": ("a", 1), "b": [(0, 2), {"c": ("c", 3)}]}


def test_dict_list_map_inplace_mutates_and_returns_same_containers() -> None:
    lst = [1, 2]
    x = {"a": lst, "b": {"c": 3}}
    out = dict_list_map_inplace(lambda v: v + 1, x)
    assert out is x and x["a"] is lst
    assert x == {"a": [2, 3], "b": {"c": 4}}
    assert dict_list_map_inplace(lambda v: v + 1, 5) == 6


def test_dict_list_map_outplace_leaves_input_untouched() -> None:
    x = {"a": [1, 2], "b": {"c": 3}}
    out = dict_list_map_outplace(lambda v: v + 1, x)
    assert out == {"a": [2, 3], "b": {"c": 4}}
    assert x == {"a": [1, 2], "b": {"c": 3}}
    assert out["a"] is not x["a"]
    assert dict_list_map_outplace(str, 7) == "7"


# ---------------------------------------------------------------- merge


def test_merge_recursive_dicts_and_lists() -> None:
    x1: dict[str, Any] = {"a": {"b": 1}, "l": [{"x": 1}, {}]}
    x2: dict[str, Any] = {"a": {"c": 2}, "d": 3, "l": [{"y": 2}, {"z": 3}]}
    out = merge(x1, x2)
    assert out is x1
    assert x1 == {"a": {"b": 1, "c": 2}, "d": 3, "l": [{"x": 1, "y": 2}, {"z": 3}]}


@pytest.mark.parametrize(
    ("x1", "x2", "path"),
    [
        ({"a": {"b": 1}}, {"a": {"b": 1}}, r"\('a', 'b'\)"),  # equal leaves still conflict
        ({"a": [1, 2]}, {"a": [1]}, r"different lengths .* \('a',\)"),
        ({"a": {"b": 1}}, {"a": [1]}, r"\('a',\)"),
        ({"a": [{"b": 1}]}, {"a": [{"b": 2}]}, r"\('a', 0, 'b'\)"),
    ],
)
def test_merge_conflicts_name_the_key_path(x1: Any, x2: Any, path: str) -> None:
    with pytest.raises(CheckpointingException, match=path):
        merge(x1, x2)


# ---------------------------------------------------------------- map_reduce


def test_map_reduce_groups_in_first_appearance_order() -> None:
    words = ["apple", "bob", "avocado", "cat", "banana"]
    out = map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum)
    assert out == {"a": 12, "b": 9, "c": 3}
    assert list(out) == ["a", "b", "c"]


def test_map_reduce_defaults_group_identical_items() -> None:
    assert map_reduce([1, 2, 1]) == {1: [1, 1], 2: [2]}
    assert map_reduce([]) == {}


def test_dict_utils_does_not_import_mapping() -> None:
    tree = ast.parse(Path(dict_utils.__file__).read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "cloudckpt.errors" in imported  # the walk does see cloudckpt imports
    assert not any(name and "mapping" in name for name in imported)
