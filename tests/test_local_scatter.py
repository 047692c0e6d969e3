"""Local reads into many buffers, in runs of whole blocks checked in place
(cloudckpt/storage/local_scatter.py through CheckpointStorage.read_into_many), and the
request threads kept across calls (cloudckpt/storage/pool.py).

* Ranges of one object that share blocks are read in one run (one request), each
  byte once, into their buffers; what lies between them is checked too: a byte
  flipped there, or inside a range, fails the read naming the block. Each block is
  checked as soon as its bytes are read (pieces end where blocks end).
* Runs are at most a part long; objects the manifest does not list are read as is;
  overlapping ranges and ``verify_checksums`` take the general path; a missing
  object is reported as damage when the manifest lists it.
* A call reuses the threads of the previous one; a call made from inside another
  call's task gets threads of its own (no deadlock).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage import CheckpointStorage, ReadRequest, WriteResult
from cloudckpt.storage.blocks import BLOCK_SIZE
from cloudckpt.storage.local_scatter import Run, RunCheck, block_pieces, plan_runs
from cloudckpt.storage.pool import RequestPool

MiB = 1024 * 1024
SIZE = 5 * MiB + 4321


def _written(tmp_path: Path, **config: int) -> tuple[CheckpointStorage, bytes, WriteResult]:
    """A local storage with one ``SIZE``-byte object, checked against its write."""
    uri = str(tmp_path / "ckpt")
    data = random.Random(7).randbytes(SIZE)
    result = CheckpointStorage(uri).write("obj", data)
    assert result.blocks is not None
    storage = CheckpointStorage(uri, config=CheckpointConfig(**config), expected={"obj": result})
    return storage, data, result


def _ranges() -> list[tuple[int, int]]:
    """Ranges that straddle block boundaries, with gaps of headers' size between
    them, one inside a block, and one up to the end of the object."""
    return [(100, MiB + 50), (MiB + 2000, 2 * MiB - 10), (2 * MiB + 5, 2 * MiB + 700),
            (3 * MiB + 1, 4 * MiB + 99), (SIZE - 3000, SIZE)]  # fmt: skip


def _read(storage: CheckpointStorage, ranges: list[tuple[int, int]]) -> list[bytearray]:
    buffers = [bytearray(b - a) for a, b in ranges]
    storage.read_into_many(
        [(ReadRequest("obj", a), buf) for (a, _), buf in zip(ranges, buffers, strict=True)]
    )
    return buffers


def test_ranges_sharing_blocks_are_read_in_one_checked_run(tmp_path: Path) -> None:
    storage, data, _ = _written(tmp_path)
    before = storage.transport.counters.snapshot()
    buffers = _read(storage, _ranges())
    assert [bytes(b) for b in buffers] == [data[a:b] for a, b in _ranges()]
    stats = storage.transport.counters.snapshot() - before
    assert stats.reads == 1  # every block from 0 to the end is touched: one run
    assert stats.bytes_read == SIZE  # each byte once, gaps included


def test_runs_are_at_most_a_part(tmp_path: Path) -> None:
    storage, data, _ = _written(tmp_path, part_size=5 * MiB)
    before = storage.transport.counters.snapshot()
    assert bytes(_read(storage, [(0, SIZE)])[0]) == data
    stats = storage.transport.counters.snapshot() - before
    assert (stats.reads, stats.bytes_read) == (2, SIZE)


def _flip(tmp_path: Path, offset: int) -> None:
    path = tmp_path / "ckpt" / "obj"
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("offset", "block"),
    [(MiB + 1000, 1), (3 * MiB + 10, 3), (2 * MiB + 2, 2)],
    ids=["between-ranges", "inside-a-range", "before-a-range-in-its-block"],
)
def test_a_flipped_byte_anywhere_in_a_read_block_fails_the_read(
    tmp_path: Path, offset: int, block: int
) -> None:
    storage, _, _ = _written(tmp_path)
    _flip(tmp_path, offset)
    with pytest.raises(CorruptObjectError, match=f"block {block} of 6"):
        _read(storage, _ranges())


def test_a_block_no_range_touches_is_not_read(tmp_path: Path) -> None:
    storage, data, _ = _written(tmp_path)
    _flip(tmp_path, 4 * MiB + 500)  # block 4: untouched by these ranges
    ranges = [(10, 20), (5 * MiB + 1, 5 * MiB + 9)]
    before = storage.transport.counters.snapshot()
    assert [bytes(b) for b in _read(storage, ranges)] == [data[a:b] for a, b in ranges]
    stats = storage.transport.counters.snapshot() - before
    assert (stats.reads, stats.bytes_read) == (2, BLOCK_SIZE + SIZE - 5 * MiB)


def test_unlisted_objects_overlaps_and_verify_checksums_read_correctly(tmp_path: Path) -> None:
    storage, data, result = _written(tmp_path)
    unlisted = CheckpointStorage(str(tmp_path / "ckpt"))
    assert [bytes(b) for b in _read(unlisted, _ranges())] == [data[a:b] for a, b in _ranges()]
    overlapping = [(0, 3 * MiB), (MiB, 2 * MiB)]
    assert [bytes(b) for b in _read(storage, overlapping)] == [data[a:b] for a, b in overlapping]
    verified = CheckpointStorage(
        str(tmp_path / "ckpt"), expected={"obj": result}, verify_checksums=True
    )
    assert [bytes(b) for b in _read(verified, _ranges())] == [data[a:b] for a, b in _ranges()]


def test_a_missing_listed_object_is_damage(tmp_path: Path) -> None:
    storage, _, _ = _written(tmp_path)
    (tmp_path / "ckpt" / "obj").unlink()
    with pytest.raises(CorruptObjectError, match="listed in the manifest but does not exist"):
        _read(storage, _ranges())


def test_request_threads_are_kept_and_nested_calls_get_their_own() -> None:
    pool = RequestPool(2)
    with pool.executor(4) as first:
        futures = [first.submit(threading.current_thread) for _ in range(4)]
    assert all(f.done() for f in futures)  # leaving the lease waited for its tasks
    with pool.executor(4) as second:
        assert second is first  # the same threads again
        with pool.executor(4) as nested:
            assert nested is not first  # leased meanwhile: threads of its own

    def inner(i: int) -> list[int]:
        return pool.map(lambda j: i * 10 + j, [1, 2, 3])

    assert pool.map(inner, [1, 2, 3]) == [[11, 12, 13], [21, 22, 23], [31, 32, 33]]


def test_runs_cut_at_block_multiples_cover_every_byte_once(tmp_path: Path) -> None:
    storage, _, _ = _written(tmp_path)
    views = [(ReadRequest("obj", a), memoryview(bytearray(b - a))) for a, b in _ranges()]
    runs = plan_runs(storage.expected, views, max_run=MiB + 5)  # whole blocks: 1 MiB runs
    assert [(r.start, r.end) for r in runs] == [
        (i * MiB, min((i + 1) * MiB, SIZE)) for i in range(6)
    ]
    for run in runs:
        offsets = [offset for offset, _ in run.segments]
        lengths = [view.nbytes for _, view in run.segments]
        assert offsets[0] == run.start and sum(lengths) == run.end - run.start
        assert all(o + n == p for o, n, p in zip(offsets, lengths, offsets[1:], strict=False))


def test_each_block_is_checked_as_soon_as_it_is_read(tmp_path: Path) -> None:
    """A run is read in pieces that end where its blocks end, and each block's CRC-32C
    is compared as soon as its last piece is filled, before the next piece is read
    (while its bytes are in the CPU's cache); the read fails naming the block."""
    storage, data, _ = _written(tmp_path, part_size=8 * MiB)

    def one_run() -> Run:
        views = [(ReadRequest("obj", a), memoryview(bytearray(b - a))) for a, b in _ranges()]
        (run,) = plan_runs(storage.expected, views, max_run=8 * MiB)
        return run

    pieces = block_pieces(one_run())
    assert sum(p.nbytes for p in pieces) == SIZE  # the run covers the whole object
    at = 0
    for piece in pieces:  # no piece crosses a block boundary
        assert at // BLOCK_SIZE == (at + piece.nbytes - 1) // BLOCK_SIZE
        at += piece.nbytes
    damaged = bytearray(data)
    damaged[BLOCK_SIZE + 77] ^= 0x01  # in block 1
    path = tmp_path / "ckpt" / "obj"
    path.write_bytes(bytes(damaged))
    run = one_run()
    check = RunCheck(run, storage.expected)
    read_after_failure = []

    def filled(piece: memoryview) -> None:
        if check._failure is not None:
            read_after_failure.append(piece.nbytes)
        check.add(piece)

    storage.transport.read_segments(str(path), 0, block_pieces(run), filled)
    assert sum(read_after_failure) == SIZE - 2 * BLOCK_SIZE  # blocks 2 to 5
    with pytest.raises(CorruptObjectError, match=r"block 1 of 6"):
        check.finish()
    with pytest.raises(CorruptObjectError, match=r"block 1 of 6"):
        _read(storage, _ranges())
