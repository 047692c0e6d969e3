"""The storage layer and save/load against real object-store servers.

"s3-moto" cases run against moto's S3 API server (``s3-endpoint`` when
``CLOUDCKPT_TEST_S3_ENDPOINT`` points the suite at MinIO or another S3 endpoint);
"gs-emulator" cases against gcp-storage-emulator. Both are real HTTP servers in
subprocesses on loopback ports (see ``tests/servers.py``); nothing is mocked in-process.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import crc32c as crc32c_lib
import pytest
import torch
from botocore.exceptions import ClientError

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import CheckpointNotFoundError
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.storage import CheckpointStorage, ReadRequest, WriteResult
from tests import servers
from tests._gcs_emulator_launcher import parse_multipart_related
from tests.fixtures_object_stores import STORE_CASES, GCSEndpoint, S3Endpoint, bucket_location

StoreLocation = tuple[str, dict[str, Any]]


@pytest.fixture(params=STORE_CASES)
def store(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    """``(uri, storage_options)`` of a checkpoint prefix in a fresh bucket of every S3 and
    GCS server."""
    bucket_uri, options = bucket_location(request, request.param)
    yield f"{bucket_uri}/prefix/ckpt", options


def _storage(location: StoreLocation, **kwargs: Any) -> CheckpointStorage:
    uri, options = location
    return CheckpointStorage(uri, storage_options=options, **kwargs)


# --- the fixtures themselves -------------------------------------------------------------


def test_s3_bucket_fixture_makes_a_fresh_bucket(s3_server: S3Endpoint, s3_bucket) -> None:
    uri, options = s3_bucket
    assert options["endpoint_url"] == s3_server.endpoint_url
    assert options["skip_instance_cache"] is True
    bucket = uri.removeprefix("s3://")
    client = s3_server.boto3_client()
    assert bucket in {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    if s3_server.kind != "external":
        assert s3_server.endpoint_url.startswith("http://127.0.0.1:")


def test_gcs_bucket_fixture_makes_a_fresh_bucket(gcs_server: GCSEndpoint, gcs_bucket) -> None:
    uri, options = gcs_bucket
    assert gcs_server.endpoint_url.startswith("http://127.0.0.1:")
    assert options["endpoint_url"] == gcs_server.endpoint_url
    bucket = urllib.parse.quote(uri.removeprefix("gs://"), safe="")
    with urllib.request.urlopen(
        f"{gcs_server.endpoint_url}/storage/v1/b/{bucket}/o", timeout=10
    ) as response:
        assert json.loads(response.read()).get("items", []) == []


def test_gcsfs_uses_its_plain_filesystem_against_the_emulator(gcs_bucket) -> None:
    """The extended (zonal/HNS) gcsfs filesystem stalls ~60 s per call on the emulator."""
    storage = _storage(gcs_bucket)
    assert type(storage.fs).__name__ == "GCSFileSystem", type(storage.fs).__mro__


# --- CheckpointStorage round trips --------------------------------------------------------


def _payloads() -> list[tuple[str, bytes | bytearray | memoryview, bytes]]:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return [
        ("bytes", b"hello world", b"hello world"),
        ("bytearray", bytearray(b"\x00\x01\x02" * 100), b"\x00\x01\x02" * 100),
        ("tensor-memoryview", tensor_bytes(tensor), tensor.numpy().tobytes()),
        ("empty", b"", b""),
        # Line-break bytes at the ends of a body once lost a byte in the GCS emulator.
        ("line-breaks-at-ends", b"\r\n--x\r", b"\r\n--x\r"),
    ]


@pytest.mark.parametrize("case", _payloads(), ids=lambda c: c[0])
def test_write_read_round_trip(store: StoreLocation, case) -> None:
    _, data, expected = case
    storage = _storage(store)
    result = storage.write("dir/obj", data)
    assert result == WriteResult("dir/obj", len(expected), crc32c_lib.crc32c(expected))
    assert storage.exists("dir/obj")
    assert storage.read("dir/obj") == expected
    # A fresh filesystem instance (no listing cache) sees the same bytes.
    assert _storage(store).read("dir/obj") == expected


def test_ranged_reads(store: StoreLocation) -> None:
    storage = _storage(store)
    storage.write("r", b"0123456789")
    cases = [
        (0, None, b"0123456789"),
        (3, None, b"3456789"),
        (0, 4, b"0123"),
        (2, 7, b"23456"),
        (9, 10, b"9"),
    ]
    for start, end, expected in cases:
        assert storage.read("r", start, end) == expected
    requests = [ReadRequest("r", s, e) for s, e, _ in cases]
    assert storage.read_many(requests) == [expected for _, _, expected in cases]


def test_write_many_read_many_with_many_requests_in_flight(store: StoreLocation) -> None:
    storage = _storage(store, max_in_flight=16)
    items = [(f"k{i:02d}/chunk", bytes([i]) * (i * 37 + 1)) for i in range(40)]
    results = storage.write_many(items)
    assert [(r.path, r.size, r.crc32c) for r in results] == [
        (p, len(d), crc32c_lib.crc32c(d)) for p, d in items
    ]
    assert storage.read_many([ReadRequest(p) for p, _ in items]) == [d for _, d in items]


def test_list_exists_and_delete(store: StoreLocation) -> None:
    storage = _storage(store)
    assert storage.is_empty() and storage.list() == []
    assert not storage.exists("a/b/c")
    for path in ["z", "a/b/c", "a/b/d", "a/x", "m.n/0.0"]:
        storage.write(path, path.encode())
    fresh = _storage(store)
    assert fresh.list() == ["a/b/c", "a/b/d", "a/x", "m.n/0.0", "z"]
    assert fresh.list("a") == ["a/b/c", "a/b/d", "a/x"]
    assert fresh.list("a/b") == ["a/b/c", "a/b/d"]
    assert fresh.list("nothing/here") == []
    assert fresh.exists("a/b/c") and fresh.exists("z")
    fresh.delete("z")
    assert not fresh.exists("z")
    fresh.delete("a/b", recursive=True)
    assert fresh.list() == ["a/x", "m.n/0.0"]
    fresh.delete("does/not/exist")
    fresh.delete("does/not/exist", recursive=True)
    fresh.delete("a", recursive=True)
    fresh.delete("m.n", recursive=True)
    assert _storage(store).is_empty()


def test_list_does_not_leak_sibling_prefixes(store: StoreLocation) -> None:
    uri, options = store
    CheckpointStorage(uri + "-other", storage_options=options).write("x", b"1")
    storage = _storage(store)
    storage.write("y", b"2")
    assert storage.list() == ["y"]


def test_reading_a_missing_object_raises_not_found(store: StoreLocation) -> None:
    storage = _storage(store)
    with pytest.raises(CheckpointNotFoundError, match="no/such/object"):
        storage.read("no/such/object")
    with pytest.raises(FileNotFoundError):
        storage.read_many([ReadRequest("missing", 0, 4)])


# --- create-once semantics of the servers (what the commit protocol relies on) -------------


def test_s3_api_rejects_a_second_create_with_if_none_match(s3_server, s3_bucket) -> None:
    bucket = s3_bucket[0].removeprefix("s3://")
    client = s3_server.boto3_client()
    client.put_object(Bucket=bucket, Key="manifest.json", Body=b"1", IfNoneMatch="*")
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=bucket, Key="manifest.json", Body=b"2", IfNoneMatch="*")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert client.get_object(Bucket=bucket, Key="manifest.json")["Body"].read() == b"1"
    assert s3_server.create_only  # the fixture's probe through cloudckpt agrees


def _create_only_upload_statuses(server: GCSEndpoint, bucket_uri: str) -> list[int]:
    """HTTP statuses of two simple uploads of one object with ``ifGenerationMatch=0``, as
    gcsfs sends them for small objects (``uploadType=multipart``)."""
    bucket = urllib.parse.quote(bucket_uri.removeprefix("gs://"), safe="")
    url = (
        f"{server.endpoint_url}/upload/storage/v1/b/{bucket}/o"
        "?uploadType=multipart&name=manifest.json&ifGenerationMatch=0"
    )
    meta = json.dumps({"name": "manifest.json"})
    head = (
        f"--b\r\nContent-Type: application/json\r\n\r\n{meta}\r\n--b\r\n"
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    statuses = []
    for content in (b"1", b"2"):
        request = urllib.request.Request(
            url,
            data=head + content + b"\r\n--b--",
            method="POST",
            headers={"Content-Type": 'multipart/related; boundary="b"'},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                statuses.append(response.status)
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
    return statuses


def test_gcs_servers_and_if_generation_match_zero(gcs_server: GCSEndpoint, gcs_bucket) -> None:
    """What each GCS server does with a create-only upload, and that the fixture's probe
    (through cloudckpt) found the same: fake-gcs-server refuses a second simple
    (multipart) upload with 412, as real GCS does; gcp-storage-emulator ignores the
    precondition (a known gap: the commit protocol must not rely on it there)."""
    statuses = _create_only_upload_statuses(gcs_server, gcs_bucket[0])
    assert statuses == ([200, 412] if gcs_server.create_only else [200, 200])
    assert gcs_server.create_only is {"fakegcs": True, "emulator": False}[gcs_server.kind]


# --- top-level save and load, resharded ----------------------------------------------------


def test_save_then_resharded_load(checkpoint_uri: StoreLocation) -> None:
    """One process saves whole tensors; a load asks for row and column shards of them."""
    uri, options = checkpoint_uri
    weight = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    bias = torch.randn(8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    state = {
        "weight": ShardedTensor.from_rank_offsets("layer.weight", weight),
        "bias": ShardedTensor.from_rank_offsets("layer.bias", bias),
        "extra": ShardedObject("layer.extra", {"step": 7}, (1,), (0,)),
        "iteration": 10,
    }
    cloudckpt.save(state, uri, storage_options=options)

    storage = CheckpointStorage(uri, storage_options=options)
    assert storage.exists("metadata.json") and storage.exists("common.pt")
    requested = {
        "rows": [
            ShardedTensor.from_rank_offsets("layer.weight", torch.empty(4, 6), (0, i, 2))
            for i in (0, 1)
        ],
        "cols": [
            ShardedTensor.from_rank_offsets("layer.weight", torch.empty(8, 2), (1, i, 3))
            for i in range(3)
        ],
        "bias": ShardedTensor.from_rank_offsets(
            "layer.bias", torch.empty(4, dtype=torch.bfloat16), (0, 1, 2)
        ),
        "extra": ShardedObject("layer.extra", None, (1,), (0,)),
    }
    loaded = cloudckpt.load(
        requested, uri, validate_access_integrity=False, storage_options=options
    )
    assert torch.equal(torch.cat(loaded["rows"], dim=0), weight)
    assert torch.equal(torch.cat(loaded["cols"], dim=1), weight)
    assert torch.equal(loaded["bias"].view(torch.int16), bias[4:].view(torch.int16))
    assert loaded["extra"] == {"step": 7}
    assert loaded["iteration"] == 10
    assert cloudckpt.load_common_state_dict(uri, storage_options=options) == {"iteration": 10}


# --- the server helpers ---------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("content", [b"", b"x\r", b"\r\n\r\n", b"--b\r\n--b--", bytes(range(256))])
def test_emulator_launcher_parses_multipart_uploads_byte_exactly(eol, content) -> None:
    body = (
        b"--b"
        + eol
        + b"Content-Type: application/json"
        + eol
        + eol
        + b'{"name": "o"}'
        + eol
        + b"--b"
        + eol
        + b"Content-Type: application/x-test"
        + eol
        + eol
        + content
        + eol
        + b"--b--"
    )
    parsed = parse_multipart_related(body, 'multipart/related; boundary="b"')
    assert parsed == {
        "meta": {"name": "o"},
        "content": content,
        "content-type": "application/x-test",
    }


# --- the server processes ---------------------------------------------------------------------


def test_a_server_that_dies_at_start_raises_with_its_output() -> None:
    argv = [sys.executable, "-c", "import sys; print('boom on port', sys.argv[1]); sys.exit(3)"]
    with pytest.raises(servers.ServerStartError, match=r"exited with code 3[\s\S]*boom on port"):
        servers._start("dying", lambda port: [*argv, str(port)], "/", None, timeout=10)


def test_stop_kills_a_server_that_ignores_sigterm() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    server = servers._spawn("stubborn", [sys.executable, "-c", code], 0, {})
    try:
        time.sleep(0.3)  # let it install the handler
    finally:
        server.stop(timeout=0.5)
    assert server.process.returncode is not None and server.process.returncode < 0
