"""How many collectives a save makes (4 real gloo processes): each costs every rank a
check-in round trip in the store and the backend's own latency, so phases that can share
one do. A failure on one rank needs no agreement of its own where a gather to the
coordinator follows: it travels with what that rank sends, and the coordinator's verdict
(a broadcast every rank waits for) raises it on every rank. So the gather of every
rank's keys carries the agreements on opening and preparing (and every rank's tensor
digest); its verdict carries the checks, the claim, rank 0's common state and the
digests; the gather of the commit records carries the agreement on the writes, and the
verdict of the commit is the last collective (torch_dist's results travel with the
commit records: the coordinator writes ``.metadata`` just before it commits). No rank
skips a collective that another enters (every rank sends, whether it failed or not), so
none is left waiting; the failure tests (test_failure_agreement, test_bounded_failure,
test_commit*) hold the rest."""

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
    state = tp_state(rank, tp=2)
    state["step"] = rank  # a common value that differs between ranks: rank 0's is saved
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cloudckpt").addHandler(handler)
    try:
        with dist_guard.recorded_check_ins() as names:
            cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    finally:
        logging.getLogger("cloudckpt").removeHandler(handler)
    loaded = cloudckpt.load(tp_state(rank, tp=2, empty=True), uri)
    check_tp(loaded, rank, tp=2)
    step = cloudckpt.load_common_state_dict(uri)["step"]
    return {"names": names, "step": step, "warnings": warnings}


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_a_save_shares_collectives_between_its_phases(
    rank_pool: Any, tmp_path: Path, backend: str
) -> None:
    """The gather of the tables (carrying the agreements on opening and preparing and
    the tensor digests), one broadcast of the verdict (checks, claim, rank 0's common
    state, digests), the strategy's own, the gather of the commit records (carrying the
    agreement on the writes, and torch_dist's item results) and the broadcast of the
    commit's verdict."""
    outs = rank_pool.run(_count_save_collectives, str(tmp_path), backend)
    for rank, out in enumerate(outs):
        names = out["names"]
        assert names[0].startswith("agreeing on preparing checkpoint"), names
        assert names[1] == "the checks of every rank's keys and the claim", names
        assert names[-2].startswith("agreeing on saving checkpoint"), names
        assert names[-1].startswith("agreeing on committing checkpoint"), names
        assert not any("opening" in n for n in names), names
        assert not any("claiming" in n or "preprocessing" in n or "digest" in n for n in names)
        strategy_own = names[2:-2]
        # torch_dist: its plans gathered and scattered (its items' results travel with
        # the commit records, .metadata is written by the coordinator before the commit);
        # zarr: an all-reduce (any flattened tensors?)
        assert len(strategy_own) == (2 if backend == "torch_dist" else 1), names
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


def _open_fails_on(rank: int, world: int, root: str, failing: int) -> str:
    """Rank ``failing`` cannot open the storage: every rank raises, naming it."""
    # imported before the patch: a module importing ``open_storage`` by name for the
    # first time while it is patched would keep the broken one for the process's later
    # scenarios (the rank pool's processes serve every multi-rank test)
    from cloudckpt import load_session, serialization, session  # noqa: PLC0415, F401
    from tests.test_multirank import tp_state  # noqa: PLC0415

    original = session.open_storage

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise cloudckpt.CheckpointingException("no credentials on this host")

    if rank == failing:
        session.open_storage = broken  # type: ignore[assignment]
    try:
        cloudckpt.save(tp_state(rank, tp=2), os.path.join(root, "ckpt"))
    except cloudckpt.CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        session.open_storage = original  # type: ignore[assignment]
    return "saved"


@pytest.mark.parametrize("failing", [0, 2])
def test_a_rank_that_cannot_open_fails_every_rank_before_anything_is_written(
    rank_pool: Any, tmp_path: Path, failing: int
) -> None:
    """The agreement on opening travels with the gather of the keys: the rank that
    failed (the coordinator too) sends its failure instead, and every rank raises the
    agreement's error, naming it."""
    for message in rank_pool.run(_open_fails_on, str(tmp_path), failing):
        assert "opening checkpoint" in message and "failed on 1 of 4 rank(s)" in message, message
        assert f"rank {failing}: CheckpointingException: no credentials" in message, message
    assert not os.path.exists(tmp_path / "ckpt" / CLAIM_FNAME)


def _save_twice(rank: int, world: int, root: str) -> list[str]:
    from tests.test_multirank import tp_state  # noqa: PLC0415

    uri = os.path.join(root, "ckpt")
    cloudckpt.save(tp_state(rank, tp=2), uri)
    try:
        cloudckpt.save(tp_state(rank, tp=2), uri)
    except cloudckpt.CommitConflictError as exc:
        return [type(exc).__name__, str(exc)]
    return ["saved"]


def test_a_destination_that_is_not_empty_fails_every_rank_as_a_conflict(
    rank_pool: Any, tmp_path: Path
) -> None:
    """The coordinator's check that the destination is empty fails: every rank raises a
    CommitConflictError (the agreement keeps the kind) and the checkpoint still loads."""
    for kind, message in rank_pool.run(_save_twice, str(tmp_path)):
        assert "CommitConflictError" in kind
        assert "opening checkpoint" in message and "rank 0" in message, message
        assert "holds a committed checkpoint" in message, message
    from cloudckpt.checker import verify  # noqa: PLC0415

    assert verify(str(tmp_path / "ckpt")).ok


def _torch_dist_fails(rank: int, world: int, root: str, where: str) -> dict[str, Any]:
    """A torch_dist save where rank 1's data write fails (``where="data"``) or the
    coordinator's ``.metadata`` (``"metadata"``): what each rank raised."""
    from cloudckpt.errors import StorageError  # noqa: PLC0415
    from cloudckpt.formats.dcp.save import DcpPlannedWrite  # noqa: PLC0415
    from cloudckpt.storage import CheckpointStorage  # noqa: PLC0415
    from tests.test_multirank import tp_state  # noqa: PLC0415

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise StorageError("No space left on device")

    patched: list[tuple[Any, str, Any]] = []
    if where == "data" and rank == 1:
        patched.append((CheckpointStorage, "open_stream", CheckpointStorage.open_stream))
    if where == "metadata" and rank == 0:
        original = DcpPlannedWrite.finish
        patched.append((DcpPlannedWrite, "finish", original))
    for owner, name, _ in patched:
        setattr(owner, name, no_space)
    try:
        cloudckpt.save(tp_state(rank, tp=2), os.path.join(root, "ckpt"))
    except cloudckpt.CheckpointingException as exc:
        return {"kinds": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)
    return {"kinds": [], "message": "saved"}


@pytest.mark.parametrize(("where", "failing"), [("data", 1), ("metadata", 0)])
def test_a_torch_dist_write_or_metadata_failure_fails_every_rank_uncommitted(
    rank_pool: Any, tmp_path: Path, where: str, failing: int
) -> None:
    """The agreement on the writes travels with the commit records, and the coordinator
    writes ``.metadata`` only then: a rank's failed write, or the coordinator's failed
    ``.metadata``, is raised on every rank (a StorageError there, so every rank's error
    is one too), naming the rank, and nothing is committed."""
    for out in rank_pool.run(_torch_dist_fails, str(tmp_path), where):
        assert "StorageError" in out["kinds"], out
        assert "saving checkpoint" in out["message"], out
        assert f"rank {failing}: StorageError: No space left on device" in out["message"], out
    assert os.path.exists(tmp_path / "ckpt" / CLAIM_FNAME)
    assert not os.path.exists(tmp_path / "ckpt" / "manifest.json")
    assert not os.path.exists(tmp_path / "ckpt" / "metadata.json")
    assert not os.path.exists(tmp_path / "ckpt" / ".metadata")
