"""How often a rank waiting at a check-in polls the store."""

from __future__ import annotations

import itertools

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
