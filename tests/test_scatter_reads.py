"""Scatter reads (cloudckpt/storage/scatter.py): the buffers of one object are filled
by reads of merged runs of their blocks, straight into them (no copy of the run), every
block checked across the buffers and scratch it spans; on object stores one GET per run
streamed into them (StorageReads.read_into_many), on local files one request per run read
piece by piece (CheckpointStorage.read_into_many). Also the request threads kept across
calls (cloudckpt/storage/pool.py).

* The plan: each run's segments take exactly its bytes, in order, the caller's views
  where a buffer wants them and scratch elsewhere; bytes two buffers want are received
  once and copied; runs are cut at the part size on block boundaries.
* Local files: ranges of one object that share blocks are read in one run (one
  request), each byte once, into their buffers; what lies between them is checked too:
  a byte flipped there, or inside a range, fails the read naming the block. Each block
  is checked as soon as its bytes are read (pieces end where blocks end). Runs are at
  most a part long; objects the manifest does not list are read as is; overlapping
  ranges are read once and copied; ``verify_checksums`` takes the general path; a
  missing object is reported as damage when the manifest lists it.
* torch_dist objects put items under one block first: loading only the small tensors
  of an object costs one GET.
* On moto and SeaweedFS: many buffers of one object (partial blocks at both ends, a
  buffer across a run cut, overlapping buffers, an empty one) read right with one GET
  per run; a byte flipped in the store fails the read, naming the block.
* A call reuses the threads of the previous one; a call made from inside another
  call's task gets threads of its own (no deadlock).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage import CheckpointStorage, ReadRequest, WriteResult
from cloudckpt.storage.blocks import BLOCK_SIZE, BlockCrcs, block_mismatches, checksum_blocks
from cloudckpt.storage.pool import RequestPool, process_stats
from cloudckpt.storage.scatter import RunCheck, ScatterRun, gather, plan_reads, plan_scatter
from tests.fixtures_object_stores import S3_CASES, bucket_location

MiB = 2**20
PART = 5 * MiB
SIZE = 5 * MiB + 4321


def _assembled(run: Any) -> bytes:
    return b"".join(bytes(s) for s in run.segments)


def test_the_plan_covers_each_run_with_the_buffers_and_scratch() -> None:
    size = 12 * MiB + 100
    data = os.urandom(size)
    wanted_ranges = [(10, 20), (MiB - 5, 3 * MiB + 7), (3 * MiB + 7, 3 * MiB + 9),
                     (4 * MiB, 11 * MiB), (12 * MiB, size), (6 * MiB, 6 * MiB + 3)]  # fmt: skip
    buffers = [memoryview(bytearray(b - a)) for a, b in wanted_ranges]
    runs = plan_scatter(
        "o", [(a, v) for (a, _), v in zip(wanted_ranges, buffers, strict=True)], size, MiB, PART
    )
    assert [(r.start, r.end) for r in runs] == [
        (0, 5 * MiB),  # blocks 0-10 touch: one span, cut at the part size
        (5 * MiB, 10 * MiB),
        (10 * MiB, 11 * MiB),
        (12 * MiB, size),  # block 11 is not needed
    ]
    for run in runs:  # received in order: the segments are the run's bytes
        assert sum(s.nbytes for s in run.segments) == run.nbytes
        offset = run.start
        for segment in run.segments:
            segment[:] = data[offset : offset + segment.nbytes]
            offset += segment.nbytes
        assert _assembled(run) == data[run.start : run.end]
        run.copy_out()
    assert [bytes(v) for v in buffers] == [data[a:b] for a, b in wanted_ranges]
    # the buffers themselves are segments (no copy): 6 MiB's 3 bytes are a copy
    ids = {id(s.obj) for run in runs for s in run.segments}
    assert sum(id(v.obj) in ids for v in buffers) == len(buffers) - 1
    assert [len(run.copies) for run in runs] == [0, 1, 0, 0]


def test_overlapping_buffers_receive_once_and_copy() -> None:
    size = 3 * MiB
    data = os.urandom(size)
    ranges = [(100, 2 * MiB), (MiB, 2 * MiB + 50), (200, 300), (2 * MiB + 10, 2 * MiB + 20)]
    views = [memoryview(bytearray(b - a)) for a, b in ranges]
    (run,) = plan_scatter(
        "o", [(a, v) for (a, _), v in zip(ranges, views, strict=True)], size, MiB, PART
    )
    assert (run.start, run.end) == (0, size)
    offset = 0
    for segment in run.segments:
        segment[:] = data[offset : offset + segment.nbytes]
        offset += segment.nbytes
    assert offset == size
    run.copy_out()
    assert [bytes(v) for v in views] == [data[a:b] for a, b in ranges]


def test_gather_and_block_checks_span_segments() -> None:
    data = os.urandom(3 * MiB + 17)
    _, crcs = checksum_blocks(data, MiB)
    blocks = BlockCrcs.of(MiB, crcs)
    cuts = [0, 5, MiB - 1, MiB + 3, 2 * MiB, len(data)]
    segments = [memoryview(bytearray(data[a:b])) for a, b in itertools.pairwise(cuts)]
    assert block_mismatches(segments, 0, blocks) == []
    out = memoryview(bytearray(MiB + 10))
    gather(segments, MiB - 7, out)
    assert bytes(out) == data[MiB - 7 : 2 * MiB + 3]
    segments[4][2] ^= 1  # byte 2 MiB + 2: block 2
    assert [index for index, _ in block_mismatches(segments, 0, blocks)] == [2]
    assert [index for index, _ in block_mismatches(segments[4:], 2 * MiB, blocks)] == [2]
    with pytest.raises(ValueError, match="segments hold"):
        gather(segments, len(data) - 1, memoryview(bytearray(2)))


@pytest.fixture(params=S3_CASES)
def s3_uri(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, Any]]]:
    bucket_uri, options = bucket_location(request, request.param)
    yield f"{bucket_uri}/scatter", options


def test_many_buffers_of_one_object_in_one_get_per_run(s3_uri: tuple[str, dict]) -> None:
    uri, options = s3_uri
    config = CheckpointConfig(part_size=PART)
    data = bytearray(os.urandom(7 * MiB + 100))
    writer = CheckpointStorage(uri, storage_options=options, config=config)
    entry = writer.write("obj", bytes(data))
    assert entry.blocks is not None and entry.blocks.block_size == BLOCK_SIZE
    reader = writer.with_expected({"obj": entry})
    ranges = [(7, 70), (MiB - 3, 2 * MiB + 5), (2 * MiB + 5, 6 * MiB), (3 * MiB, 3 * MiB + 9),
              (7 * MiB, len(data)), (4 * MiB, 4 * MiB)]  # fmt: skip
    buffers = [bytearray(b - a) for a, b in ranges]
    before = reader.transport.counters.snapshot().reads
    reader.read_into_many(
        [(ReadRequest("obj", a), b) for (a, _), b in zip(ranges, buffers, strict=True)]
    )
    assert [bytes(b) for b in buffers] == [bytes(data[a:b]) for a, b in ranges]
    # blocks 0-5 merge into one run, cut at the part size; block 7 on its own
    assert reader.transport.counters.snapshot().reads - before == 3
    flip = 5 * MiB + 11  # block 5: only the reads covering it fail
    data[flip] ^= 0x01
    writer.write("obj", bytes(data))  # the manifest entry still has the old CRCs
    ok = bytearray(60)
    reader.read_into_many([(ReadRequest("obj", 10), ok)])
    assert bytes(ok) == bytes(data[10:70])
    for start, end in [(flip, flip + 1), (2 * MiB + 5, 6 * MiB), (4 * MiB + 1, 7 * MiB + 100)]:
        with pytest.raises(CorruptObjectError) as info:
            reader.read_into_many([(ReadRequest("obj", start), bytearray(end - start))])
        message = str(info.value)
        assert f"bytes {5 * MiB}-{6 * MiB} (block 5 of 8" in message, message
        assert "rank 0" in message


def test_small_items_share_blocks_and_load_in_one_get(s3_uri: tuple[str, dict]) -> None:
    """Items under one block go first in their object: a load of only the small
    tensors (what a TP rank reads of another's replicated layer norms) fetches the
    block or two they share in one GET, not one block per item between the big ones."""
    uri, options = s3_uri
    gen = torch.Generator().manual_seed(14)
    state: dict[str, Any] = {}
    for layer in range(6):  # a 2 MB weight, then a 2 KB vector, in plan order
        for name, shape in (("w", (500, 1000)), ("ln", (500,))):
            key = f"{layer}.{name}"
            state[key] = ShardedTensor.from_rank_offsets(key, torch.randn(shape, generator=gen))
    cloudckpt.save(state, uri, sharded_strategy=("torch_dist", 1), storage_options=options)
    small = {k: v for k, v in state.items() if k.endswith("ln")}
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data)) for k, v in small.items()
    }
    before = process_stats()
    loaded = cloudckpt.load(request, uri, storage_options=options, validate_access_integrity=False)
    stats = process_stats() - before
    for key, sh in small.items():
        assert torch.equal(loaded[key], sh.data)
    whole = process_stats()
    cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data)) for k, v in state.items()},
        uri,
        storage_options=options,
        validate_access_integrity=False,
    )
    metadata_reads = (process_stats() - whole).reads - 1  # the whole object: one GET
    assert stats.reads == metadata_reads + 1, (stats, metadata_reads)
    assert stats.bytes_read < whole_bytes(state) / 4, stats


def whole_bytes(state: dict[str, Any]) -> int:
    return sum(sh.data.numel() * sh.data.element_size() for sh in state.values())


# -- local files ------------------------------------------------------------


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
    storage, data, _ = _written(tmp_path)
    views = [(ReadRequest("obj", a), memoryview(bytearray(b - a))) for a, b in _ranges()]
    runs = plan_reads(storage.expected, views, MiB + 5)  # whole blocks: 1 MiB runs
    assert [(r.start, r.end) for r in runs] == [
        (i * MiB, min((i + 1) * MiB, SIZE)) for i in range(6)
    ]
    for run in runs:
        lengths = [view.nbytes for view in run.segments]
        offsets = list(itertools.accumulate(lengths[:-1], initial=run.start))
        assert offsets[0] == run.start and sum(lengths) == run.end - run.start
        assert all(o + n == p for o, n, p in zip(offsets, lengths, offsets[1:], strict=False))
        for offset, segment in zip(offsets, run.segments, strict=True):  # read in order
            segment[:] = data[offset : offset + segment.nbytes]
        assert not run.copies
    assert [bytes(v) for _, v in views] == [data[a:b] for a, b in _ranges()]


def test_overlapping_local_ranges_are_read_once_and_copied(tmp_path: Path) -> None:
    """Ranges of one object that overlap are read in one run, the shared bytes into the
    first buffer, copied to the others once their blocks are checked; a byte flipped
    in the shared bytes fails the read."""
    storage, data, _ = _written(tmp_path)
    overlapping = [(100, 3 * MiB), (MiB, 2 * MiB + 50), (200, 300), (2 * MiB + 10, 2 * MiB + 20)]
    before = storage.transport.counters.snapshot()
    assert [bytes(b) for b in _read(storage, overlapping)] == [data[a:b] for a, b in overlapping]
    stats = storage.transport.counters.snapshot() - before
    assert (stats.reads, stats.bytes_read) == (1, 3 * MiB)
    _flip(tmp_path, MiB + 20)  # in bytes the first two ranges share
    with pytest.raises(CorruptObjectError, match=r"bytes 1048576-2097152 \(block 1 of 6"):
        _read(storage, overlapping)


def test_each_block_is_checked_as_soon_as_it_is_read(tmp_path: Path) -> None:
    """A run is read in pieces that end where its blocks end, and each block's CRC-32C
    is compared as soon as its last piece is filled, before the next piece is read
    (while its bytes are in the CPU's cache); the read fails naming the block."""
    storage, data, _ = _written(tmp_path, part_size=8 * MiB)

    def one_run() -> ScatterRun:
        views = [(ReadRequest("obj", a), memoryview(bytearray(b - a))) for a, b in _ranges()]
        (run,) = plan_reads(storage.expected, views, 8 * MiB)
        return run

    pieces = RunCheck(one_run(), storage.expected).pieces()
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
        if check.failed:
            read_after_failure.append(piece.nbytes)
        check.add(piece)

    storage.transport.read_segments(str(path), 0, check.pieces(), filled)
    assert sum(read_after_failure) == SIZE - 2 * BLOCK_SIZE  # blocks 2 to 5
    with pytest.raises(CorruptObjectError, match=r"block 1 of 6"):
        check.finish()
    with pytest.raises(CorruptObjectError, match=r"block 1 of 6"):
        _read(storage, _ranges())


def test_a_large_object_without_block_crcs_is_checked_whole(tmp_path: Path) -> None:
    """A version-1 manifest lists a large object with its CRC only: a whole read of it
    on a local disk is checked against that CRC, as on an object store."""
    _, data, result = _written(tmp_path)
    unblocked = dataclasses.replace(result, blocks=None)
    old = CheckpointStorage(str(tmp_path / "ckpt"), expected={"obj": unblocked})
    assert bytes(_read(old, [(0, SIZE)])[0]) == data
    _flip(tmp_path, 2 * MiB + 2)
    with pytest.raises(CorruptObjectError, match="obj"):
        _read(old, [(0, SIZE)])
