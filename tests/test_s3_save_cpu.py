"""The client CPU of an S3 save (cloudckpt/storage/s3.py, streams.py, the
torch_dist writer on S3).

* A body of pieces reads, seeks and checksums as its concatenation.
* A data request to a loopback HTTP endpoint goes as ``UNSIGNED-PAYLOAD`` (its CRC-32C
  header signed), its body handed to aiohttp as memory; a config that sets
  ``payload_signing_enabled`` keeps botocore's SHA-256 of the body.
* An :class:`UploadStream` writes any sequence of writes (referenced or copied) as one
  object of those bytes, with the size, CRC-32C and block CRCs of a whole-object
  write, as a PUT up to one part and a multipart upload above; a failing part aborts
  the upload and names the object and part.
* A torch_dist save to S3 streams its ``.distcp`` objects (no whole-object write),
  sends the tensors' bytes from their own memory, and loads and verifies.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.checker import verify
from cloudckpt.config import S3_MIN_PART_SIZE, CheckpointConfig
from cloudckpt.errors import StorageError
from cloudckpt.storage import CheckpointStorage
from cloudckpt.storage.blocks import BLOCK_SIZE, object_checksum, part_checksum, segments_checksum
from cloudckpt.storage.buffers import Progress, SegmentsReader
from cloudckpt.storage.s3 import S3Transport, _is_loopback_http, _ViewPayload
from cloudckpt.storage.streams import SMALL_WRITE, UploadStream
from tests.fixtures_object_stores import StoreLocation

MiB = 2**20
PART = S3_MIN_PART_SIZE


def _bytes(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _cut(data: bytes, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    view, pieces, at = memoryview(data), [], 0
    while at < len(data):
        size = rng.choice([1, 700, SMALL_WRITE - 1, SMALL_WRITE, 300 * 1024, 2 * MiB + 3])
        pieces.append(view[at : at + size])
        at += size
    return pieces


# -- bodies of pieces ----------------------------------------------------------------------


def test_a_body_of_pieces_reads_seeks_and_checksums_as_its_concatenation() -> None:
    data = _bytes(3 * MiB + 77)
    pieces = _cut(data, 1)
    reader = SegmentsReader(pieces)
    assert len(reader) == len(data)
    assert reader.read(10) == data[:10]
    assert b"".join(reader.remaining()) == data[10:]
    assert reader.seek(MiB + 5) == MiB + 5
    assert reader.read(2 * MiB) == data[MiB + 5 : 3 * MiB + 5]
    assert reader.read() == data[3 * MiB + 5 :]
    assert reader.read() == b""
    reader.seek(0)
    assert reader.readall() == data
    assert segments_checksum(pieces, MiB) == part_checksum(data, MiB)
    assert segments_checksum([], MiB) == part_checksum(b"", MiB)


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:9000/b/k", True),
        ("http://127.3.2.1/b/k", True),
        ("http://localhost:8333/b/k", True),
        ("http://[::1]:9000/b/k", True),
        ("https://127.0.0.1:9000/b/k", False),  # HTTPS: botocore's own rules
        ("http://10.0.0.5:9000/b/k", False),
        ("http://minio.internal:9000/b/k", False),
    ],
)
def test_only_plain_http_to_this_host_counts_as_loopback(url: str, loopback: bool) -> None:
    assert _is_loopback_http(url) is loopback


# -- what goes on the wire -------------------------------------------------------------------


def _storage(location: StoreLocation, **options: Any) -> CheckpointStorage:
    uri, storage_options = location
    return CheckpointStorage(
        f"{uri}/run/ckpt",
        storage_options={**storage_options, **options},
        config=CheckpointConfig(part_size=PART),
    )


def _wire(storage: CheckpointStorage) -> list[tuple[str, str, Any]]:
    """``(operation, x-amz-content-sha256, body)`` of every request sent from now on, as
    it goes to the HTTP session (after cloudckpt's own hooks)."""
    sent: list[tuple[str, str, Any]] = []
    storage.fs.connect()

    def observe(request: Any, event_name: str, **_: Any) -> None:
        sha = request.headers.get("X-Amz-Content-SHA256", "")
        sent.append((event_name.rsplit(".", 1)[-1], _text(sha), request.body))

    storage.fs.s3.meta.events.register_last("before-send.s3", observe)
    return sent


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def test_data_requests_to_loopback_http_go_unsigned_from_memory(
    s3_bucket: StoreLocation,
) -> None:
    storage = _storage(s3_bucket)
    sent = _wire(storage)
    small, large = _bytes(1000, 1), _bytes(2 * PART + 12345, 2)
    storage.write_many([("small.bin", small), ("large.bin", large)])
    data = [(op, sha, body) for op, sha, body in sent if op in ("PutObject", "UploadPart")]
    assert sorted(op for op, _, _ in data) == [
        "PutObject",
        "UploadPart",
        "UploadPart",
        "UploadPart",
    ]
    assert all(sha == "UNSIGNED-PAYLOAD" for _, sha, _ in data)
    assert all(isinstance(body, _ViewPayload) for _, _, body in data)
    assert storage.read("small.bin") == small
    assert storage.read("large.bin") == large


def test_a_config_that_asks_for_signed_payloads_keeps_them(s3_bucket: StoreLocation) -> None:
    storage = _storage(s3_bucket, config_kwargs={"s3": {"payload_signing_enabled": True}})
    sent = _wire(storage)
    payload = _bytes(4000, 3)
    storage.write("signed.bin", payload)
    puts = [sha for op, sha, _ in sent if op == "PutObject"]
    assert puts == [hashlib.sha256(payload).hexdigest()]
    assert storage.read("signed.bin") == payload


# -- upload streams ----------------------------------------------------------------------------


@pytest.fixture
def storage(s3_bucket: StoreLocation) -> Iterator[CheckpointStorage]:
    yield _storage(s3_bucket)


@pytest.mark.parametrize("size", [0, 1000, PART, 2 * PART + MiB + 17])
def test_an_upload_stream_writes_its_bytes_and_their_checksums(
    storage: CheckpointStorage, size: int
) -> None:
    data = _bytes(size, size)
    assert storage.streams_uploads
    progress = Progress("wrote", storage.uri, size, 1)
    stream = storage.open_stream("obj.bin", progress)
    assert isinstance(stream, UploadStream)
    for number, piece in enumerate(_cut(data, 7)):
        if number % 2:
            with stream.referencing(data):
                stream.write(piece)
        else:
            stream.write(piece)
    assert stream.tell() == size
    result = stream.finish()
    assert progress.done == size  # every byte counted once, as its part (or PUT) was sent
    assert storage.read("obj.bin") == data
    crc, blocks = object_checksum(data, BLOCK_SIZE)
    assert (result.path, result.size, result.crc32c, result.blocks) == (
        "obj.bin",
        size,
        crc,
        blocks,
    )
    assert not storage.transport.open_uploads()


def test_a_stream_copies_what_it_does_not_reference(storage: CheckpointStorage) -> None:
    data = bytearray(_bytes(2 * PART, 5))
    stream = storage.open_stream("copied.bin")
    stream.write(memoryview(data))  # not referenced: copied at once
    data[:] = bytes(len(data))  # the caller reuses its buffer
    stream.finish()
    assert storage.read("copied.bin") == _bytes(2 * PART, 5)


def test_a_failing_part_aborts_the_upload_naming_object_and_part(
    storage: CheckpointStorage,
) -> None:
    send_part = S3Transport.send_part

    def failing(self: S3Transport, path: str, upload_id: str, number: int, *args: Any) -> Any:
        if number == 2:
            raise StorageError(f"failed to upload part {number} of {path}: injected")
        return send_part(self, path, upload_id, number, *args)

    data = _bytes(4 * PART, 9)
    stream = storage.open_stream("failing.bin")
    with (
        patch.object(S3Transport, "send_part", failing),
        pytest.raises(StorageError, match=r"part 2 of .*failing\.bin: injected"),
    ):
        try:
            with stream.referencing(data):
                for piece in _cut(data, 3):
                    stream.write(piece)
            stream.finish()
        finally:
            stream.abort()
    assert not storage.transport.open_uploads()
    assert not storage.exists("failing.bin")


# -- a torch_dist save ---------------------------------------------------------------------------


def test_a_torch_dist_save_to_s3_sends_tensors_from_their_memory(
    s3_bucket: StoreLocation,
) -> None:
    uri, options = s3_bucket
    uri = f"{uri}/run/dist"
    big = torch.randn(3 * PART // 4 + 1000)  # float32: three parts and a bit
    state = {
        "big": ShardedTensor.from_rank_offsets("big", big),
        "bf16": ShardedTensor.from_rank_offsets("bf16", torch.randn(7, 5).to(torch.bfloat16)),
        "view": ShardedTensor.from_rank_offsets("view", torch.randn(40, 30)[:, 3]),
        "obj": cloudckpt.ShardedObject("obj", {"a": 1}, (1,), (0,)),
    }
    whole: list[str] = []
    pieces: list[memoryview] = []
    write_many, send_part = CheckpointStorage.write_many, S3Transport.send_part

    def spy_whole(self: CheckpointStorage, items: Any, **kwargs: Any) -> Any:
        items = list(items)
        whole.extend(path for path, _ in items)
        return write_many(self, items, **kwargs)

    def spy_part(self: S3Transport, *args: Any) -> Any:
        pieces.extend(args[3])
        return send_part(self, *args)

    config = CheckpointConfig(backend="torch_dist", part_size=PART)
    with (
        patch.object(CheckpointStorage, "write_many", spy_whole),
        patch.object(S3Transport, "send_part", spy_part),
    ):
        cloudckpt.save(state, uri, storage_options=options, config=config)
    assert not [path for path in whole if path.endswith(".distcp")]
    start = big.data_ptr()
    inside = [
        p
        for p in pieces
        if p.nbytes and start <= np.frombuffer(p, np.uint8).ctypes.data < start + big.nbytes
    ]
    assert sum(p.nbytes for p in inside) == big.nbytes  # every byte from the tensor itself
    assert verify(uri, storage_options=options, deep=True).ok
    target = {
        key: ShardedTensor.from_rank_offsets(key, torch.empty_like(item.data))
        for key, item in state.items()
        if isinstance(item, ShardedTensor)
    }
    loaded = cloudckpt.load(target, uri, storage_options=options, config=config)
    for key, item in state.items():
        if isinstance(item, ShardedTensor):
            assert torch.equal(loaded[key], item.data), key
