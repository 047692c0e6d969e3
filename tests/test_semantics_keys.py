"""Megatron-Core's meaning of missing and unexpected keys, with
4 real gloo ranks and in one process.

*Missing* keys are stored in the checkpoint but requested by no rank (only the ``*_ALL``
modes compute them); *unexpected* keys are requested by a rank but not stored (every mode
but ``ASSUME_OK_UNEXPECTED`` drops them from the request). With ``ASSUME_OK_UNEXPECTED``
a key absent from a torch_dist checkpoint raises what Megatron-Core lets through there:
PyTorch's ``CheckpointException`` (cloudckpt's error is also one).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor, StrictHandling
from cloudckpt.errors import (
    CheckpointKeyNotFoundError,
    DistributedCheckpointError,
    MissingKeysError,
    UnexpectedKeysError,
)
from cloudckpt.strategies.torch import TorchDistKeyNotFoundError
from tests.test_multirank import reference

BACKENDS = ["torch_dist", "zarr"]


class _Records(logging.Handler):
    """Collects the records of the root logger's tree at ``level`` and above."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _Records:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)


def _save_world(rank: int, world: int, uri: str, backend: str) -> None:
    """k0..k<world-1>, 'spare' (requested by nobody later) and the object 'obj' (one
    shard per rank)."""
    keys = [f"k{r}" for r in range(world)] + ["spare"]
    state: dict[str, Any] = {
        k: ShardedTensor.from_rank_offsets(k, reference(k, (2,)), replica_id=rank) for k in keys
    }
    state["obj"] = ShardedObject("obj", {"rank": rank}, (world,), (rank,))
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))


def _request(rank: int, world: int, absent: bool) -> dict[str, Any]:
    wanted = [f"k{rank}"] + ([f"absent{rank}"] if absent else [])
    out: dict[str, Any] = {k: ShardedTensor.from_rank_offsets(k, torch.empty(2)) for k in wanted}
    out["obj"] = ShardedObject("obj", None, (world,), (rank,))
    return out


def _keys_scenario(rank: int, world: int, uri: str, backend: str) -> dict[str, Any]:
    _save_world(rank, world, uri, backend)
    out: dict[str, Any] = {}
    for mode in ("return_all", "return_unexpected"):
        state, missing, unexpected = cloudckpt.load(
            _request(rank, world, absent=True), uri, strict=mode, validate_access_integrity=False
        )
        assert torch.equal(state[f"k{rank}"], reference(f"k{rank}", (2,)))
        assert state["obj"] == {"rank": rank} and f"absent{rank}" not in state
        out[mode] = (sorted(missing), sorted(unexpected))
    with _Records(logging.WARNING) as records:
        state = cloudckpt.load(
            _request(rank, world, absent=True),
            uri,
            strict="log_all",
            validate_access_integrity=False,
        )
    assert f"absent{rank}" not in state
    out["log_all"] = records.text()
    for mode in ("raise_unexpected", "raise_all"):
        try:
            cloudckpt.load(_request(rank, world, absent=rank == 2), uri, strict=mode)
        except cloudckpt.CheckpointingException as exc:
            out[mode] = (type(exc).__name__, isinstance(exc, DistributedCheckpointError), str(exc))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_and_unexpected_keys_across_ranks(rank_pool, tmp_path, backend):
    results = rank_pool.run(_keys_scenario, str(tmp_path / "ckpt"), backend)
    for rank, out in enumerate(results):
        # missing: stored, requested by no rank (judged over all ranks), *_ALL only
        # unexpected: requested by this rank, not stored (this rank's own)
        assert out["return_all"] == (["spare"], [f"absent{rank}"])
        assert out["return_unexpected"] == ([], [f"absent{rank}"])
        log = out["log_all"]
        assert "Missing keys (for all ranks): ['spare']" in log
        assert f"Unexpected keys (for this rank): ['absent{rank}']" in log
        # RAISE_UNEXPECTED: rank 2 requests 'absent2'; every rank raises its kind
        kind, agreed, message = out["raise_unexpected"]
        assert kind == "UnexpectedKeysError" and "'absent2'" in message and "rank 2" in message
        assert agreed and "Missing keys" not in message
        # RAISE_ALL: 'spare' is missing everywhere (MissingKeysError on ranks 0, 1, 3) and
        # rank 2 also has an unexpected key (UnexpectedKeysError): two kinds, so every
        # rank raises a DistributedCheckpointError naming both
        kind, agreed, message = out["raise_all"]
        assert kind == "DistributedCheckpointError" and agreed
        assert "MissingKeysError" in message and "UnexpectedKeysError" in message
        assert "Missing keys (for all ranks): ['spare']" in message and "'absent2'" in message


def _clean_strict_load(rank: int, world: int, uri: str) -> list[str]:
    _save_world(rank, world, uri, "torch_dist")
    request = {
        **{
            f"k{r}": ShardedTensor.from_rank_offsets(f"k{r}", torch.empty(2), replica_id=rank)
            for r in range(world)
        },
        "spare": ShardedTensor.from_rank_offsets("spare", torch.empty(2), replica_id=rank),
        "obj": ShardedObject("obj", None, (world,), (rank,)),
    }
    with _Records(logging.WARNING) as records:
        state, missing, unexpected = cloudckpt.load(request, uri, strict="return_all")
        cloudckpt.load(request, uri, strict="raise_all")
        cloudckpt.load(request, uri, strict="log_all")
    assert missing == set() and unexpected == set() and state["obj"] == {"rank": rank}
    return [r.getMessage() for r in records.records]


def test_exact_request_reports_nothing_in_any_mode(rank_pool, tmp_path):
    assert rank_pool.run(_clean_strict_load, str(tmp_path / "ckpt")) == [[]] * 4


def _assume_ok_scenario(rank: int, world: int, uri: str) -> dict[str, Any]:
    _save_world(rank, world, uri, "torch_dist")
    request = _request(rank, world, absent=rank == 1)
    try:
        cloudckpt.load(request, uri, validate_access_integrity=False)
    except CheckpointException as exc:
        return {
            "kinds": [c.__name__ for c in type(exc).__mro__],
            "key_error": isinstance(exc, KeyError),
            "cloudckpt": isinstance(exc, CheckpointKeyNotFoundError),
            "failed": sorted(exc.failures),
            "message": str(exc),
        }
    return {"raised": False}


def test_assume_ok_unexpected_lets_pytorchs_checkpoint_exception_through(rank_pool, tmp_path):
    """Megatron-Core leaves a key absent from a torch_dist checkpoint to DCP, which raises
    ``CheckpointException`` on every rank: so does cloudckpt (a subclass of both)."""
    for out in rank_pool.run(_assume_ok_scenario, str(tmp_path / "ckpt")):
        assert "CheckpointException" in out["kinds"] and "TorchDistKeyNotFoundError" in out["kinds"]
        assert out["key_error"] and out["cloudckpt"] and out["failed"] == [1]
        assert "'absent1'" in out["message"] and "rank 1" in out["message"]


def test_torch_dist_key_error_in_one_process(tmp_path):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, uri)
    request = {
        "a": ShardedTensor.from_rank_offsets("a", torch.empty(2)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(2)),
    }
    with pytest.raises(CheckpointException) as info:
        cloudckpt.load(request, uri)
    error = info.value
    assert isinstance(error, TorchDistKeyNotFoundError) and isinstance(error, KeyError)
    assert isinstance(error, cloudckpt.CheckpointingException) and error.keys == ("b",)
    assert "['b']" in str(error) and uri in str(error)
    failure, stack = error.failures[0]
    assert isinstance(failure, KeyError) and stack is not None
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is TorchDistKeyNotFoundError and str(again) == str(error)
    assert again.keys == ("b",) and sorted(again.failures) == [0]
    # a missing ShardedObject shard too
    with pytest.raises(CheckpointException, match="sharded object"):
        cloudckpt.load({"o": ShardedObject("o", None, (1,), (0,))}, uri)
    # any other mode drops the key instead (and RAISE_* raise cloudckpt's error)
    assert set(cloudckpt.load(request, uri, strict="log_unexpected")) == {"a"}
    with pytest.raises(UnexpectedKeysError, match=r"\['b'\]"):
        cloudckpt.load(request, uri, strict=StrictHandling.RAISE_UNEXPECTED)


@pytest.mark.parametrize("backend", BACKENDS)
def test_raise_all_on_missing_keys_only(tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    state = {k: ShardedTensor.from_rank_offsets(k, torch.ones(2)) for k in ("a", "c")}
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    request = {"a": ShardedTensor.from_rank_offsets("a", torch.empty(2))}
    with pytest.raises(MissingKeysError) as info:
        cloudckpt.load(request, uri, strict="raise_all")
    message = str(info.value)
    assert message.startswith("Some keys found in the checkpoint are missing")
    assert "Missing keys (for all ranks): ['c']" in message and uri in message
    assert "Unexpected keys" not in message
    # *_UNEXPECTED modes do not look for missing keys
    assert set(cloudckpt.load(request, uri, strict="raise_unexpected")) == {"a"}


def test_zarr_assume_ok_unexpected_raises_cloudckpts_key_error(tmp_path):
    uri = str(tmp_path / "ckpt")
    state = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}
    cloudckpt.save(state, uri, sharded_strategy=("zarr", 1))
    with pytest.raises(CheckpointKeyNotFoundError, match="'b'"):
        cloudckpt.load({"b": ShardedTensor.from_rank_offsets("b", torch.empty(2))}, uri)
