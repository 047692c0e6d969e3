"""array_utils: np.unique's results and stable orders by sorting."""

from __future__ import annotations

import numpy as np
import pytest

from cloudckpt.array_utils import sorted_unique, stable_order, unique_rows


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_sorted_unique_equals_np_unique(n: int) -> None:
    values = np.random.default_rng(n).integers(-5, 9, n)
    assert sorted_unique(values).tolist() == np.unique(values).tolist()


def test_sorted_unique_large_keys() -> None:
    values = np.random.default_rng(1).integers(0, 1 << 60, 5000) * 3
    values = np.concatenate([values, values[:100]])
    assert sorted_unique(values).tolist() == np.unique(values).tolist()


@pytest.mark.parametrize(
    ("n", "high"), [(0, 4), (1, 4), (2, 4), (50, 3), (1000, 9), (1000, 1 << 40), (300, 1 << 62)]
)
def test_unique_rows_equals_np_unique(n: int, high: int) -> None:
    rows = np.random.default_rng(n).integers(-1, high, (n, 2))
    distinct, inverse = unique_rows(rows)
    expected, expected_inverse = np.unique(rows, axis=0, return_inverse=True)
    assert distinct.tolist() == expected.tolist()
    assert inverse.tolist() == expected_inverse.ravel().tolist()
    assert (distinct[inverse] == rows).all()


@pytest.mark.parametrize("bound", [1, 7, 1 << 16, (1 << 16) + 1, 1 << 40])
def test_stable_order_equals_a_stable_argsort(bound: int) -> None:
    """The radix sort (ids below 2**16) and the merge sort give numpy's stable order:
    equal ids keep their order (the ranks' items stay in rank order)."""
    values = np.random.default_rng(bound).integers(0, bound, 5000)
    values[:50] = bound - 1  # the largest id, on both sides of the 16-bit limit
    assert stable_order(values, bound).tolist() == np.argsort(values, kind="stable").tolist()
