"""What a load reports when the checkpoint lacks something: a key it does not store
(not a FileNotFoundError: a training loop's ``except FileNotFoundError: start fresh``
must not restart from scratch), an object its manifest lists (damage), or a URI that
holds no checkpoint at all."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    CheckpointNotFoundError,
    CorruptObjectError,
    UncommittedCheckpointError,
)
from cloudckpt.launch import RankPool
from cloudckpt.strategies.base import StrategyAction, get_default_strategy
from cloudckpt.tracker import remove_checkpoint

BACKENDS = ("zarr", "torch_dist")


def _save(uri: str, backend: str) -> None:
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, backend, 1)
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0)),
        "obj": ShardedObject("obj", {"step": 3}, (1,), (0,)),
        "iteration": 3,
    }
    cloudckpt.save(state, uri, sharded_strategy=strategy)


def _tensor(key: str) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.empty(6))


def _resume_or_start_fresh(request: dict, uri: str) -> str:
    """The training-loop idiom the error must not fall into."""
    try:
        cloudckpt.load(request, uri)
    except FileNotFoundError:
        return "started fresh"
    return "resumed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_tensor_key_is_not_a_file_not_found_error(tmp_path: Path, backend: str) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, backend)
    request = {"w": _tensor("w"), "new_layer.weight": _tensor("new_layer.weight")}
    with pytest.raises(CheckpointKeyNotFoundError) as caught:
        cloudckpt.load(request, uri)
    err = caught.value
    assert not isinstance(err, FileNotFoundError)
    assert isinstance(err, CheckpointingException) and isinstance(err, KeyError)
    assert err.keys == ("new_layer.weight",)
    message = str(err)
    assert "'new_layer.weight'" in message and repr(uri) in message and "rank 0" in message
    with pytest.raises(CheckpointKeyNotFoundError):
        _resume_or_start_fresh(request, uri)
    assert _resume_or_start_fresh({"w": _tensor("w")}, uri) == "resumed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_missing_sharded_object_is_not_a_file_not_found_error(
    tmp_path: Path, backend: str
) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, backend)
    request = {"extra": ShardedObject("extra", None, (1,), (0,))}
    with pytest.raises(CheckpointKeyNotFoundError) as caught:
        cloudckpt.load(request, uri)
    assert not isinstance(caught.value, FileNotFoundError)
    assert caught.value.keys == ("extra/shard_0_1",)
    assert repr(uri) in str(caught.value) and "rank 0" in str(caught.value)
    loaded = cloudckpt.load({"obj": ShardedObject("obj", None, (1,), (0,))}, uri)
    assert loaded["obj"] == {"step": 3}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_object_the_manifest_lists_but_the_store_lost_is_damage(
    tmp_path: Path, backend: str
) -> None:
    uri = tmp_path / "ckpt"
    _save(str(uri), backend)
    # the tensor's data: zarr chunk w/0, or the DCP data file
    data = uri / "w" / "0" if backend == "zarr" else next(uri.glob("*.distcp"))
    data.unlink()
    with pytest.raises(CorruptObjectError, match="listed in the manifest but does not exist") as e:
        cloudckpt.load({"w": _tensor("w")}, str(uri))
    assert not isinstance(e.value, FileNotFoundError)
    assert str(data.relative_to(uri)) in str(e.value)


def _missing_on_one_rank(rank: int, world: int, uri: str) -> str:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(world, 2), replica_id=rank)}
    cloudckpt.save(state, uri)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(world, 2))}
    if rank == 2:
        request["only_rank_2"] = ShardedTensor.from_rank_offsets("only_rank_2", torch.empty(1))
    try:
        cloudckpt.load(request, uri, validate_access_integrity=False)
    except FileNotFoundError as exc:
        return f"FileNotFoundError: {exc}"
    except CheckpointKeyNotFoundError as exc:
        return f"CheckpointKeyNotFoundError: {exc}"
    return "loaded"


def test_a_key_missing_on_one_rank_fails_every_rank_naming_it(
    rank_pool: RankPool, tmp_path: Path
) -> None:
    uri = str(tmp_path / "ckpt")
    outcomes = rank_pool.run(_missing_on_one_rank, uri)
    for outcome in outcomes:
        assert outcome.startswith("CheckpointKeyNotFoundError"), outcomes
        assert "rank 2" in outcome and "'only_rank_2'" in outcome and uri in outcome, outcome


# -- no checkpoint at all vs a half-written one ------------------------------------------

READERS = {
    "load": lambda uri: cloudckpt.load({"w": _tensor("w")}, uri),
    "load_common_state_dict": cloudckpt.load_common_state_dict,
    "load_tensors_metadata": cloudckpt.load_tensors_metadata,
    "load_sharded_metadata": cloudckpt.load_sharded_metadata,
    "verify": cloudckpt.verify,
    "remove_checkpoint": remove_checkpoint,
}


def _no_checkpoint(tmp_path: Path, kind: str) -> Path:
    """A location that holds no checkpoint: nothing, other data, or checkpoints below it."""
    where = tmp_path / kind
    if kind == "empty-directory":
        where.mkdir()
    elif kind == "unrelated-files":
        (where / "logs").mkdir(parents=True)
        (where / "logs" / "train.log").write_text("step 1\n")
        (where / "notes.txt").write_text("not a checkpoint\n")
    elif kind == "parent-of-checkpoints":
        _save(str(where / "iter_0000001"), "zarr")
    return where


@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize(
    "kind", ["nonexistent", "empty-directory", "unrelated-files", "parent-of-checkpoints"]
)
def test_no_checkpoint_at_the_uri_is_not_found_not_uncommitted(
    tmp_path: Path, kind: str, reader: str
) -> None:
    where = _no_checkpoint(tmp_path, kind)
    before = sorted(where.rglob("*")) if where.exists() else None
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at") as caught:
        READERS[reader](str(where))
    assert not isinstance(caught.value, UncommittedCheckpointError)
    assert repr(str(where)) in str(caught.value)
    assert (sorted(where.rglob("*")) if where.exists() else None) == before  # nothing removed


def _half_written(tmp_path: Path, kind: str) -> Path:
    where = tmp_path / "ckpt"
    _save(str(where), "zarr")
    (where / "metadata.json").unlink()
    if kind == "claim-only":
        for path in where.iterdir():
            if path.name != ".cloudckpt-claim.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    return where


@pytest.mark.parametrize("reader", [r for r in READERS if r not in ("verify", "remove_checkpoint")])
@pytest.mark.parametrize("kind", ["manifest-without-metadata", "claim-only"])
def test_a_half_written_checkpoint_stays_uncommitted(
    tmp_path: Path, kind: str, reader: str
) -> None:
    where = _half_written(tmp_path, kind)
    with pytest.raises(UncommittedCheckpointError, match="is not committed") as caught:
        READERS[reader](str(where))
    assert not isinstance(caught.value, FileNotFoundError)


@pytest.mark.parametrize("kind", ["manifest-without-metadata", "claim-only"])
def test_verify_reports_a_half_written_checkpoint_as_uncommitted(tmp_path: Path, kind: str) -> None:
    report = cloudckpt.verify(str(_half_written(tmp_path, kind)))
    assert not report.ok and not report.committed
    assert "missing-metadata" in {p.kind for p in report.problems}
