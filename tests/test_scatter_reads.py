"""Scatter reads: on object stores the buffers of one object are filled
by GETs of merged runs of their blocks, streamed straight into them (no copy of the
run), every block checked across the buffers and scratch it spans.

* The plan: each run's segments take exactly its bytes, in order, the caller's views
  where a buffer wants them and scratch elsewhere; bytes two buffers want are received
  once and copied; runs are cut at the part size on block boundaries.
* torch_dist objects put items under one block first: loading only the small tensors
  of an object costs one GET.
* On moto and SeaweedFS: many buffers of one object (partial blocks at both ends, a
  buffer across a run cut, overlapping buffers, an empty one) read right with one GET
  per run; a byte flipped in the store fails the read, naming the block.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage import CheckpointStorage, ReadRequest
from cloudckpt.storage.blocks import BLOCK_SIZE, BlockCrcs, block_mismatches, checksum_blocks
from cloudckpt.storage.pool import process_stats
from cloudckpt.storage.scatter import gather, plan_scatter
from tests.fixtures_object_stores import S3_CASES, bucket_location

MiB = 2**20
PART = 5 * MiB


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
