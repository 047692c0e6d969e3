"""A failure on one rank reaches every rank quickly (4 real gloo processes).

Each scenario catches what cloudckpt raised on its rank and returns a summary, so
the rank process stays alive after the error, as a training loop that handles it
would. Before the agreement existed, the ranks that did not fail waited in the next
collective until the process group timed out.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor, StrictHandling, dist
from cloudckpt.convert import convert
from cloudckpt.errors import (
    CheckpointingException,
    CommitConflictError,
    DistributedCheckpointError,
    MissingKeysError,
    distributed_variant,
)
from cloudckpt.launch import RankPool
from tests.test_multirank import check_tp, tp_state

BACKENDS = ["zarr", "torch_dist"]
QUICK_S = 10.0  # "within seconds": the process group's own timeout is 30 minutes


def _outcome(fn, *args, **kwargs) -> dict:
    """Run ``fn``; describe what it raised (or returned), how long it took and when it
    raised (also used by tests/test_bounded_failure.py)."""
    started = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {
            "raised": True,
            "kinds": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "failed_ranks": sorted(getattr(exc, "failures", {})),
            "elapsed": time.monotonic() - started,
            "raised_at": time.time(),  # wall clock, to compare across processes
        }
    return {"raised": False, "value": value, "elapsed": time.monotonic() - started}


def _assert_all_raised(outcomes: list[dict], kind: str, failed_ranks: list[int], *words: str):
    for rank, out in enumerate(outcomes):
        assert out["raised"], (rank, out)
        assert kind in out["kinds"] and "CheckpointingException" in out["kinds"], (rank, out)
        assert out["elapsed"] < QUICK_S, (rank, out)
        if len(outcomes) > 1:
            assert out["failed_ranks"] == failed_ranks, (rank, out)
        for word in (*words, *(f"rank {r}" for r in failed_ranks)):
            assert word in out["message"], (rank, word, out["message"])


# -- load: the reproduction, and failures in each phase of a load -----------------


def _load_with_one_rank_elsewhere(rank: int, world: int, root: str, backend: str) -> dict:
    uri = os.path.join(root, "ckpt")
    cloudckpt.save(tp_state(rank, tp=2), uri, sharded_strategy=(backend, 1))
    empty = os.path.join(root, "empty")
    os.makedirs(empty, exist_ok=True)
    target = empty if rank == world - 1 else uri  # the last rank points at no checkpoint
    return _outcome(cloudckpt.load, tp_state(rank, tp=2, empty=True), target)


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_failing_on_one_rank_raises_on_every_rank_quickly(rank_pool, tmp_path, backend):
    outcomes = rank_pool.run(_load_with_one_rank_elsewhere, str(tmp_path), backend)
    _assert_all_raised(outcomes, "DistributedCheckpointError", [3], str(tmp_path / "empty"))


def _load_missing_key_on_one_rank(rank: int, world: int, uri: str, backend: str) -> dict:
    cloudckpt.save(tp_state(rank, tp=2), uri, sharded_strategy=(backend, 1))
    request = tp_state(rank, tp=2, empty=True)
    if rank == 1:  # ASSUME_OK_UNEXPECTED: found missing only when its data is read
        request["absent"] = ShardedTensor.from_rank_offsets("absent", torch.empty(3))
    return _outcome(cloudckpt.load, request, uri, validate_access_integrity=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_key_missing_on_one_rank_fails_the_load_on_every_rank(rank_pool, tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    outcomes = rank_pool.run(_load_missing_key_on_one_rank, uri, backend)
    _assert_all_raised(outcomes, "DistributedCheckpointError", [1], "'absent'", uri)


def _strict_missing_on_one_rank(rank: int, world: int, uri: str) -> dict:
    cloudckpt.save(tp_state(rank, tp=2), uri)
    request = tp_state(rank, tp=2, empty=True)
    if rank == 2:
        request["absent"] = ShardedTensor.from_rank_offsets("absent", torch.empty(3))
    return _outcome(
        cloudckpt.load,
        request,
        uri,
        validate_access_integrity=False,
        strict=StrictHandling.RAISE_ALL,
    )


def test_strict_key_check_failing_on_one_rank_raises_its_kind_everywhere(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    outcomes = rank_pool.run(_strict_missing_on_one_rank, uri)
    # every failed rank raised UnexpectedKeysError (requested, not stored): so does every rank
    _assert_all_raised(outcomes, "UnexpectedKeysError", [2], "'absent'")
    assert all("DistributedCheckpointError" in out["kinds"] for out in outcomes)


# -- save: the coordinator's own failure is typed on every rank ---------------------------


def _save_twice(rank: int, world: int, uri: str) -> dict:
    cloudckpt.save(tp_state(rank, tp=2), uri)
    return _outcome(cloudckpt.save, tp_state(rank, tp=2), uri)


def test_saving_over_a_committed_checkpoint_is_a_commit_conflict_on_every_rank(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    outcomes = rank_pool.run(_save_twice, uri)
    _assert_all_raised(outcomes, "CommitConflictError", [0], uri, "not empty")
    assert all("FileExistsError" in out["kinds"] for out in outcomes)


# -- entry points that are collective only when asked -------------------------------------


def _collective_reads(rank: int, world: int, root: str) -> dict:
    uri = os.path.join(root, "run", "iter_0000005")
    state = tp_state(rank, tp=2)
    state["iteration"] = 5
    cloudckpt.save(state, uri)
    nowhere = os.path.join(root, "nowhere")
    calls = {
        "common": _outcome(cloudckpt.load_common_state_dict, uri, collective=True),
        "tensors": _outcome(cloudckpt.load_tensors_metadata, uri, collective=True),
        "sharded": _outcome(cloudckpt.load_sharded_metadata, uri, collective=True),
        "latest": _outcome(cloudckpt.latest, os.path.join(root, "run"), collective=True),
        "verify": _outcome(cloudckpt.verify, uri, collective=True),
        "missing_common": _outcome(cloudckpt.load_common_state_dict, nowhere, collective=True),
        "missing_verify": _outcome(cloudckpt.verify, nowhere, collective=True),
    }
    calls["common"]["value"] = calls["common"].get("value", {}).get("iteration")
    calls["tensors"]["value"] = sorted(calls["tensors"].get("value", {}))
    calls["sharded"]["value"] = sorted(calls["sharded"].get("value", {}))
    calls["verify"]["value"] = getattr(calls["verify"].get("value"), "ok", None)
    return calls


def test_collective_reads_share_rank_0s_answer_or_its_error(rank_pool, tmp_path):
    outcomes = rank_pool.run(_collective_reads, str(tmp_path))
    keys = sorted(["w_col", "w_row", "bias"])
    for rank, calls in enumerate(outcomes):
        assert calls["common"] == {**calls["common"], "raised": False, "value": 5}, rank
        assert calls["tensors"]["value"] == keys and calls["sharded"]["value"] == keys
        assert calls["latest"]["value"] == str(tmp_path / "run" / "iter_0000005")
        assert calls["verify"]["value"] is True
    for name in ("missing_common", "missing_verify"):
        _assert_all_raised(
            [calls[name] for calls in outcomes],
            "CheckpointingException",
            [0],
            str(tmp_path / "nowhere"),
        )


def _convert_in_a_group(rank: int, world: int, root: str) -> dict:
    return _outcome(convert, root, os.path.join(root, "copy"))


def test_convert_in_a_process_group_fails_on_every_rank_at_once(rank_pool, tmp_path):
    outcomes = rank_pool.run(_convert_in_a_group, str(tmp_path))
    for rank, out in enumerate(outcomes):
        assert out["raised"] and "CheckpointingException" in out["kinds"]
        assert f"rank {rank} of 4" in out["message"] and str(tmp_path) in out["message"]


# -- memory:// is one process's store -------------------------------------------------------


def _memory_store(rank: int, world: int, uri: str) -> dict:
    return _outcome(cloudckpt.save, tp_state(rank, tp=2), uri)


def test_memory_store_is_refused_with_several_ranks(rank_pool):
    outcomes = rank_pool.run(_memory_store, "memory://agreement/ckpt")
    _assert_all_raised(outcomes, "CheckpointingException", [0, 1, 2, 3], "memory://")
    assert all("other 3 rank(s) cannot see" in out["message"] for out in outcomes)


def test_memory_store_works_in_a_world_of_one():
    uri = "memory://agreement-single/ckpt"
    cloudckpt.save(tp_state(0, tp=1), uri)
    assert check_tp(cloudckpt.load(tp_state(0, tp=1, empty=True), uri), 0, tp=1) == 3


# -- the agreement itself --------------------------------------------------------------------


def test_agreement_in_a_world_of_one_raises_the_error_unchanged():
    with pytest.raises(CommitConflictError) as info, dist.agree("something"):
        raise CommitConflictError("taken")
    assert type(info.value) is CommitConflictError
    with dist.agree("nothing"):
        pass


def test_distributed_variants_keep_the_kind_and_pickle_as_the_base():
    kind = distributed_variant(MissingKeysError)
    assert kind is distributed_variant(MissingKeysError)
    err = kind("keys missing on rank 2", {2: "MissingKeysError: ..."})
    assert isinstance(err, MissingKeysError) and isinstance(err, DistributedCheckpointError)
    assert isinstance(err, KeyError) and str(err) == "keys missing on rank 2"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DistributedCheckpointError
    assert back.failures == {2: "MissingKeysError: ..."}
    assert distributed_variant(DistributedCheckpointError) is DistributedCheckpointError
    assert issubclass(kind, CheckpointingException)


# -- RankPool keeps every error it has when another rank times out -------------------------


def _one_slow_one_failing(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(4)
        return
    raise ValueError("rank one broke")


def _ready(rank: int, world: int) -> int:
    return rank


@pytest.mark.multirank
def test_rank_pool_timeout_reports_the_other_ranks_traceback():
    with RankPool(2, timeout_s=120) as pool:
        assert pool.run(_ready) == [0, 1]  # started: the timeout below is the function's
        pool.timeout_s = 1.5
        with pytest.raises(DistributedCheckpointError) as info:
            pool.run(_one_slow_one_failing)
    message = str(info.value)
    assert "ValueError: rank one broke" in message and "Traceback" in message
    assert "did not finish within 2 s" in message
    assert sorted(info.value.failures) == [0, 1]


def _unpicklable_result(rank: int, world: int, root: str) -> dict:
    uri = os.path.join(root, "ckpt")
    return _outcome(
        dist.run_on_coordinator, lambda: {"f": lambda: None}, f"sharing a lambda from {uri}"
    )


def test_a_result_that_cannot_be_sent_fails_on_every_rank_instead_of_hanging(rank_pool, tmp_path):
    outcomes = rank_pool.run(_unpicklable_result, str(tmp_path))
    _assert_all_raised(outcomes, "DistributedCheckpointError", [0], str(tmp_path / "ckpt"))
