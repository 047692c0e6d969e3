"""How often a rank waiting at a check-in polls the store."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from cloudckpt import dist_guard
from cloudckpt.dist_guard import _naps, longest_nap


def test_a_small_group_learns_its_verdict_within_2_ms_and_a_large_one_spares_the_store():
    assert longest_nap(4) == 0.002
    assert longest_nap(1024) == 1024 * 25e-6
    assert longest_nap(4096) == 0.1
    for ranks in (2, 64, 4096, 100_000):  # the whole group polls ~40,000 times a second at most
        assert ranks / longest_nap(ranks) <= 40_000 or longest_nap(ranks) == 0.1


def test_the_pauses_double_up_to_the_longest():
    assert list(itertools.islice(_naps(4), 5)) == [0.0005, 0.001, 0.002, 0.002, 0.002]
    pauses = list(itertools.islice(_naps(4096), 12))
    assert pauses[0] == 0.0005 and pauses[-1] == 0.1
    assert all(b == min(2 * a, 0.1) for a, b in itertools.pairwise(pauses))


def test_recorded_check_ins_list_each_blocks_check_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """What tests and ``profile_local.py --collectives`` count: every check-in entered
    while a block runs, nested blocks each their own, none after the block."""
    monkeypatch.setattr(dist_guard, "_guard", lambda group: SimpleNamespace(ranks=[0]))
    with dist_guard.recorded_check_ins() as outer:
        dist_guard.check_in("first")
        with dist_guard.recorded_check_ins() as inner:
            dist_guard.check_in("second")
        dist_guard.check_in("third")
    dist_guard.check_in("after")
    assert outer == ["first", "second", "third"] and inner == ["second"]
    assert dist_guard._RECORDERS == []
