"""Single-process save/load (no process group: a world of one) and its error cases.

Save/load tests run over ``location``, i.e. ``checkpoint_uri`` of
``tests/fixtures_object_stores.py``: a local directory, memory://, the S3 API (moto) and
the GCS emulator, with their storage options.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor, StrictHandling
from cloudckpt.errors import (
    CheckpointKeyNotFoundError,
    CheckpointNotFoundError,
    IncompatibleCheckpointError,
    InvalidKeyError,
    MissingKeysError,
    UncommittedCheckpointError,
    UnexpectedKeysError,
)
from cloudckpt.storage import CheckpointStorage
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


StoreLocation = tuple[str, dict[str, Any]]


@pytest.fixture(params=["zarr", "torch_dist"])
def backend(request: pytest.FixtureRequest) -> str:
    """The sharded backend a save/load test runs with: the suite runs for both."""
    return str(request.param)


@pytest.fixture
def location(checkpoint_uri: StoreLocation) -> StoreLocation:
    """``checkpoint_uri`` with fsspec's instance cache left on.

    The fixture's options ask for a new filesystem instance per CheckpointStorage
    (``skip_instance_cache``). A save opens four storages and a load three, and on S3
    every new instance builds its own client (0.1-0.4 s), which made this module take
    ~100 s instead of ~15 s. Here save/load share one instance per endpoint, as in a
    user's process; what they stored is checked through a new instance (``_storage``).
    """
    uri, options = checkpoint_uri
    return uri, {k: v for k, v in options.items() if k != "skip_instance_cache"}


def _storage(location: StoreLocation) -> CheckpointStorage:
    """A storage on a new filesystem instance: sees the objects, not a cached listing."""
    uri, options = location
    return CheckpointStorage(uri, storage_options={**options, "skip_instance_cache": True})


def _one(key: str = "w") -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, torch.ones(2))}


def _values(dtype: torch.dtype, shape=(4, 6)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(location, dtype, backend):
    uri, options = location
    full = _values(dtype)
    cloudckpt.save(
        {"t": ShardedTensor.from_rank_offsets("t", full)},
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    halves = [
        ShardedTensor.from_rank_offsets("t", torch.empty(4, 3, dtype=dtype), (1, i, 2))
        for i in (0, 1)
    ]
    loaded = cloudckpt.load(
        {"a": halves[0], "b": halves[1]},
        uri,
        validate_access_integrity=False,
        storage_options=options,
    )
    assert loaded["a"].dtype == dtype
    assert torch.equal(
        torch.cat([loaded["a"], loaded["b"]], dim=1).view(torch.uint8), full.view(torch.uint8)
    )


def test_all_zero_shards_are_stored(location):
    uri, options = location
    state = {f"z{i}": ShardedTensor.from_rank_offsets(f"z{i}", torch.zeros(3, 2)) for i in range(2)}
    cloudckpt.save(state, uri, sharded_strategy=("zarr", 1), storage_options=options)
    storage = _storage(location)
    for key in state:
        assert storage.read(f"{key}/0.0") == bytes(3 * 2 * 4)
    loaded = cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.ones(3, 2)) for k in state},
        uri,
        storage_options=options,
    )
    assert all(torch.equal(loaded[k], torch.zeros(3, 2)) for k in state)


def test_common_state_and_metadata_json(location, backend):
    uri, options = location
    assert not cloudckpt.check_is_distributed_checkpoint(uri, storage_options=options)
    cloudckpt.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
            "o": ShardedObject("obj", {"step": 3}, (1,), (0,)),
            "args": {"lr": 0.1},
            "iteration": 10,
        },
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    assert cloudckpt.check_is_distributed_checkpoint(uri, storage_options=options)
    common = cloudckpt.load_common_state_dict(uri, storage_options=options)
    assert common == {"args": {"lr": 0.1}, "iteration": 10}
    meta = cloudckpt.load_tensors_metadata(uri, storage_options=options)
    assert (
        list(meta) == ["w"] and meta["w"].global_shape == (2,) and meta["w"].dtype == torch.float32
    )
    sharded = cloudckpt.load_sharded_metadata(uri, storage_options=options)
    assert sorted(sharded) == ["obj/shard_0_1", "w"]
    assert isinstance(sharded["obj/shard_0_1"], ShardedObject)


def test_metadata_json_has_exactly_megatron_keys(location, backend):
    uri, options = location
    cloudckpt.save(_one(), uri, sharded_strategy=(backend, 1), storage_options=options)
    assert json.loads(_storage(location).read("metadata.json")) == {
        "sharded_backend": backend,
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }


def test_refuses_non_empty_destination(location):
    uri, options = location
    cloudckpt.save(_one(), uri, storage_options=options)
    with pytest.raises(cloudckpt.CheckpointingException, match="not empty"):
        cloudckpt.save(_one(), uri, storage_options=options)


def test_load_of_nothing_and_of_uncommitted(location):
    uri, options = location
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        cloudckpt.load({}, uri, storage_options=options)
    with pytest.raises(FileNotFoundError):  # the built-in it mixes in
        cloudckpt.load({}, uri, storage_options=options)
    cloudckpt.save(_one(), uri, storage_options=options)
    _storage(location).delete("metadata.json")
    assert not cloudckpt.check_is_distributed_checkpoint(uri, storage_options=options)
    with pytest.raises(UncommittedCheckpointError, match=r"metadata\.json is missing"):
        cloudckpt.load(_one(), uri, storage_options=options)


def test_incompatible_backend_version_is_refused(location):
    uri, options = location
    cloudckpt.save(_one(), uri, storage_options=options)
    storage = _storage(location)
    doc = json.loads(storage.read("metadata.json"))
    doc["common_backend_version"] = 2
    storage.write("metadata.json", json.dumps(doc).encode())
    with pytest.raises(cloudckpt.CheckpointingException, match="version"):
        cloudckpt.load(_one(), uri, storage_options=options)
    with pytest.raises(IncompatibleCheckpointError, match="version"):
        cloudckpt.load_common_state_dict(uri, storage_options=options)
    with pytest.raises(IncompatibleCheckpointError, match="'zarr'"):
        ZarrLoadShardedStrategy().check_backend_compatibility("torch_dist")


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", ""])
def test_invalid_keys_are_rejected_with_the_key(location, key):
    uri, options = location
    with pytest.raises(InvalidKeyError, match="invalid key"):
        cloudckpt.save(
            {"x": ShardedTensor.from_rank_offsets(key, torch.ones(2))},
            uri,
            storage_options=options,
        )
    assert _storage(location).is_empty()  # rejected before anything was written


def test_pathlib_local_path_is_accepted_and_mangled_uri_rejected(tmp_path):
    # Local only: pathlib paths are local paths.
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "ckpt")
    assert cloudckpt.check_is_distributed_checkpoint(tmp_path / "ckpt")
    with pytest.raises(cloudckpt.CheckpointingException, match="pathlib"):
        cloudckpt.load({}, pathlib.PurePosixPath("s3://bucket/key"))


def test_dtype_and_shape_mismatch_are_reported(location, backend):
    uri, options = location
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3))},
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    as_int = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3, dtype=torch.int32))}
    if backend == "torch_dist":  # cast, as Megatron-Core's torch_dist load does
        loaded = cloudckpt.load(as_int, uri, storage_options=options)
        assert torch.equal(loaded["w"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    else:
        with pytest.raises(cloudckpt.CheckpointingException, match=r"stored dtype torch\.float32"):
            cloudckpt.load(as_int, uri, storage_options=options)
    with pytest.raises(cloudckpt.CheckpointingException, match="allow_shape_mismatch"):
        cloudckpt.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3))},
            uri,
            storage_options=options,
        )


def test_allow_shape_mismatch_pads_and_cuts(location, backend):
    uri, options = location
    stored = torch.arange(6.0).reshape(2, 3)
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", stored)},
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    bigger = ShardedTensor.from_rank_offsets("w", torch.empty(3, 4), allow_shape_mismatch=True)
    smaller = ShardedTensor.from_rank_offsets("w", torch.empty(1, 2), allow_shape_mismatch=True)
    out = cloudckpt.load(
        {"big": bigger, "small": smaller},
        uri,
        validate_access_integrity=False,
        storage_options=options,
    )
    expected = torch.zeros(3, 4)
    expected[:2, :3] = stored
    assert torch.equal(out["big"], expected)
    assert torch.equal(out["small"], stored[:1, :2])


def test_remove_sharded_tensors(location, backend):
    uri, options = location
    cloudckpt.save(
        {k: ShardedTensor.from_rank_offsets(k, torch.ones(2)) for k in ("opt.a", "opt.b", "w")},
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    cloudckpt.remove_sharded_tensors(uri, "opt.", storage_options=options)
    assert list(cloudckpt.load_tensors_metadata(uri, storage_options=options)) == ["w"]
    assert not any(p.startswith("opt.") for p in _storage(location).list())
    plain = cloudckpt.load_plain_tensors(uri, storage_options=options)
    assert list(plain) == ["w"] and torch.equal(plain["w"], torch.ones(2))
    # the manifest follows the edit: the checkpoint still verifies, deep
    report = cloudckpt.verify(uri, deep=True, storage_options=options)
    assert report.ok, report.problems
    assert not any(key.startswith("opt.") for key in _manifest_tensor_keys(location))


def _manifest_tensor_keys(location) -> list[str]:
    from cloudckpt.commit_state import read_manifest  # noqa: PLC0415

    manifest = read_manifest(_storage(location))
    assert manifest is not None
    return [t.key for t in manifest.tensors]


# -- strict handling ----------------------------------------------------------------


@pytest.fixture
def saved(location, backend) -> StoreLocation:
    """A checkpoint with tensors ``a``, ``b`` and the object ``obj``; ``(uri, options)``."""
    uri, options = location
    cloudckpt.save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "b": ShardedTensor.from_rank_offsets("b", torch.full((2,), 2.0)),
            "o": ShardedObject("obj", "payload", (1,), (0,)),
        },
        uri,
        sharded_strategy=(backend, 1),
        storage_options=options,
    )
    return location


def _load(saved: StoreLocation, request: dict, **kwargs: Any) -> Any:
    uri, options = saved
    return cloudckpt.load(request, uri, storage_options=options, **kwargs)


def _req(*keys: str) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty(2)) for k in keys}


# Megatron-Core's meaning: *missing* keys are stored but requested by no rank (only the
# *_ALL modes compute them); *unexpected* keys are requested but not stored (dropped from
# the request by every mode but ASSUME_OK_UNEXPECTED).


def test_strict_assume_ok_unexpected_ignores_missing_but_unexpected_fails(saved):
    assert torch.equal(_load(saved, _req("a"))["a"], torch.ones(2))
    with pytest.raises(CheckpointKeyNotFoundError, match="'c'"):
        _load(saved, _req("a", "c"))


@pytest.mark.parametrize("mode", ["raise_all", StrictHandling.RAISE_ALL, "RAISE_ALL"])
def test_strict_raise_all(saved, mode):
    with pytest.raises(UnexpectedKeysError, match=r"Unexpected keys \(for this rank\): \['c'\]"):
        _load(saved, _req("a", "b", "c"), strict=mode)
    with pytest.raises(MissingKeysError, match=r"Missing keys \(for all ranks\): \['b', 'obj'\]"):
        _load(saved, _req("a"), strict=mode)
    with pytest.raises(UnexpectedKeysError) as info:  # both: one error naming both
        _load(saved, _req("a", "c"), strict=mode)
    assert "['c']" in str(info.value) and "['b', 'obj']" in str(info.value)


def test_strict_raise_unexpected(saved):
    with pytest.raises(UnexpectedKeysError, match=r"\['c'\]") as info:
        _load(saved, _req("a", "b", "c"), strict=StrictHandling.RAISE_UNEXPECTED)
    assert "Missing keys" not in str(info.value)
    # stored keys nobody requested ('obj') are not checked by *_UNEXPECTED modes
    out = _load(saved, _req("a", "b"), strict=StrictHandling.RAISE_UNEXPECTED)
    assert torch.equal(out["b"], torch.full((2,), 2.0))


def test_strict_log_modes(saved, caplog):
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = _load(saved, _req("a", "c"), strict=StrictHandling.LOG_UNEXPECTED)
    assert torch.equal(out["a"], torch.ones(2)) and "c" not in out
    assert "Unexpected keys (for this rank): ['c']" in caplog.text
    assert "Missing keys" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = _load(saved, _req("a", "c"), strict=StrictHandling.LOG_ALL)
    assert "c" not in out and torch.equal(out["a"], torch.ones(2))
    assert "Unexpected keys (for this rank): ['c']" in caplog.text
    assert "Missing keys (for all ranks): ['b', 'obj']" in caplog.text


def test_strict_return_modes(saved):
    out, missing, unexpected = _load(saved, _req("a", "c"), strict=StrictHandling.RETURN_UNEXPECTED)
    assert torch.equal(out["a"], torch.ones(2)) and "c" not in out
    assert missing == set() and unexpected == {"c"}
    out, missing, unexpected = _load(saved, _req("b", "c"), strict="return_all")
    assert torch.equal(out["b"], torch.full((2,), 2.0)) and "c" not in out
    assert missing == {"a", "obj"} and unexpected == {"c"}


def test_strict_ignore_all_drops_unexpected_silently(saved, caplog):
    with caplog.at_level("WARNING", logger="cloudckpt"):
        out = _load(saved, _req("a", "c"), strict=StrictHandling.IGNORE_ALL)
    assert set(out) == {"a"} and caplog.text == ""


def test_unknown_strict_value(saved):
    with pytest.raises(ValueError, match="raise_all"):
        _load(saved, _req("a"), strict="sometimes")


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


def test_messages_never_show_a_password_in_the_uri():
    uri = "memory://user:S3CRET@bucket/ckpt-redaction"
    with pytest.raises(InvalidKeyError) as info:
        cloudckpt.save({"x": ShardedTensor.from_rank_offsets("a//b", torch.ones(2))}, uri)
    assert "S3CRET" not in str(info.value) and "user:***@" in str(info.value)
