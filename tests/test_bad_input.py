"""Bad input: one test per row of the README's "Bad input" table.

Each test asserts the exception class and what its message names (URI, key, rank,
file), and, for the save-side rows, that nothing was written: the check ran before the
claim. The rows that need several ranks (dtype or shape disagreement between ranks,
two jobs racing to one URI) run real gloo processes.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import (
    BucketNotFoundError,
    CheckpointingException,
    CheckpointNotFoundError,
    CommitConflictError,
    CommonStateError,
    IncompatibleCheckpointError,
    InvalidKeyError,
    InvalidURIError,
    KeyCollisionError,
    MalformedCheckpointError,
    ShardingValidationError,
    TensorMismatchError,
)
from cloudckpt.launch import RankPool
from cloudckpt.manifest import ManifestError
from cloudckpt.storage import crc32c, open_checkpoint
from tests.fixtures_object_stores import STORE_CASES, StoreLocation, bucket_location, server_for

BACKENDS = ["zarr", "torch_dist"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[RankPool]:
    """Two real processes in one gloo group (a 2-rank job)."""
    with RankPool(2, timeout_s=120) as pool:
        yield pool


@pytest.fixture(scope="module")
def other_two_ranks() -> Iterator[RankPool]:
    """Another 2-rank job, in a group of its own."""
    with RankPool(2, timeout_s=120) as pool:
        yield pool


def _tensor(key: str, n: int = 4, dtype: torch.dtype = torch.float32) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.arange(n, dtype=dtype))


def _stored(uri: str, options: dict[str, Any]) -> list[str]:
    return open_checkpoint(uri, storage_options=options).list()


def _saved(uri: str, options: dict[str, Any], backend: str = "zarr") -> None:
    state = {"w": _tensor("w"), "o": ShardedObject("o", {"x": 1}, (1,), (0,)), "step": 3}
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1), storage_options=options)


# -- URIs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri", ["s3:/bad/x", "s3:bad/x", "gs:/b/x", "://x", "foo://x", "s3://", "gs://"]
)
def test_malformed_or_unknown_protocol_uri(
    uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a URI taken for a local path would create folders here
    calls = [
        lambda: cloudckpt.save({"w": _tensor("w")}, uri),
        lambda: cloudckpt.load({"w": _tensor("w")}, uri),
        lambda: cloudckpt.latest(uri),
        lambda: cloudckpt.verify(uri),
    ]
    for call in calls:
        with pytest.raises(InvalidURIError) as info:
            call()
        assert isinstance(info.value, ValueError) and repr(uri) in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_cli_refuses_a_malformed_uri_as_a_usage_error(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cloudckpt.cli import main  # noqa: PLC0415

    monkeypatch.chdir(tmp_path)
    assert main([command, "s3:/bucket/run"]) == 2
    err = capsys.readouterr().err
    assert "InvalidURIError" in err or "malformed URI" in err, err
    assert "'s3:/bucket/run'" in err and "s3://bucket/run" in err, err
    assert list(tmp_path.iterdir()) == []


# -- buckets --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", STORE_CASES)
def test_missing_bucket(case: str, request: pytest.FixtureRequest) -> None:
    server = server_for(request, case)
    options = server.storage_options()
    scheme = "s3" if case.startswith("s3") else "gs"
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
    run = f"{scheme}://{bucket}/run"
    calls = {
        "latest": lambda: cloudckpt.latest(run, storage_options=options),
        "list": lambda: cloudckpt.list_checkpoints(run, storage_options=options),
        "save": lambda: cloudckpt.save(
            {"w": _tensor("w")}, f"{run}/iter_1", storage_options=options
        ),
        "load": lambda: cloudckpt.load(
            {"w": _tensor("w")}, f"{run}/iter_1", storage_options=options
        ),
        "verify": lambda: cloudckpt.verify(f"{run}/iter_1", storage_options=options),
    }
    for name, call in calls.items():
        with pytest.raises(BucketNotFoundError) as info:
            call()
        error = info.value
        assert isinstance(error, CheckpointNotFoundError), name
        assert error.bucket == bucket and repr(bucket) in str(error), (name, str(error))
        assert run in str(error), (name, str(error))


# -- keys -----------------------------------------------------------------------------------


@pytest.fixture
def location(checkpoint_uri: StoreLocation) -> StoreLocation:
    return checkpoint_uri


def _refused(
    location: StoreLocation, state: dict[str, Any], kind: type, backend: str = "zarr"
) -> str:
    """Save ``state``; it must raise ``kind`` and leave nothing stored. -> the message."""
    uri, options = location
    with pytest.raises(kind) as info:
        cloudckpt.save(state, uri, sharded_strategy=(backend, 1), storage_options=options)
    assert _stored(uri, options) == []  # refused before the claim
    message = str(info.value)
    assert uri.split("://")[-1] in message and "rank 0" in message, message
    return message


ESCAPING_KEYS = ["../escape", "a/../../b", "a//b", "a/", "./a", "/abs", ""]
MANGLED_KEYS = ["w?versionId=1", "w#frag", "w*", "w[0]", "a\\b", "w\nx", "w\x00", "w\x7f"]
COLLIDING_KEYS = [  # (keys, what the message names)
    (["a", "a/0"], "chunk '0'"),
    (["m", "m/1.0"], "chunk '1.0'"),
    (["manifest.json"], "cloudckpt's manifest.json"),
    (["metadata.json/w"], "cloudckpt's metadata.json"),
    (["common.pt"], "common.pt"),
    ([".cloudckpt-claim.json"], "claim"),
    ([".metadata"], "PyTorch DCP's .metadata"),
    (["w/.zarray"], "zarr metadata name"),
]


def test_key_escaping_the_prefix(location: StoreLocation) -> None:
    # every store the same way: refused before the claim, nothing written
    for key in ESCAPING_KEYS:
        message = _refused(location, {"x": _tensor(key), "ok": _tensor("ok")}, InvalidKeyError)
        assert repr(key) in message and "'ok'" not in message, message


def test_key_with_characters_stores_mangle(location: StoreLocation) -> None:
    for key in MANGLED_KEYS:
        message = _refused(location, {"x": _tensor(key)}, InvalidKeyError)
        assert repr(key) in message and "cannot be used in keys" in message, message


def test_keys_are_checked_without_the_sharding_validation_too(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    state = {"a": _tensor("a"), "b": _tensor("a/0"), "c": _tensor("../c")}
    zarr = ("zarr", 1)  # where 'a/0' is a chunk of 'a'
    with pytest.raises(InvalidKeyError) as info:  # the escaping key first, alone
        cloudckpt.save(state, uri, zarr, validate_access_integrity=False)
    assert "'../c'" in str(info.value) and not isinstance(info.value, KeyCollisionError)
    del state["c"]
    with pytest.raises(KeyCollisionError, match="'a/0'"):
        cloudckpt.save(state, uri, zarr, validate_access_integrity=False)
    assert not Path(uri).exists()


def test_keys_differing_only_by_a_version_id_are_both_refused(location: StoreLocation) -> None:
    # s3fs would write both to one object 'w': a committed checkpoint load could not read
    state = {"a": _tensor("w?versionId=1"), "b": _tensor("w?versionId=2")}
    message = _refused(location, state, InvalidKeyError)
    assert "'w?versionId=1'" in message and "'w?versionId=2'" in message
    assert "invalid key(s) (2)" in message


def test_keys_colliding_after_path_mapping(location: StoreLocation) -> None:
    for keys, named in COLLIDING_KEYS:
        state = {f"k{i}": _tensor(k, n=2) for i, k in enumerate(keys)}
        message = _refused(location, state, KeyCollisionError)
        assert named in message and repr(keys[-1]) in message, message
    assert issubclass(KeyCollisionError, InvalidKeyError)


def test_object_colliding_with_a_tensor_after_path_mapping(
    location: StoreLocation, backend: str
) -> None:
    # zarr: the object's file 'o/shard_0_1.pt' is the tensor's directory; torch_dist:
    # the object's DCP item 'o/shard_0_1' is the tensor's item
    tensor_key = "o/shard_0_1.pt" if backend == "zarr" else "o/shard_0_1"
    state = {"t": _tensor(tensor_key), "o": ShardedObject("o", 1, (1,), (0,))}
    message = _refused(location, state, KeyCollisionError, backend)
    assert repr(tensor_key) in message and "object shard 'o/shard_0_1'" in message


def test_convert_refuses_keys_the_target_layout_cannot_store(tmp_path: Path) -> None:
    from cloudckpt.convert import convert  # noqa: PLC0415

    source, target = str(tmp_path / "dcp"), str(tmp_path / "zarr")
    cloudckpt.save(
        {"a": _tensor("a"), "b": _tensor("a/0")}, source, sharded_strategy=("torch_dist", 1)
    )
    with pytest.raises(KeyCollisionError) as info:
        convert(source, target, "zarr")
    assert "'a/0'" in str(info.value) and target in str(info.value)
    assert _stored(target, {}) == []


def test_allowed_neighbours_of_a_tensor_key_are_saved(tmp_path: Path, backend: str) -> None:
    uri = str(tmp_path / "ckpt")
    state = {"a": _tensor("a"), "b": _tensor("a/b"), "c": _tensor("a.0")}
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    loaded = cloudckpt.load({k: _tensor(v.key) for k, v in state.items()}, uri)
    assert all(torch.equal(loaded[k], torch.arange(4.0)) for k in state)


# -- sharding -------------------------------------------------------------------------------


def test_overlapping_shards(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    first = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 2))
    second = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 2))  # the same chunk
    with pytest.raises(ShardingValidationError) as info:
        cloudckpt.save(
            {
                "a": first,
                "b": second,
                "c": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 1, 2)),
            },
            uri,
        )
    message = str(info.value)
    assert "'w'" in message and "saved by 2 main replicas" in message and "ranks 0" in message
    assert uri in message and not Path(uri).exists()


def test_incomplete_coverage(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    half = ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, 0, 2))  # chunk 1 of 2 missing
    with pytest.raises(ShardingValidationError) as info:
        cloudckpt.save({"w": half}, uri)
    message = str(info.value)
    assert "'w'" in message and "1 chunk(s) have no main replica: (1,)" in message
    assert uri in message and not Path(uri).exists()


def _disagreeing_ranks(rank: int, world: int, uri: str, attr: str) -> dict[str, Any]:
    dtype = torch.float16 if attr == "dtype" and rank == 1 else torch.float32
    shape = 3 if attr == "shape" and rank == 1 else 2
    local = torch.ones(shape, dtype=dtype)
    state = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}
    try:
        cloudckpt.save(state, uri)
    except CheckpointingException as exc:
        return {"kinds": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return {"kinds": [], "message": ""}


@pytest.mark.multirank
@pytest.mark.parametrize("attr", ["dtype", "shape"])
def test_dtype_or_shape_disagreement_between_ranks(
    two_ranks: RankPool, tmp_path: Path, attr: str
) -> None:
    uri = str(tmp_path / "ckpt")
    outcomes = two_ranks.run(_disagreeing_ranks, uri, attr)
    # shards of different local shapes are valid (uneven sharding), but here they make
    # the ranks disagree on the global shape
    detail = "dtype differs" if attr == "dtype" else "global_shape differs"
    for rank, out in enumerate(outcomes):
        assert "ShardingValidationError" in out["kinds"], (rank, out)
        message = out["message"]
        assert "'w'" in message and detail in message and uri in message, (rank, message)
        assert "ranks 0" in message and "ranks 1" in message, (rank, message)
    assert not Path(uri).exists()


def _bad_input_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    cases = {
        "key": ({"w": _tensor("w?versionId=1" if rank == 1 else f"w{rank}")}, "keys"),
        "common": ({"w": _tensor(f"w{rank}"), "hook": threading.Lock()}, "common"),
    }
    for name, (state, sub) in cases.items():
        uri = os.path.join(root, sub)
        try:
            cloudckpt.save(state, uri)
            out[name] = {"kinds": [], "message": "", "stored": []}
        except CheckpointingException as exc:
            kinds = [c.__name__ for c in type(exc).__mro__]
            out[name] = {"kinds": kinds, "message": str(exc), "stored": _stored(uri, {})}
    return out


@pytest.mark.multirank
def test_bad_input_on_one_rank_fails_every_rank_before_the_claim(
    two_ranks: RankPool, tmp_path: Path
) -> None:
    outcomes = two_ranks.run(_bad_input_on_one_rank, str(tmp_path))
    for rank, out in enumerate(outcomes):
        key, common = out["key"], out["common"]
        # the coordinator checks the gathered key set; every rank raises its verdict, which
        # names rank 1's key
        assert "InvalidKeyError" in key["kinds"], (rank, key)
        assert "'w?versionId=1' (rank 1)" in key["message"]
        assert key["message"].startswith("rank 0: checkpoint ")
        assert key["message"] == outcomes[0]["key"]["message"]
        # rank 0 serializes the common state; the agreement raises its kind everywhere
        assert "CommonStateError" in common["kinds"] and "TypeError" in common["kinds"], common
        assert "'hook'" in common["message"] and "rank 0" in common["message"], common
        assert key["stored"] == [] and common["stored"] == []


# -- common state ---------------------------------------------------------------------------


def test_non_picklable_common_state(location: StoreLocation) -> None:
    uri, options = location
    state: dict[str, Any] = {"w": _tensor("w"), "opt": {"lr": 0.1, "hook": lambda: None}}
    with pytest.raises(CommonStateError) as info:
        cloudckpt.save(state, uri, storage_options=options)
    error = info.value
    assert isinstance(error, TypeError) and error.key_path == "opt.hook"
    message = str(error)
    assert "'opt.hook'" in message and "rank 0" in message and uri.split("://")[-1] in message
    assert _stored(uri, options) == []  # no claim left behind: a retry may use the URI
    state["opt"]["hook"] = "fixed"
    cloudckpt.save(state, uri, storage_options=options)
    common = cloudckpt.load_common_state_dict(uri, storage_options=options)
    assert common["opt"] == {"lr": 0.1, "hook": "fixed"}


# -- loading --------------------------------------------------------------------------------


def test_wrong_shape_on_load(tmp_path: Path, backend: str) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"w": _tensor("w")}, uri, sharded_strategy=(backend, 1))
    with pytest.raises(TensorMismatchError) as info:
        cloudckpt.load({"w": _tensor("w", n=6)}, uri)
    message = str(info.value)
    assert "'w'" in message and uri in message and "(4,)" in message and "(6,)" in message
    assert "allow_shape_mismatch" in message and isinstance(info.value, ValueError)
    if backend == "zarr":
        with pytest.raises(TensorMismatchError, match=r"stored dtype torch\.float32"):
            cloudckpt.load({"w": _tensor("w", dtype=torch.float64)}, uri)
    else:  # torch_dist casts to the requested dtype, as Megatron-Core's torch_dist load
        cast = cloudckpt.load({"w": _tensor("w", dtype=torch.float64)}, uri)["w"]
        assert cast.dtype == torch.float64 and torch.equal(cast, torch.arange(4.0).double())
    padded = ShardedTensor.from_rank_offsets("w", torch.empty(6), allow_shape_mismatch=True)
    loaded = cloudckpt.load({"w": padded}, uri)
    assert torch.equal(loaded["w"], torch.tensor([0.0, 1, 2, 3, 0, 0]))


def test_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not a checkpoint")
    for uri in (str(tmp_path / "data"), str(tmp_path / "nothing")):
        with pytest.raises(CheckpointNotFoundError) as info:
            cloudckpt.load({"w": _tensor("w")}, uri)
        assert f"no checkpoint at {uri!r}" in str(info.value)
    with pytest.raises(CheckpointNotFoundError) as info:
        cloudckpt.load({}, str(tmp_path / "data"))
    assert "holds 1 object but no metadata.json" in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"), [("sharded_backend", "nosuch"), ("sharded_backend_version", 7)]
)
def test_unknown_backend_or_version(tmp_path: Path, field: str, value: object) -> None:
    uri = str(tmp_path / "ckpt")
    _saved(uri, {})
    path = tmp_path / "ckpt" / "metadata.json"
    doc = json.loads(path.read_text())
    doc[field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(IncompatibleCheckpointError) as info:
        cloudckpt.load({"w": _tensor("w")}, uri)
    message = str(info.value)
    expected = repr(value) if isinstance(value, str) else f"version {value}"
    assert uri in message and expected in message, message


def _corrupt(root: Path, name: str, raw: bytes) -> None:
    """Replace ``name`` with ``raw``; the manifest is amended to match (so the load finds
    the file malformed, not damaged in transit)."""
    (root / name).write_bytes(raw)
    manifest_path = root / "manifest.json"
    if name in ("manifest.json", "metadata.json"):
        return
    doc = json.loads(manifest_path.read_text())
    doc["objects"] = [
        [path, len(raw), crc32c(raw)] if path == name else [path, size, crc]
        for path, size, crc in doc["objects"]
    ]
    manifest_path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("backend_", "name", "raw", "kind"),
    [
        ("zarr", "manifest.json", b'{"format": "cloudckpt-manifest", "version": 1', ManifestError),
        ("zarr", "manifest.json", b'{"format": "cloudckpt-manifest", "version": 1}', ManifestError),
        ("zarr", "metadata.json", b"{not json", MalformedCheckpointError),
        (
            "zarr",
            "metadata.json",
            b'{"sharded_backend": "zarr", "color": 1}',
            MalformedCheckpointError,
        ),
        ("zarr", "w/.zarray", b'{"zarr_format": 2, "shape": [4]', MalformedCheckpointError),
        ("zarr", "w/.zarray", b'{"zarr_format": 2}', MalformedCheckpointError),
        ("torch_dist", ".metadata", b"\x80\x04garbage", MalformedCheckpointError),
        ("torch_dist", ".metadata", b"", MalformedCheckpointError),
    ],
    ids=[
        "manifest-truncated",
        "manifest-fields",
        "metadata-json",
        "metadata-keys",
        "zarray-truncated",
        "zarray-fields",
        "dcp-metadata-garbage",
        "dcp-metadata-truncated",
    ],
)
def test_malformed_checkpoint_file(
    tmp_path: Path, backend_: str, name: str, raw: bytes, kind: type
) -> None:
    uri = str(tmp_path / "ckpt")
    _saved(uri, {}, backend_)
    if name == ".metadata":  # truncate the real one too: same class
        real = (tmp_path / "ckpt" / name).read_bytes()
        raw = raw or real[: len(real) // 2]
    _corrupt(tmp_path / "ckpt", name, raw)
    with pytest.raises(kind) as info:
        cloudckpt.load({"w": _tensor("w")}, uri, validate_access_integrity=False)
    error = info.value
    assert isinstance(error, MalformedCheckpointError) and isinstance(error, ValueError)
    assert f"{uri}/{name}" in str(error), str(error)


# -- two jobs, one URI ----------------------------------------------------------------------


def _racing_job(rank: int, world: int, uri: str, options: dict, seed: int, start_at: float) -> dict:
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2,), float(seed)), (0, rank, world))
    }
    time.sleep(max(0.0, start_at - time.time()))
    try:
        cloudckpt.save(state, uri, storage_options=options)
    except CheckpointingException as exc:
        return {"kinds": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
    return {"kinds": [], "message": "ok"}


@pytest.mark.multirank
@pytest.mark.parametrize("store", ["local", "s3-seaweedfs"])
def test_the_loser_of_two_racing_jobs_gets_a_commit_conflict(
    store: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    two_ranks: RankPool,
    other_two_ranks: RankPool,
) -> None:
    if store == "local":
        uri, options = str(tmp_path / "ckpt"), {}
    else:
        bucket_uri, options = bucket_location(request, store)
        uri = f"{bucket_uri}/run/iter_1"
    for job in (two_ranks, other_two_ranks):  # both groups up before the race starts
        job.run(_ready)
    start_at = time.time() + 1.0
    outcomes: dict[int, list[dict]] = {}

    def run(seed: int, job: RankPool) -> None:
        outcomes[seed] = job.run(_racing_job, uri, options, seed, start_at)

    jobs = ((1, two_ranks), (2, other_two_ranks))
    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    winners = [seed for seed, outs in outcomes.items() if all(o["message"] == "ok" for o in outs)]
    losers = [outs for outs in outcomes.values() if any(o["message"] != "ok" for o in outs)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    for rank, out in enumerate(losers[0]):
        assert "CommitConflictError" in out["kinds"] and "FileExistsError" in out["kinds"], (
            rank,
            out,
        )
        assert uri.split("://")[-1] in out["message"], (rank, out)
    loaded = cloudckpt.load({"w": _tensor("w", n=4)}, uri, storage_options=options)
    assert torch.equal(loaded["w"], torch.full((4,), float(winners[0])))
    assert issubclass(CommitConflictError, FileExistsError)


def _ready(rank: int, world: int) -> int:
    return rank
