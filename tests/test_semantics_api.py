"""Megatron-Core's serialization API, with 4 real gloo
ranks where it is collective.

* ``save`` defaults to torch_dist; ``get_default_save_sharded_strategy``,
  ``get_default_save_common_strategy`` and ``get_default_load_sharded_strategy`` exist
  with Megatron-Core's signatures;
* ``save(..., content_metadata=, preprocess_common_before_consistancy_check=,
  async_sharded_save=)`` and ``load_content_metadata`` behave as in Megatron-Core;
* ``checkpoint_dir`` may be a ``pathlib.Path`` (not one made from a URI);
* messages keep Megatron-Core's wording ("does not exist", "is not a distributed
  checkpoint", "Global shape mismatch"), cloudckpt's context appended.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor, serialization
from cloudckpt.checker import verify
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    UncommittedCheckpointError,
)
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from cloudckpt.strategies.base import SaveShardedStrategy
from cloudckpt.strategies.common import TorchCommonSaveStrategy
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from cloudckpt.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from tests.test_multirank import check_tp, tp_state
from tests.test_semantics_keys import _Records

BACKENDS = ["torch_dist", "zarr"]


def _metadata(uri: str | Path) -> dict[str, Any]:
    with open(os.path.join(uri, "metadata.json")) as f:
        return dict(json.load(f))


# -- item 3: the default backend and the get_default_* functions ------------------------


def test_save_defaults_to_torch_dist_as_megatron(tmp_path):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}, uri)
    assert _metadata(uri) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert os.path.exists(os.path.join(uri, ".metadata"))
    assert cloudckpt.CheckpointConfig().backend == "torch_dist"


def test_get_default_strategies():
    save = serialization.get_default_save_sharded_strategy()
    assert isinstance(save, TorchDistSaveShardedStrategy)
    assert (save.backend, save.version) == ("torch_dist", 1)
    zarr = serialization.get_default_save_sharded_strategy("zarr", 1)
    assert isinstance(zarr, ZarrSaveShardedStrategy) and zarr.backend == "zarr"
    common = serialization.get_default_save_common_strategy()
    assert isinstance(common, TorchCommonSaveStrategy) and (common.backend, common.version) == (
        "torch",
        1,
    )
    with pytest.raises(cloudckpt.CheckpointingException, match="no default strategy"):
        serialization.get_default_save_sharded_strategy("torch_dist", 7)


@pytest.mark.parametrize(
    ("backend", "loader"),
    [("torch_dist", TorchDistLoadShardedStrategy), ("zarr", ZarrLoadShardedStrategy)],
)
def test_get_default_load_sharded_strategy_follows_the_checkpoint(tmp_path, backend, loader):
    uri = tmp_path / "ckpt"
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))},
        str(uri),
        sharded_strategy=(backend, 1),
    )
    for where in (str(uri), uri):
        strategy = serialization.get_default_load_sharded_strategy(where)
        assert isinstance(strategy, loader)
        loaded = cloudckpt.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(3))},
            where,
            sharded_strategy=strategy,
        )
        assert torch.equal(loaded["w"], torch.ones(3))
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        serialization.get_default_load_sharded_strategy(tmp_path / "nothing")


# -- item 4: content_metadata, preprocess_common_before_consistancy_check, async --------


@pytest.mark.parametrize("backend", BACKENDS)
def test_content_metadata_round_trip(tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    content = {"format": "gpt", "version": 3, "dist_opt": {"sharding": "fully_reshardable"}}
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)), "iteration": 5}
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1), content_metadata=content)
    assert cloudckpt.load_content_metadata(uri) == content
    assert cloudckpt.load_content_metadata(Path(uri)) == content
    assert cloudckpt.load_common_state_dict(uri)["content_metadata"] == content
    loaded = cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(3))}, uri)
    assert cloudckpt.load_content_metadata(preloaded_state_dict=loaded) == content
    other = str(tmp_path / "plain")
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}, other)
    assert cloudckpt.load_content_metadata(other) is None
    with pytest.raises(ValueError, match="cannot be None"):
        cloudckpt.load_content_metadata()


def _common_check_scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    def state() -> dict[str, Any]:
        return {**tp_state(rank, tp=2), "iteration": 10, "rank": rank, "lr": 0.1}

    def drop_rank(common: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in common.items() if k != "rank"}

    out: dict[str, Any] = {}
    with _Records(logging.WARNING) as records:
        cloudckpt.save(state(), os.path.join(root, "plain"))
    out["plain"] = records.text()
    with _Records(logging.WARNING) as records:
        cloudckpt.save(
            state(), os.path.join(root, "pre"), preprocess_common_before_consistancy_check=drop_rank
        )
    out["pre"] = records.text()
    with _Records(logging.WARNING) as records:
        cloudckpt.save(state(), os.path.join(root, "novalidate"), validate_access_integrity=False)
    out["novalidate"] = records.text()
    out["saved_rank"] = cloudckpt.load_common_state_dict(os.path.join(root, "pre"))["rank"]
    return out


def test_common_state_consistency_check_and_its_preprocessing(rank_pool, tmp_path):
    """As Megatron-Core: ranks whose common state differs from rank 0's say so at WARNING
    (only rank 0's is saved), after the caller's preprocessing."""
    for rank, out in enumerate(rank_pool.run(_common_check_scenario, str(tmp_path))):
        if rank == 0:
            assert out["plain"] == ""
        else:
            assert f"Rank {rank} common state dict differs from rank 0" in out["plain"]
            # Megatron-Core's exact words (its own test compares the whole message)
            assert (
                f"Rank {rank} common state dict differs from rank 0 common state dict. "
                f"Keys only on rank 0: [], Keys only on {rank}: [], "
                "Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]"
            ) in out["plain"].splitlines()
        assert out["pre"] == "" and out["novalidate"] == ""
        assert out["saved_rank"] == 0


def _async_scenario(rank: int, world: int, uri: str, backend: str, queue: bool) -> bool:
    state = tp_state(rank, tp=2)
    state["iteration"] = 3
    request = cloudckpt.save(
        state,
        uri,
        sharded_strategy=(backend, 1),
        async_sharded_save=True,
        content_metadata={"step": 3},
    )
    assert isinstance(request, AsyncRequest)
    committed_early = cloudckpt.check_is_distributed_checkpoint(uri)
    for value in state.values():  # staged: training may change its tensors now
        if isinstance(value, ShardedTensor):
            value.data.fill_(-1.0)
    if queue:
        calls = AsyncCallsQueue()
        calls.schedule_async_request(request)
        assert calls.maybe_finalize_async_calls(blocking=True) == [0]
    else:
        request.execute_sync()
    assert cloudckpt.check_is_distributed_checkpoint(uri)
    loaded = cloudckpt.load(tp_state(rank, tp=4, empty=True), uri)
    assert check_tp(loaded, rank, 4) == 3 and loaded["iteration"] == 3
    assert cloudckpt.load_content_metadata(uri) == {"step": 3}
    return committed_early


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_sharded_save_returns_a_request_that_commits_when_finalized(
    rank_pool, tmp_path, backend
):
    results = rank_pool.run(_async_scenario, str(tmp_path / "queued"), backend, True)
    assert results == [False] * 4  # nothing committed before finalization
    assert rank_pool.run(_async_scenario, str(tmp_path / "sync"), backend, False) == [False] * 4
    assert _metadata(tmp_path / "queued")["sharded_backend"] == backend


def test_async_save_of_a_strategy_doing_its_own_io_is_refused(tmp_path):
    class OwnIO(SaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: str) -> None:
            raise AssertionError("not reached")

    with pytest.raises(CheckpointingException, match="Cannot apply async_save"):
        cloudckpt.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))},
            str(tmp_path / "ckpt"),
            sharded_strategy=OwnIO("own", 1),
            async_sharded_save=True,
        )


# -- item 5: pathlib.Path -------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_pathlib_paths_work_everywhere(tmp_path, backend):
    uri = tmp_path / "ckpt"
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
        "b": ShardedTensor.from_rank_offsets("b", torch.ones(2)),
        "o": ShardedObject("obj", {"x": 1}, (1,), (0,)),
        "iteration": 2,
    }
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    assert cloudckpt.check_is_distributed_checkpoint(uri)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}
    assert torch.equal(cloudckpt.load(request, uri)["w"], torch.arange(4.0))
    assert cloudckpt.load_common_state_dict(uri)["iteration"] == 2
    assert sorted(cloudckpt.load_tensors_metadata(uri)) == ["b", "w"]
    assert "obj/shard_0_1" in cloudckpt.load_sharded_metadata(uri)
    assert torch.equal(cloudckpt.load_plain_tensors(uri)["w"], torch.arange(4.0))
    cloudckpt.remove_sharded_tensors(uri, "b")
    assert sorted(cloudckpt.load_tensors_metadata(uri)) == ["w"]
    assert cloudckpt.verify(str(uri)).ok


def test_a_path_made_from_a_uri_is_refused():
    with pytest.raises(CheckpointingException, match=r"lost its '//'; pass the URI as a str"):
        cloudckpt.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))},
            Path("s3://bucket/run/iter_1"),
        )
    with pytest.raises(CheckpointingException, match="s3:/bucket"):
        cloudckpt.load({}, Path("s3://bucket/run/iter_1"))
    with pytest.raises(CheckpointingException, match="lost its"):
        cloudckpt.load_content_metadata(Path("gs://bucket/x"))


# -- item 9: Megatron-Core's wording, cloudckpt's context appended ---------------------------


def test_messages_keep_megatrons_wording(tmp_path):
    gone = tmp_path / "nothing"
    with pytest.raises(CheckpointNotFoundError) as info:
        cloudckpt.load({}, str(gone))
    assert str(info.value).startswith(f"Checkpoint directory {gone} does not exist")
    assert f"no checkpoint at '{gone}'" in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()  # a directory that exists (local disks): Megatron-Core's second message
    for call in (lambda: cloudckpt.load({}, str(empty)), lambda: verify(str(empty))):
        with pytest.raises(CheckpointNotFoundError) as info:
            call()
        assert str(info.value) == (
            f"{empty} is not a distributed checkpoint "
            f"(no checkpoint at '{empty}': the directory is empty)"
        )
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match=f"^{junk} is not a distributed checkpoint"):
        cloudckpt.load({}, junk)
    half = tmp_path / "half"
    half.mkdir()
    (half / ".cloudckpt-claim.json").write_text("{}")
    with pytest.raises(UncommittedCheckpointError) as uncommitted:
        cloudckpt.load_common_state_dict(half)
    assert str(uncommitted.value).startswith(f"{half} is not a distributed checkpoint")
    assert "not committed: manifest.json and metadata.json are missing" in str(uncommitted.value)
    for backend in BACKENDS:
        uri = str(tmp_path / backend)
        cloudckpt.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))},
            uri,
            sharded_strategy=(backend, 1),
        )
        with pytest.raises(CheckpointingException) as shape:
            cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(5))}, uri)
        assert str(shape.value).startswith(
            "Global shape mismatch for loaded ((4,)) and expected ((5,)) tensor for key w"
        )
        assert uri in str(shape.value) and "allow_shape_mismatch" in str(shape.value)
