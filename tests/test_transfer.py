"""Pure transfer helpers: part plans, the zero-copy body reader, checksums, progress."""

from __future__ import annotations

import io
import itertools
import logging

import pytest

from cloudckpt.config import MiB
from cloudckpt.storage.buffers import (
    BufferReader,
    Progress,
    as_bytes_view,
    crc32c,
    crc32c_base64,
    plan_parts,
)


@pytest.mark.parametrize(
    ("size", "part", "expected"),
    [
        (0, 10, [(0, 0)]),
        (5, 10, [(0, 5)]),
        (10, 10, [(0, 10)]),
        (25, 10, [(0, 10), (10, 20), (20, 25)]),
    ],
)
def test_plan_parts(size: int, part: int, expected: list[tuple[int, int]]) -> None:
    assert plan_parts(size, part) == expected


def test_plan_parts_grows_the_part_size_to_stay_within_the_part_limit() -> None:
    size = 10 * 1000 * MiB + 1  # needs 10,001 parts of 1 MiB
    parts = plan_parts(size, MiB, max_parts=10_000)
    assert len(parts) <= 10_000
    assert parts[0] == (0, 2 * MiB)
    assert parts[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))


def test_plan_parts_rejects_a_zero_part_size() -> None:
    with pytest.raises(ValueError, match="part_size"):
        plan_parts(10, 0)


def test_buffer_reader_reads_seeks_and_slices_without_copying_the_source() -> None:
    source = bytearray(b"0123456789")
    reader = BufferReader(memoryview(source))
    assert len(reader) == 10 and reader.seekable() and reader.readable()
    assert reader.read(3) == b"012"
    assert reader.tell() == 3
    target = bytearray(4)
    assert reader.readinto(target) == 4 and target == b"3456"
    assert reader.read() == b"789"
    assert reader.read(5) == b""
    assert reader.seek(-2, io.SEEK_END) == 8 and reader.read() == b"89"
    reader.seek(0)
    part = reader[2:5]
    assert len(part) == 3 and part.read() == b"234"
    source[3] = ord("X")  # slices view the same memory
    assert reader[2:5].read() == b"2X4"


def test_as_bytes_view_flattens_typed_views() -> None:
    view = memoryview(bytearray(8)).cast("I")
    flat = as_bytes_view(view)
    assert flat.format == "B" and flat.nbytes == 8


def test_crc32c_known_value_and_s3_encoding() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283
    assert crc32c_base64(0xE3069283) == "4waSgw=="


def test_progress_logs_at_most_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cloudckpt.storage.buffers")
    progress = Progress("wrote", "s3://b/ckpt", total_bytes=4_000_000, count=4, interval=0.0)
    for _ in range(4):
        progress.add(1_000_000)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert messages[-1].startswith("wrote 4.0 of 4.0 MB (100%")
    assert messages[-1].endswith("at s3://b/ckpt")
    quiet = Progress("read", "x", total_bytes=10, count=1, interval=3600.0)
    quiet.add(10)
    assert len(caplog.records) == 4 and quiet.done == 10
