"""An :class:`~cloudckpt.storage.streams.UploadStream` never needs more parts than S3
allows per multipart upload (10,000; a small fake limit here), with or without the
object's size, and its parts keep whole blocks (the object's CRC-32C and block CRCs
are those of its bytes); the buffered multipart path (:func:`plan_parts`) keeps the
same limit."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cloudckpt.config import S3_MAX_PART_SIZE
from cloudckpt.storage.blocks import PartChecksum, object_checksum
from cloudckpt.storage.buffers import plan_parts
from cloudckpt.storage.streams import UploadStream, doubled_part_size, stream_part_size

KiB = 1024


class _Sink:
    """Records the parts sent (number -> bytes), like S3 would assemble them."""

    def __init__(self) -> None:
        self.parts: dict[int, bytes] = {}
        self.completed: list[int] = []
        self.whole: bytes | None = None

    def begin_upload(self, path: str, uri: str) -> str:
        return "upload-1"

    def send_part(
        self,
        path: str,
        upload_id: str,
        number: int,
        pieces: Sequence[memoryview],
        checksum: PartChecksum,
        where: tuple[str, int],
    ) -> dict[str, Any]:
        body = b"".join(bytes(p) for p in pieces)
        assert len(body) == checksum.length
        self.parts[number] = body
        return {"PartNumber": number}

    def complete_upload(
        self, path: str, uri: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None:
        self.completed = [p["PartNumber"] for p in parts]

    def abort_started(self, path: str, uri: str, upload_id: str) -> None:
        raise AssertionError("not aborted in these tests")

    def put_pieces(self, path: str, pieces: Sequence[memoryview], checksum: int) -> None:
        self.whole = b"".join(bytes(p) for p in pieces)


def _upload(data: bytes, part_size: int, max_parts: int, hint: int | None, write: int) -> Any:
    sink = _Sink()
    lease = contextlib.nullcontext(ThreadPoolExecutor(2))
    stream = UploadStream(
        "obj", "s3://b/obj", "b/obj", sink, lease, part_size, 2, size_hint=hint, max_parts=max_parts
    )
    owner = bytearray(data)
    with stream.referencing(owner):
        for start in range(0, len(data), write):
            stream.write(memoryview(owner)[start : start + write])
    result = stream.finish()
    return sink, result


@pytest.mark.parametrize("hint", [None, 64 * KiB * 40, 64 * KiB * 10])
def test_a_stream_stays_within_the_part_limit_and_its_blocks_stay_whole(hint: int | None) -> None:
    """40 parts' worth with a limit of 16 parts: the hint grows the part size up front
    (whole 64 KiB blocks); without one (or a low one) the part size doubles past half."""
    part, limit = 64 * KiB, 16
    data = bytes((i * 7 + i // 4096) % 251 for i in range(part * 40))
    sink, result = _upload(data, part, limit, hint, write=100 * KiB)
    assert 1 < len(sink.parts) <= limit
    assert sink.completed == sorted(sink.parts) == list(range(1, len(sink.parts) + 1))
    assembled = b"".join(sink.parts[n] for n in sink.completed)
    assert assembled == data
    sizes = [len(sink.parts[n]) for n in sink.completed]
    assert all(size % part == 0 for size in sizes[:-1]), sizes  # whole blocks per part
    crc, blocks = object_checksum(data, part)
    assert (result.size, result.crc32c) == (len(data), crc)
    assert result.blocks == blocks
    if hint == part * 40:  # known size: equal parts of ceil(40 / 16) = 3 blocks
        assert sizes[:-1] == [3 * part] * (len(sizes) - 1)


def test_a_known_size_within_the_limit_keeps_the_part_size() -> None:
    sink, _ = _upload(bytes(64 * KiB * 5), 64 * KiB, 16, 64 * KiB * 5, write=64 * KiB)
    assert [len(b) for b in sink.parts.values()] == [64 * KiB] * 5


def test_the_part_size_grows_in_whole_blocks_up_to_s3s_largest_part() -> None:
    assert stream_part_size(8 << 20, 8 << 20, 10_000, 1 << 20) == 8 << 20
    assert stream_part_size(8 << 20, 100 * (8 << 20) * 10_000 // 100 + 1, 10_000, 1 << 20) == (
        9 << 20
    )
    assert stream_part_size(5 << 20, 1 << 40, 10_000, 1 << 20) == 105 << 20  # 1 TiB
    assert doubled_part_size(3 << 30, 1 << 20) == S3_MAX_PART_SIZE
    assert doubled_part_size(S3_MAX_PART_SIZE, 1 << 20) == S3_MAX_PART_SIZE


def test_the_buffered_multipart_path_keeps_the_limit_in_whole_mib() -> None:
    size = 10_000 * (5 << 20) + 1
    parts = plan_parts(size, 5 << 20)
    assert len(parts) <= 10_000 and parts[-1][1] == size
    assert all((end - start) % (1 << 20) == 0 for start, end in parts[:-1])
