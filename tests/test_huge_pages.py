"""huge_pages.without_huge_page_advice: numpy's huge page advice off while the
coordinator's steps run, one shared switch, a process's own choice kept."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cloudckpt import huge_pages, table_validation
from cloudckpt.huge_pages import without_huge_page_advice
from cloudckpt.keys import KeyLayout


def _advised() -> bool:
    return bool(huge_pages.numpy_advises_huge_pages())


@pytest.fixture
def advice_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """numpy's huge page advice on (as by default on Linux), restored afterwards."""
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    before = huge_pages._multiarray()._set_madvise_hugepage(True)
    yield
    huge_pages._multiarray()._set_madvise_hugepage(before)


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
