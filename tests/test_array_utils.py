"""array_utils: np.unique's results and stable orders by sorting."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cloudckpt import array_utils, table_validation
from cloudckpt.array_utils import (
    sorted_unique,
    stable_order,
    unique_rows,
    without_huge_page_advice,
)
from cloudckpt.keys import KeyLayout


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


def _advised() -> bool:
    return bool(array_utils._multiarray._get_madvise_hugepage())


@pytest.fixture
def advice_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """numpy's huge page advice on (as by default on Linux), restored afterwards."""
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    before = array_utils._multiarray._set_madvise_hugepage(True)
    yield
    array_utils._multiarray._set_madvise_hugepage(before)


def test_the_advice_is_off_within_and_restored_after(advice_on: None) -> None:
    with without_huge_page_advice():
        assert not _advised()
        with without_huge_page_advice():  # nested
            assert not _advised()
        assert not _advised()
    assert _advised()


def test_overlapping_threads_restore_the_advice_once_both_are_out(advice_on: None) -> None:
    """Two threads inside at once, leaving in the order they entered: the advice stays
    off until the last leaves (saving and restoring per use would end it off)."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with without_huge_page_advice():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with without_huge_page_advice():
            second_in.set()
            first_out.wait(5)
            seen.append(_advised())

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [False]
    assert _advised()


def test_a_process_that_chose_its_advice_keeps_it(
    advice_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")
    with without_huge_page_advice():
        assert _advised()


def test_the_coordinators_checks_run_without_the_advice(
    advice_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    def spy(tables: Any) -> None:
        seen.append(_advised())

    monkeypatch.setattr(table_validation.Gathered, "of", staticmethod(spy))
    monkeypatch.setattr(table_validation, "check_shards", lambda *a, **k: None)
    monkeypatch.setattr(table_validation, "rebuild_shards", lambda t: t)
    table_validation.check_gathered_tables([], KeyLayout(False, False), "memory://x", 0)
    assert seen == [False] and _advised()
