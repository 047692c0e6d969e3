"""Each rank's extra metadata sent pickled; the coordinator's merge of them
(cloudckpt.formats.dcp.extra): what updating with every rank's extra in rank order
gives, each distinct pickle unpickled once."""

from __future__ import annotations

import random
from typing import Any

import pytest

from cloudckpt.formats.dcp import extra as _dcp_extra
from cloudckpt.formats.dcp.extra import PickledExtra, merge_extras


def _sequential(start: dict[str, Any], extras: list[Any]) -> dict[str, Any]:
    out = dict(start)
    for extra in extras:
        if isinstance(extra, dict):
            out.update(extra)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_merge_is_the_rank_order_update(seed: int) -> None:
    rng = random.Random(seed)
    distinct = [
        {f"k{rng.randrange(12)}": (i, rng.randrange(3)) for _ in range(rng.randrange(1, 6))}
        for i in range(rng.randrange(1, 5))
    ]
    extras = [rng.choice([*distinct, None]) for _ in range(rng.randrange(1, 16))]
    start = {"k0": "own", "z": 1}
    merged = dict(start)
    merge_extras(merged, [None if e is None else PickledExtra.of(e) for e in extras])
    expected = _sequential(start, extras)
    assert merged == expected and list(merged) == list(expected)
    # dicts (another writer's plans) and pickles mixed: the same
    mixed = [
        e if i % 2 else (None if e is None else PickledExtra.of(e)) for i, e in enumerate(extras)
    ]
    merged = dict(start)
    merge_extras(merged, mixed)
    assert merged == expected and list(merged) == list(expected)


def test_each_distinct_pickle_is_unpickled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    real = PickledExtra.value

    def value(self: PickledExtra) -> dict[str, Any]:
        calls.append(self.raw)
        return real(self)

    monkeypatch.setattr(_dcp_extra.PickledExtra, "value", value)
    replicas = [PickledExtra.of({f"w{tp}": (tp, 8)}) for tp in range(4)]
    sent = [replicas[rank % 4] for rank in range(64)]  # 16 DP replicas of 4 TP ranks
    merged: dict[str, Any] = {}
    merge_extras(merged, sent)
    assert merged == {f"w{tp}": (tp, 8) for tp in range(4)}
    assert len(calls) == 4


def test_a_pickle_of_something_else_is_refused() -> None:
    with pytest.raises(TypeError, match="list, not a dict"):
        merge_extras({}, [PickledExtra.of([1, 2])])  # type: ignore[arg-type]
