"""Single-process save/load (no process group: a world of one) and its error cases."""

from __future__ import annotations

import json
import os
import pathlib
import uuid

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor, StrictHandling
from cloudckpt.errors import (
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    InvalidKeyError,
    MissingKeysError,
    UncommittedCheckpointError,
    UnexpectedKeysError,
)
from cloudckpt.strategies.zarr import (
    ZarrLoadShardedStrategy,
    flatten_range,
    pad_to_expected_shape,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@pytest.fixture(params=["local", "memory"])
def uri(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://cloudckpt-tests/{uuid.uuid4().hex}/ckpt"


def _values(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(uri, dtype):
    full = _values(dtype)
    cloudckpt.save({"t": ShardedTensor.from_rank_offsets("t", full)}, uri)
    halves = [
        ShardedTensor.from_rank_offsets("t", torch.empty(4, 3, dtype=dtype), (1, i, 2))
        for i in (0, 1)
    ]
    loaded = cloudckpt.load({"a": halves[0], "b": halves[1]}, uri, validate_access_integrity=False)
    assert loaded["a"].dtype == dtype
    assert torch.equal(
        torch.cat([loaded["a"], loaded["b"]], dim=1).view(torch.uint8), full.view(torch.uint8)
    )


def test_all_zero_shards_are_stored(tmp_path):
    uri = str(tmp_path / "ckpt")
    state = {f"z{i}": ShardedTensor.from_rank_offsets(f"z{i}", torch.zeros(3, 2)) for i in range(2)}
    cloudckpt.save(state, uri)
    for key in state:
        assert os.path.getsize(os.path.join(uri, key, "0.0")) == 3 * 2 * 4
    loaded = cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.ones(3, 2)) for k in state}, uri
    )
    assert all(torch.equal(loaded[k], torch.zeros(3, 2)) for k in state)


def test_common_state_and_metadata_json(uri):
    cloudckpt.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
            "args": {"lr": 0.1},
            "iteration": 10,
        },
        uri,
    )
    assert cloudckpt.check_is_distributed_checkpoint(uri)
    assert cloudckpt.load_common_state_dict(uri) == {"args": {"lr": 0.1}, "iteration": 10}
    meta = cloudckpt.load_tensors_metadata(uri)
    assert (
        list(meta) == ["w"] and meta["w"].global_shape == (2,) and meta["w"].dtype == torch.float32
    )


def test_metadata_json_has_exactly_megatron_keys(tmp_path):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)
    with open(os.path.join(uri, "metadata.json")) as f:
        assert json.load(f) == {
            "sharded_backend": "zarr",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }


def test_refuses_non_empty_destination(uri):
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)
    with pytest.raises(cloudckpt.CheckpointingException, match="not empty"):
        cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)


def test_load_of_nothing_and_of_uncommitted(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        cloudckpt.load({}, missing)
    with pytest.raises(FileNotFoundError):  # the built-in it mixes in
        cloudckpt.load({}, missing)
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)
    os.remove(os.path.join(uri, "metadata.json"))
    assert not cloudckpt.check_is_distributed_checkpoint(uri)
    with pytest.raises(UncommittedCheckpointError, match=r"metadata\.json is missing"):
        cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)


def test_incompatible_backend_version_is_refused(tmp_path):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)
    path = os.path.join(uri, "metadata.json")
    with open(path) as f:
        doc = json.load(f)
    doc["common_backend_version"] = 2
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(cloudckpt.CheckpointingException, match="version"):
        cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, uri)
    with pytest.raises(IncompatibleCheckpointError, match="'zarr'"):
        ZarrLoadShardedStrategy().check_backend_compatibility("torch_dist")


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", ""])
def test_invalid_keys_are_rejected_with_the_key(tmp_path, key):
    with pytest.raises(InvalidKeyError, match="invalid key"):
        cloudckpt.save(
            {"x": ShardedTensor.from_rank_offsets(key, torch.ones(2))}, str(tmp_path / "c")
        )
    assert not os.path.exists(tmp_path / "c" / "metadata.json")


def test_pathlib_local_path_is_accepted_and_mangled_uri_rejected(tmp_path):
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ckpt")
    assert cloudckpt.check_is_distributed_checkpoint(tmp_path / "ckpt")
    with pytest.raises(cloudckpt.CheckpointingException, match="pathlib"):
        cloudckpt.load({}, pathlib.PurePosixPath("s3://bucket/key"))


def test_dtype_and_shape_mismatch_are_reported(uri):
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3))}, uri
    )
    with pytest.raises(cloudckpt.CheckpointingException, match=r"stored dtype torch\.float32"):
        cloudckpt.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3, dtype=torch.int32))}, uri
        )
    with pytest.raises(cloudckpt.CheckpointingException, match="allow_shape_mismatch"):
        cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))}, uri)


def test_allow_shape_mismatch_pads_and_cuts(uri):
    stored = torch.arange(6.0).reshape(2, 3)
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", stored)}, uri)
    bigger = ShardedTensor.from_rank_offsets("w", torch.empty(3, 4), allow_shape_mismatch=True)
    smaller = ShardedTensor.from_rank_offsets("w", torch.empty(1, 2), allow_shape_mismatch=True)
    out = cloudckpt.load({"big": bigger, "small": smaller}, uri, validate_access_integrity=False)
    expected = torch.zeros(3, 4)
    expected[:2, :3] = stored
    assert torch.equal(out["big"], expected)
    assert torch.equal(out["small"], stored[:1, :2])


def test_remove_sharded_tensors(uri):
    cloudckpt.save(
        {k: ShardedTensor.from_rank_offsets(k, torch.ones(2)) for k in ("opt.a", "opt.b", "w")}, uri
    )
    cloudckpt.remove_sharded_tensors(uri, "opt.")
    assert list(cloudckpt.load_tensors_metadata(uri)) == ["w"]


# -- strict handling ----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> str:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "b": ShardedTensor.from_rank_offsets("b", torch.full((2,), 2.0)),
            "o": ShardedObject("obj", "payload", (1,), (0,)),
        },
        uri,
    )
    return uri


def _req(*keys: str) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty(2)) for k in keys}


def test_strict_assume_ok_unexpected_ignores_extra_but_missing_fails(saved):
    assert torch.equal(cloudckpt.load(_req("a"), saved)["a"], torch.ones(2))
    with pytest.raises(CheckpointNotFoundError, match="'c'"):
        cloudckpt.load(_req("a", "c"), saved)


@pytest.mark.parametrize("mode", ["raise_all", StrictHandling.RAISE_ALL, "RAISE_ALL"])
def test_strict_raise_all(saved, mode):
    with pytest.raises(MissingKeysError, match=r"\['c'\]"):
        cloudckpt.load(_req("a", "b", "c"), saved, strict=mode)
    with pytest.raises(UnexpectedKeysError, match=r"\['b', 'obj'\]"):
        cloudckpt.load(_req("a"), saved, strict=mode)


def test_strict_raise_unexpected(saved):
    with pytest.raises(UnexpectedKeysError, match=r"\['obj'\]"):
        cloudckpt.load(_req("a", "b"), saved, strict=StrictHandling.RAISE_UNEXPECTED)
    req = {**_req("a", "b"), "o": ShardedObject("obj", None, (1,), (0,))}
    assert cloudckpt.load(req, saved, strict=StrictHandling.RAISE_UNEXPECTED)["o"] == "payload"


def test_strict_log_modes(saved, caplog):
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = cloudckpt.load(_req("a"), saved, strict=StrictHandling.LOG_UNEXPECTED)
    assert torch.equal(out["a"], torch.ones(2))
    assert "['b', 'obj']" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = cloudckpt.load(_req("a", "c"), saved, strict=StrictHandling.LOG_ALL)
    assert "c" not in out and "['c']" in caplog.text and "['b', 'obj']" in caplog.text


def test_strict_return_modes(saved):
    out, missing, unexpected = cloudckpt.load(
        _req("a"), saved, strict=StrictHandling.RETURN_UNEXPECTED
    )
    assert torch.equal(out["a"], torch.ones(2)) and missing == set() and unexpected == {"b", "obj"}
    out, missing, unexpected = cloudckpt.load(_req("b", "c"), saved, strict="return_all")
    assert torch.equal(out["b"], torch.full((2,), 2.0)) and "c" not in out
    assert missing == {"c"} and unexpected == {"a", "obj"}


def test_strict_ignore_all_drops_missing_silently(saved, caplog):
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = cloudckpt.load(_req("a", "c"), saved, strict=StrictHandling.IGNORE_ALL)
    assert set(out) == {"a"} and caplog.text == ""


def test_unknown_strict_value(saved):
    with pytest.raises(ValueError, match="raise_all"):
        cloudckpt.load(_req("a"), saved, strict="sometimes")


def test_zarr_flatten_range_and_pad_to_expected_shape():
    x = torch.arange(12.0).reshape(3, 4)
    flat = ShardedTensor.from_rank_offsets_flat(
        "f", torch.empty(5), (3, 4), flattened_range=slice(2, 7)
    )
    assert torch.equal(flatten_range(flat, x), torch.arange(2.0, 7.0))
    plain = ShardedTensor.from_rank_offsets("p", torch.empty(3, 4))
    assert flatten_range(plain, x) is x
    wide = ShardedTensor.from_rank_offsets("w", torch.empty(2, 6), allow_shape_mismatch=True)
    padded = pad_to_expected_shape(x, wide)
    assert padded.shape == (2, 6)
    assert torch.equal(padded[:, :4], x[:2]) and torch.equal(padded[:, 4:], torch.zeros(2, 2))
    assert pad_to_expected_shape(x, plain) is x
    with pytest.raises(cloudckpt.CheckpointingException, match="'w'"):
        pad_to_expected_shape(torch.zeros(3), wide)
