"""cloudckpt.checker.verify against real stores.

The corruption matrix runs on the S3 API (moto, or MinIO when
``CLOUDCKPT_TEST_S3_ENDPOINT`` is set): a committed checkpoint is damaged with plain
boto3 calls, then ``verify`` must name the damage and ``load`` must refuse what it
cannot trust. What the checker itself sends is observed with a botocore hook on an
aiobotocore session handed to s3fs (``storage_options["session"]``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from aiobotocore.session import AioSession

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.checker import LEFTOVER_KINDS, PROBLEM_KINDS, ConsistencyReport, verify
from cloudckpt.config import CheckpointConfig, MiB
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptObjectError,
    UncommittedCheckpointError,
)
from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import S3Endpoint, StoreLocation

W1 = "layer1.weight"
W2 = "layer2.weight"
CHUNK = f"{W1}/0.0"  # the one zarr chunk of W1 (256 KiB)
OBJECT = "extra_state/shard_0_1.pt"
COMMIT_FILES = {"metadata.json", "manifest.json"}


ZARR = ("zarr", 1)  # these tests look at the zarr layout (chunk objects)


def make_state(seed: int = 0) -> dict[str, Any]:
    """Two float32 tensors (256 KiB each), a ShardedObject and common state."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer1": {
            "weight": ShardedTensor.from_rank_offsets(W1, torch.randn(256, 256, generator=gen))
        },
        "layer2": ShardedTensor.from_rank_offsets(W2, torch.randn(128, 512, generator=gen)),
        "extra": ShardedObject("extra_state", {"step": 7, "rng": [1, 2, 3]}, (1,), (0,)),
        "iteration": 7,
        "args": {"lr": 0.125},
    }


def load_template() -> dict[str, Any]:
    return {
        "layer1": {"weight": ShardedTensor.from_rank_offsets(W1, torch.zeros(256, 256))},
        "layer2": ShardedTensor.from_rank_offsets(W2, torch.zeros(128, 512)),
        "extra": ShardedObject("extra_state", None, (1,), (0,)),
    }


def assert_loads_bit_exact(uri: str, options: dict[str, Any]) -> None:
    loaded = cloudckpt.load(load_template(), uri, storage_options=options)
    assert isinstance(loaded, dict)
    expected = make_state()
    assert torch.equal(loaded["layer1"]["weight"], expected["layer1"]["weight"].data)
    assert torch.equal(loaded["layer2"], expected["layer2"].data)
    assert loaded["extra"] == {"step": 7, "rng": [1, 2, 3]}
    assert loaded["iteration"] == 7
    assert loaded["args"] == {"lr": 0.125}


def kinds(report: ConsistencyReport) -> list[tuple[str, str]]:
    return [(p.kind, p.path) for p in report.problems]


@dataclass
class S3Calls:
    """API calls botocore saw on one aiobotocore session: (operation, Key or keys)."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    ranges: dict[str, list[str]] = field(default_factory=dict)  # GetObject key -> Range
    lock: threading.Lock = field(default_factory=threading.Lock)

    def options(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` plus a session whose clients report every call here."""
        session = AioSession()
        session.register("before-parameter-build.s3", self._record)
        return {**base, "session": session}

    def _record(self, params: dict[str, Any], model: Any, **_: Any) -> None:
        keys = [str(params.get("Key") or params.get("Prefix") or "")]
        if model.name == "DeleteObjects":
            keys = [o["Key"] for o in params["Delete"]["Objects"]]
        with self.lock:
            self.calls += [(model.name, key) for key in keys]
            if model.name == "GetObject":
                self.ranges.setdefault(keys[0], []).append(str(params.get("Range", "")))

    def keys(self, operation: str) -> list[str]:
        with self.lock:
            return [key for name, key in self.calls if name == operation]


# -- the corruption matrix on the S3 API --------------------------------------------------


def shared_client(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for save/load: one cached filesystem (one S3/GCS client) for all the
    storages a save or load opens, as in a training process, but no listing cache, so
    that the damage done with boto3 behind its back is seen. ``verify`` gets the
    fixtures' options: a fresh filesystem per call, as in the CLI."""
    if not options:
        return options
    kept = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    return {**kept, "use_listings_cache": False}


@pytest.fixture
def saved_s3(s3_bucket: StoreLocation) -> tuple[str, dict[str, Any]]:
    """A committed checkpoint on the S3 API: ``(uri, storage_options)``."""
    bucket_uri, options = s3_bucket
    uri = f"{bucket_uri}/run/iter_0000007"
    cloudckpt.save(make_state(), uri, storage_options=shared_client(options), sharded_strategy=ZARR)
    return uri, options


def _key(uri: str, relpath: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, f"{prefix}/{relpath}"


def _corrupt(client: Any, uri: str, case: str) -> str:
    """Damage the checkpoint at ``uri`` with boto3; -> the object path concerned."""
    path = {
        "delete-chunk": CHUNK,
        "truncate": CHUNK,
        "flip-byte": CHUNK,
        "delete-manifest": "manifest.json",
        "delete-metadata": "metadata.json",
        "stray-object": "stray/notes.txt",
        "open-upload": f"{W1}/0.1",
    }[case]
    bucket, key = _key(uri, path)
    if case.startswith("delete-"):
        client.delete_object(Bucket=bucket, Key=key)
    elif case in ("truncate", "flip-byte"):
        data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        if case == "truncate":
            data = data[: len(data) - 1000]
        else:
            data[len(data) // 2] ^= 0x01
        client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    elif case == "stray-object":
        client.put_object(Bucket=bucket, Key=key, Body=b"not part of the checkpoint")
    else:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    return path


@dataclass(frozen=True)
class Damage:
    kind: str  # the problem verify must report
    shallow: bool  # caught without reading data
    committed: bool  # still committed afterwards
    load_error: type[Exception] | None  # what load raises (None: loads bit-exact)


MATRIX = {
    "delete-chunk": Damage("missing-object", True, True, CorruptObjectError),
    "truncate": Damage("size-mismatch", True, True, CorruptObjectError),
    "flip-byte": Damage("checksum-mismatch", False, True, CorruptObjectError),
    "delete-manifest": Damage("missing-manifest", True, False, UncommittedCheckpointError),
    "delete-metadata": Damage("missing-metadata", True, False, UncommittedCheckpointError),
    "stray-object": Damage("orphan-object", True, True, None),
    "open-upload": Damage("open-multipart-upload", True, True, None),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_corruption_matrix(
    case: str, s3_server: S3Endpoint, saved_s3: tuple[str, dict[str, Any]]
) -> None:
    uri, options = saved_s3
    path = _corrupt(s3_server.boto3_client(), uri, case)
    damage = MATRIX[case]

    # a leftover beside a committed checkpoint is a problem only with strict=True
    strict = damage.kind in LEFTOVER_KINDS
    shallow = verify(uri, strict=strict, storage_options=options)
    deep = verify(uri, deep=True, strict=strict, storage_options=options)
    if strict:
        lenient = verify(uri, deep=True, storage_options=options)
        assert lenient.ok and [(n.kind, n.path) for n in lenient.notes] == [(damage.kind, path)]

    assert damage.kind in PROBLEM_KINDS
    assert shallow.committed is damage.committed and deep.committed is damage.committed
    assert not deep.ok
    assert kinds(deep) == [(damage.kind, path)], deep.problems
    if damage.shallow:
        assert kinds(shallow) == [(damage.kind, path)], shallow.problems
        assert not shallow.ok
    else:  # same size, other bytes: only reading them tells
        assert shallow.ok and shallow.problems == ()
    assert path in json.dumps(deep.to_dict())
    if case == "truncate":
        assert deep.problems[0].detail == "size 261144, manifest 262144"
    if case == "flip-byte":
        assert "CRC-32C" in deep.problems[0].detail

    if damage.load_error is None:  # strays and open uploads do not touch the data
        assert_loads_bit_exact(uri, shared_client(options))
        return
    with pytest.raises(damage.load_error) as raised:
        cloudckpt.load(load_template(), uri, storage_options=shared_client(options))
    assert isinstance(raised.value, CheckpointingException)
    assert path in str(raised.value) and uri in str(raised.value)


def test_shallow_verify_reads_only_the_commit_files(
    saved_s3: tuple[str, dict[str, Any]],
) -> None:
    uri, options = saved_s3
    shallow_calls, deep_calls = S3Calls(), S3Calls()

    shallow = verify(uri, storage_options=shallow_calls.options(options))
    deep = verify(uri, deep=True, storage_options=deep_calls.options(options))

    assert shallow.ok and deep.ok
    _, prefix = _key(uri, "")
    got = sorted(key.removeprefix(prefix) for key in shallow_calls.keys("GetObject"))
    assert got == sorted(COMMIT_FILES)
    assert shallow_calls.keys("ListObjectsV2"), "the listing gives existence and sizes"
    assert shallow_calls.keys("ListMultipartUploads")
    # deep: every object of the manifest is read, each whole (one ranged GET per part)
    storage = CheckpointStorage(uri, storage_options=options)
    manifest_paths = {p for p in storage.list() if p not in COMMIT_FILES}
    read = {key.removeprefix(prefix) for key in deep_calls.keys("GetObject")}
    assert read == manifest_paths | COMMIT_FILES
    assert deep.objects == len(manifest_paths)


def test_untouched_checkpoint_is_ok(saved_s3: tuple[str, dict[str, Any]]) -> None:
    uri, options = saved_s3
    shallow = verify(uri, storage_options=options)
    deep = verify(uri, deep=True, storage_options=options)
    for report in (shallow, deep):
        assert report.ok and report.committed and not report.foreign
        assert report.problems == ()
    assert deep.checked_bytes == deep.total_bytes and shallow.checked_bytes == 0
    assert_loads_bit_exact(uri, shared_client(options))


def test_deep_verify_streams_large_objects_in_parts(s3_bucket: StoreLocation) -> None:
    """Memory stays at max_in_flight x part_size: a 6 MiB object is read as two ranged
    GETs of at most part_size (5 MiB) each."""
    bucket_uri, options = s3_bucket
    uri = f"{bucket_uri}/big"
    big = torch.arange(6 * MiB // 4, dtype=torch.float32)
    cloudckpt.save(
        {"big": ShardedTensor.from_rank_offsets("big", big)},
        uri,
        storage_options=shared_client(options),
        sharded_strategy=ZARR,
    )
    calls = S3Calls()
    config = CheckpointConfig(part_size=5 * MiB, max_in_flight=2)

    report = verify(uri, deep=True, storage_options=calls.options(options), config=config)

    assert report.ok and report.checked_bytes == report.total_bytes > 6 * MiB
    _, key = _key(uri, "big/0")
    assert sorted(calls.ranges[key]) == [f"bytes=0-{5 * MiB - 1}", f"bytes={5 * MiB}-{6 * MiB - 1}"]


# -- every backend ------------------------------------------------------------------------


def test_verify_on_every_backend(checkpoint_uri: StoreLocation) -> None:
    uri, options = checkpoint_uri
    cloudckpt.save(make_state(), uri, storage_options=shared_client(options), sharded_strategy=ZARR)
    storage = CheckpointStorage(uri, storage_options=options)
    sizes = storage.list_sizes()
    data = {p: n for p, n in sizes.items() if p not in COMMIT_FILES}
    seen: list[int] = []

    shallow = verify(uri, storage_options=options)
    deep = verify(uri, deep=True, storage_options=options, progress=seen.append)

    assert shallow.ok and deep.ok, (shallow.problems, deep.problems)
    assert set(data) >= {CHUNK, f"{W2}/0.0", OBJECT, "common.pt", ".cloudckpt-claim.json"}
    assert shallow.objects == deep.objects == len(data)
    assert shallow.total_bytes == deep.total_bytes == sum(data.values())
    assert data[CHUNK] == 256 * 256 * 4
    assert shallow.checked_bytes == 0
    assert deep.checked_bytes == sum(data.values()) == sum(seen)

    storage.write("leftover/part.bin", b"x" * 10)
    orphaned = verify(uri, strict=True, storage_options=options)
    assert not orphaned.ok and orphaned.committed
    assert [(p.kind, p.path, p.detail) for p in orphaned.problems] == [
        ("orphan-object", "leftover/part.bin", "10 bytes, not listed in manifest.json")
    ]
    lenient = verify(uri, storage_options=options)
    assert lenient.ok and [(n.kind, n.path) for n in lenient.notes] == [
        ("orphan-object", "leftover/part.bin")
    ]


def test_foreign_checkpoint_is_committed_without_problems(checkpoint_uri: StoreLocation) -> None:
    """metadata.json and a zarr array, no claim, no manifest: as Megatron-Core writes."""
    uri, options = checkpoint_uri
    cloudckpt.save(make_state(), uri, storage_options=shared_client(options), sharded_strategy=ZARR)
    storage = CheckpointStorage(uri, storage_options=options)
    storage.delete("manifest.json")
    storage.delete(".cloudckpt-claim.json")

    for deep in (False, True):
        report = verify(uri, deep=deep, storage_options=options)
        assert report.committed and report.foreign and report.ok
        assert report.problems == ()
        assert (report.objects, report.total_bytes, report.checked_bytes) == (0, 0, 0)


def test_nothing_at_the_uri(checkpoint_uri: StoreLocation) -> None:
    uri, options = checkpoint_uri
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        verify(uri, storage_options=options)


def test_report_to_dict_is_json(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(make_state(), uri, sharded_strategy=ZARR)
    CheckpointStorage(uri).delete("metadata.json")
    report = verify(uri, deep=True)
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["ok"] is False and doc["committed"] is False and doc["deep"] is True
    assert doc["problems"] == [
        {
            "kind": "missing-metadata",
            "path": "metadata.json",
            "detail": doc["problems"][0]["detail"],
        }
    ]
    assert doc["uri"] == uri
    assert doc["checked_bytes"] == doc["total_bytes"] > 0


def test_metadata_that_contradicts_the_manifest(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(make_state(), uri, sharded_strategy=ZARR)
    storage = CheckpointStorage(uri)
    doc = json.loads(storage.read("metadata.json"))
    storage.write("metadata.json", json.dumps({**doc, "sharded_backend": "torch_dist"}).encode())
    report = verify(uri)
    assert kinds(report) == [("metadata-mismatch", "metadata.json")]
    assert "torch_dist" in report.problems[0].detail


def test_metadata_that_is_not_a_config(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(make_state(), uri, sharded_strategy=ZARR)
    CheckpointStorage(uri).write("metadata.json", b'{"sharded_backend": "zarr", "extra": 1}')
    report = verify(uri)
    assert kinds(report) == [("metadata-mismatch", "metadata.json")]
    assert report.committed and not report.ok


def test_unparsable_manifest(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(make_state(), uri, sharded_strategy=ZARR)
    CheckpointStorage(uri).write("manifest.json", b"{not json")
    report = verify(uri, deep=True)
    assert kinds(report) == [("bad-manifest", "manifest.json")]
    assert report.committed and not report.ok and report.checked_bytes == 0
