"""How many collectives a save makes (4 real gloo processes): each costs every rank a
check-in round trip in the store and the backend's own latency, so phases that can share
one do (the verdict of the coordinator's checks carries the claim and its common state;
the agreement on the writes carries the commit's tensor digests)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

import cloudckpt
from cloudckpt.manifest import CLAIM_FNAME


def _count_save_collectives(rank: int, world: int, root: str, backend: str) -> dict[str, Any]:
    """Count cloudckpt's collectives (check-ins) of a TP2 x DP2 save, then load it back
    and check it (and what each rank logged about its common state)."""
    from cloudckpt import dist_guard  # noqa: PLC0415
    from tests.test_multirank import check_tp, tp_state  # noqa: PLC0415

    uri = os.path.join(root, f"ckpt-{backend}")
    names: list[str] = []
    original = dist_guard.check_in

    def counting(what: str, group: Any = None) -> None:
        names.append(what)
        original(what, group)

    state = tp_state(rank, tp=2)
    state["step"] = rank  # a common value that differs between ranks: rank 0's is saved
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cloudckpt").addHandler(handler)
    dist_guard.check_in = counting  # type: ignore[assignment]
    try:
        cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    finally:
        dist_guard.check_in = original  # type: ignore[assignment]
        logging.getLogger("cloudckpt").removeHandler(handler)
    loaded = cloudckpt.load(tp_state(rank, tp=2, empty=True), uri)
    check_tp(loaded, rank, tp=2)
    step = cloudckpt.load_common_state_dict(uri)["step"]
    return {"names": names, "step": step, "warnings": warnings}


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_a_save_shares_collectives_between_its_phases(
    rank_pool: Any, tmp_path: Path, backend: str
) -> None:
    """Open, prepare, gather the tables, one broadcast of the verdict (checks, claim and
    rank 0's common state), the strategy's own, one agreement on the writes carrying the
    tensor digests, the gather of the commit records and the agreement on the commit."""
    outs = rank_pool.run(_count_save_collectives, str(tmp_path), backend)
    for rank, out in enumerate(outs):
        names = out["names"]
        assert names[0].startswith("agreeing on opening checkpoint"), names
        assert names[1].startswith("agreeing on preparing checkpoint"), names
        assert names[2] == "gathering every rank's keys", names
        assert names[3] == "the checks of every rank's keys and the claim", names
        assert names[-3].startswith("agreeing on saving checkpoint"), names
        assert names[-1].startswith("agreeing on committing checkpoint"), names
        assert not any("claiming" in n or "preprocessing" in n or "digest" in n for n in names)
        assert out["step"] == 0
        differs = [w for w in out["warnings"] if "common state dict differs" in w]
        assert bool(differs) == (rank != 0), out["warnings"]


def _unpicklable_reference(rank: int, world: int, root: str) -> str:
    """Rank 0's preprocessed common state cannot be pickled: the save fails on every rank."""
    from tests.test_multirank import tp_state  # noqa: PLC0415

    def preprocess(common: dict[str, Any]) -> dict[str, Any]:
        return {**common, "fn": lambda: rank}  # a lambda does not pickle

    try:
        cloudckpt.save(
            tp_state(rank, tp=2),
            os.path.join(root, "ckpt"),
            preprocess_common_before_consistancy_check=preprocess,
        )
    except cloudckpt.CheckpointingException as exc:
        return str(exc)
    return "saved"


def test_a_common_state_that_cannot_travel_fails_every_rank_before_the_claim(
    rank_pool: Any, tmp_path: Path
) -> None:
    """The coordinator pickles its common state for the comparison before it claims the
    URI: the failure is its verdict, on every rank, and nothing is written."""
    for message in rank_pool.run(_unpicklable_reference, str(tmp_path)):
        assert message != "saved"
        assert "cannot be serialized" in message and "'fn'" in message, message
    assert not os.path.exists(tmp_path / "ckpt" / CLAIM_FNAME)
    assert not os.path.exists(tmp_path / "ckpt" / "metadata.json")
