"""huge_pages.without_huge_page_advice: numpy's huge page advice off while the
coordinator's save or load runs (dist.coordinating), one shared switch, a process's own
choice kept."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import dist, huge_pages, session
from cloudckpt.huge_pages import without_huge_page_advice
from cloudckpt.mapping import ShardedTensor, ShardedTensorFactory
from cloudckpt.strategies.async_utils import AsyncCallsQueue


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


def _factory_state(seen: list[bool], data: torch.Tensor) -> dict[str, Any]:
    """A state dict whose factory notes the advice when the save or load applies it."""

    def build(key: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        seen.append(_advised())
        return ShardedTensor.from_rank_offsets(key, t, replica_id=replica_id)

    return {"w": ShardedTensorFactory("w", data, build, lambda sub: sub, 0, None)}


def test_a_save_and_a_load_run_without_the_advice_on_the_coordinator(
    advice_on: None, tmp_path: Any
) -> None:
    uri = str(tmp_path / "ckpt")
    saved: list[bool] = []
    cloudckpt.save(_factory_state(saved, torch.arange(8.0)), uri)
    assert saved == [False] and _advised()
    loaded: list[bool] = []
    state = cloudckpt.load(_factory_state(loaded, torch.zeros(8)), uri)
    assert loaded == [False] and _advised()
    assert torch.equal(state["w"], torch.arange(8.0))


def test_an_async_saves_commit_runs_without_the_advice(
    advice_on: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit runs later, in the queue's finalization, outside the save's call."""
    seen: list[bool] = []
    commit = session.commit_gathered

    def noting(*args: Any, **kwargs: Any) -> Any:
        seen.append(_advised())
        return commit(*args, **kwargs)

    monkeypatch.setattr(session, "commit_gathered", noting)
    uri = str(tmp_path / "ckpt")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    request = cloudckpt.save(state, uri, async_sharded_save=True)
    assert _advised() and not seen  # the save returned; nothing committed yet
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    assert seen == [False] and _advised()
    assert cloudckpt.verify(uri).ok


def test_other_ranks_keep_the_advice(advice_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with dist.coordinating():
        assert _advised()
