"""Streaming uploads and ranged downloads against the S3 API (moto, or MinIO when
``CLOUDCKPT_TEST_S3_ENDPOINT`` is set).

What the server stored is checked with boto3 (ETag part counts, open multipart
uploads); what the client sent is observed through botocore's event hooks on the
s3fs client that :class:`CheckpointStorage` uses.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from cloudckpt.config import S3_MIN_PART_SIZE, CheckpointConfig
from cloudckpt.errors import StorageError
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.storage import CheckpointStorage, ReadRequest, crc32c
from tests.fixtures_object_stores import S3Endpoint, StoreLocation

PART = S3_MIN_PART_SIZE


@dataclass
class Calls:
    """Requests seen by botocore, and the most that were in flight at once."""

    names: list[str] = field(default_factory=list)
    params: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    received: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> int:
        return self.names.count(name)


def _observe(storage: CheckpointStorage, fail_part: int | None = None) -> Calls:
    """Hook botocore's events on the storage's s3fs client.

    ``before-parameter-build`` sees each call's API parameters (and injects a failure
    of part ``fail_part``); ``before-call`` / ``after-call`` bracket the request on
    the wire, which gives the number in flight.
    """
    calls = Calls()
    storage.fs.connect()
    events = storage.fs.s3.meta.events

    def build(params: dict[str, Any], model: Any, **_: Any) -> None:
        with calls.lock:
            calls.names.append(model.name)
            calls.params.append({k: v for k, v in params.items() if k != "Body"})
        if model.name == "UploadPart" and params.get("PartNumber") == fail_part:
            raise ConnectionAbortedError(f"injected failure of part {fail_part}")

    def before(**_: Any) -> None:
        with calls.lock:
            calls.in_flight += 1
            calls.peak = max(calls.peak, calls.in_flight)

    def after(parsed: Any, model: Any, **_: Any) -> None:
        with calls.lock:
            calls.in_flight -= 1
            if model.name == "GetObject":
                calls.received += int(parsed.get("ContentLength", 0))

    events.register("before-parameter-build.s3", build)
    events.register("before-call.s3", before)
    events.register("after-call.s3", after)
    return calls


@pytest.fixture
def s3_location(s3_bucket: StoreLocation) -> Iterator[tuple[str, dict[str, Any]]]:
    uri, options = s3_bucket
    yield f"{uri}/run/iter_0000001", options


def _storage(location: tuple[str, dict[str, Any]], **config: Any) -> CheckpointStorage:
    uri, options = location
    return CheckpointStorage(
        uri, storage_options=options, config=CheckpointConfig(part_size=PART, **config)
    )


def _payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def _bucket_key(storage: CheckpointStorage, relpath: str) -> tuple[str, str]:
    bucket, key, _ = storage.fs.split_path(storage.full_path(relpath))
    return bucket, key


def test_large_object_is_a_multipart_upload_with_concurrent_parts(
    s3_server: S3Endpoint, s3_location: tuple[str, dict[str, Any]]
) -> None:
    storage = _storage(s3_location, max_in_flight=4)
    calls = _observe(storage)
    data = _payload(3 * PART + 12345)
    result = storage.write("w/0.0", tensor_bytes(data))

    assert calls.count("CreateMultipartUpload") == 1
    assert calls.count("UploadPart") == 4
    assert calls.count("CompleteMultipartUpload") == 1
    assert calls.count("PutObject") == 0
    assert 2 <= calls.peak <= 4, f"parts were not sent concurrently (peak {calls.peak})"
    assert result.size == data.numel()
    assert result.crc32c == crc32c(data.numpy().tobytes())
    bucket, key = _bucket_key(storage, "w/0.0")
    client = s3_server.boto3_client()
    head = client.head_object(Bucket=bucket, Key=key, PartNumber=1)
    assert head["PartsCount"] == 4
    assert head["ContentLength"] == PART
    assert client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"').endswith("-4")
    assert storage.read("w/0.0") == data.numpy().tobytes()


def test_object_at_part_size_is_one_put(s3_location: tuple[str, dict[str, Any]]) -> None:
    storage = _storage(s3_location)
    calls = _observe(storage)
    data = _payload(PART)
    storage.write("x", tensor_bytes(data))
    assert calls.names.count("PutObject") == 1
    assert "CreateMultipartUpload" not in calls.names
    assert calls.params[0]["ChecksumCRC32C"]  # the server can verify what it got


def test_failed_part_aborts_the_upload_and_names_it(
    s3_server: S3Endpoint, s3_location: tuple[str, dict[str, Any]]
) -> None:
    storage = _storage(s3_location, max_in_flight=2, retry={"max_attempts": 1})
    calls = _observe(storage, fail_part=2)
    data = _payload(4 * PART)
    with pytest.raises(StorageError, match=r"part 2 .* of s3://.*/w/0\.0") as info:
        storage.write("w/0.0", tensor_bytes(data))
    assert "injected failure of part 2" in str(info.value)
    assert calls.count("AbortMultipartUpload") == 1
    assert calls.count("CompleteMultipartUpload") == 0
    bucket, _ = _bucket_key(storage, "w/0.0")
    client = s3_server.boto3_client()
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert not storage.exists("w/0.0")


def test_failure_skips_queued_requests_and_aborts_every_open_upload(
    s3_server: S3Endpoint, s3_location: tuple[str, dict[str, Any]]
) -> None:
    storage = _storage(s3_location, max_in_flight=1, retry={"max_attempts": 1})
    calls = _observe(storage, fail_part=1)
    items = [(f"t{i}/0", tensor_bytes(_payload(2 * PART, seed=i))) for i in range(3)]
    with pytest.raises(StorageError, match="injected failure of part 1"):
        storage.write_many(items)
    # one in flight: the first part failed, every later part was skipped
    assert calls.count("UploadPart") == 1
    assert calls.count("AbortMultipartUpload") == calls.count("CreateMultipartUpload") == 3
    bucket, _ = _bucket_key(storage, "t0/0")
    assert s3_server.boto3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert storage.list() == []


def test_in_flight_requests_are_bounded_by_one_knob(
    s3_location: tuple[str, dict[str, Any]],
) -> None:
    storage = _storage(s3_location, max_in_flight=3)
    calls = _observe(storage)
    items = [(f"big{i}/0", tensor_bytes(_payload(3 * PART, seed=i))) for i in range(2)]
    items += [(f"small{i}/0", tensor_bytes(_payload(1000, seed=i))) for i in range(20)]
    results = storage.write_many(items)
    assert [r.path for r in results] == [path for path, _ in items]
    assert calls.count("UploadPart") == 6 and calls.count("PutObject") == 20
    assert 2 <= calls.peak <= 3


def test_large_read_is_cut_into_concurrent_ranged_gets(
    s3_location: tuple[str, dict[str, Any]],
) -> None:
    storage = _storage(s3_location, max_in_flight=4)
    data = _payload(3 * PART + 7)
    storage.write("w", tensor_bytes(data))
    calls = _observe(storage)
    out = torch.empty_like(data)
    storage.read_into_many([(ReadRequest("w"), memoryview(out.numpy()))])
    assert torch.equal(out, data)
    gets = [p for n, p in zip(calls.names, calls.params, strict=True) if n == "GetObject"]
    ranges = [p["Range"] for p in gets]
    assert ranges == [
        f"bytes={start}-{min(start + PART, data.numel()) - 1}"
        for start in range(0, data.numel(), PART)
    ]
    assert len(ranges) == 4, ranges
    assert calls.received == data.numel()
    assert calls.peak >= 2


def test_s3_client_settings_do_not_modify_the_callers_options(
    s3_location: tuple[str, dict[str, Any]],
) -> None:
    """botocore rewrites the ``retries`` dict it gets; the caller's must stay as given."""
    uri, options = s3_location
    retries = {"max_attempts": 2}
    config = CheckpointConfig(storage_options={"config_kwargs": {"retries": retries}})
    storage = CheckpointStorage(uri, storage_options=options, config=config)
    storage.fs.connect()
    assert retries == {"max_attempts": 2}
    assert config.storage_options["config_kwargs"]["retries"] == {"max_attempts": 2}
    client_config = storage.fs.s3.meta.config
    assert client_config.retries["mode"] == "standard"
    assert client_config.max_pool_connections >= storage.max_in_flight
