"""``cloudckpt.save`` and ``cloudckpt.load`` run with the cyclic garbage collector
paused (see ``cloudckpt.dist.paused_gc``) and leave it as they found it."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor


def _state(n: int, *, empty: bool = False) -> dict[str, Any]:
    make = torch.empty if empty else torch.ones
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", make(8, 8), replica_id=0)
        for i in range(n)
    }


_WORK = ("cloudckpt/session.py", "cloudckpt/load_session.py", "cloudckpt/strategies/")


def _in_checkpoint_work() -> bool:
    """Whether a frame of the stack is in a save's or load's session or strategies
    (their entry points' first lines, before the pause, do not count)."""
    frame = sys._getframe(1)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _WORK):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@pytest.fixture
def collections() -> Iterator[list[bool]]:
    """For each collection that runs while the test does: whether it ran inside a
    save's or load's work."""
    seen: list[bool] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(_in_checkpoint_work())

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_no_collection_runs_inside_save_and_load(tmp_path, collections, backend):
    config = cloudckpt.CheckpointConfig(backend=backend)
    saved, target = _state(200), _state(200, empty=True)
    # a first save and load import what they use (imports may collect: not theirs)
    cloudckpt.save(_state(2), str(tmp_path / "warm-up"), config=config)
    cloudckpt.load(_state(2, empty=True), str(tmp_path / "warm-up"), config=config)
    uri, save, load = str(tmp_path / "ckpt"), cloudckpt.save, cloudckpt.load
    gc.collect()
    gc.set_threshold(10)  # a collection every few allocations while the collector is on
    try:
        collections.clear()
        save(saved, uri, config=config)
        loaded = load(target, uri, config=config)
        assert not any(collections)
        assert gc.isenabled()
        during = len(collections)
        _ = [[] for _ in range(100)]  # the collector runs again after them
        assert len(collections) > during
    finally:
        gc.set_threshold(700, 10, 10)
    assert torch.equal(loaded["t7"], torch.ones(8, 8))


def test_a_collector_turned_off_stays_off(tmp_path):
    gc.disable()
    try:
        cloudckpt.save(_state(3), str(tmp_path / "ckpt"))
        assert not gc.isenabled()
    finally:
        gc.enable()
