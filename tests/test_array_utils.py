"""array_utils: np.unique's results by sorting."""

from __future__ import annotations

import numpy as np
import pytest

from cloudckpt.array_utils import sorted_unique, unique_rows


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
