"""Resharded torch_dist loads read only the bytes of the stored items they need: a
TP2-saved tensor loaded as TP4 reads each quarter, not each half.

* The pieces: where ``torch.save`` puts a tensor's elements (:func:`storage_record`),
  the C-order runs of a box and their widening over small gaps; the storage layer's
  counters of reads and bytes read.
* The format stays PyTorch DCP's: ``.metadata`` holds plain ``_StorageInfo`` entries,
  the records live in ``mcore_data``, and stock ``dcp.load`` reads the checkpoint.
* TP2 -> TP4 along dim 0 (float32, bfloat16), along dim 1 (long rows: two ranges;
  short rows: the whole item), TP4 along dim 0 from a dim-1 save, and flattened
  (distributed-optimizer) ranges: the loaded tensors are exact, and the storage layer's
  counters (:class:`~cloudckpt.storage.retry.RequestStats`: reads, bytes_read) show one
  read per needed range and at most the needed bytes plus one CRC block at each end,
  fewer than the same loads of the same checkpoint without the records.
* A checkpoint written by stock PyTorch DCP (no records) still loads, reading items whole.
* A byte flipped inside a needed range fails the load (``CorruptObjectError``); a
  quarter whose blocks do not hold it loads.
* Every kind of store: TP4 quarters of a TP2 save, exact and fewer bytes.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import pickle
import warnings
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.commit_state import amend_manifest, open_committed
from cloudckpt.errors import CorruptObjectError
from cloudckpt.formats.dcp.ranges import (
    TENSOR_DATA_KEY,
    element_runs,
    read_box,
    storage_record,
)
from cloudckpt.formats.dcp.reader import DcpCheckpoint
from cloudckpt.formats.dcp.storage import read_metadata
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.storage import CheckpointStorage
from cloudckpt.storage.blocks import BLOCK_SIZE
from cloudckpt.storage.pool import process_stats
from cloudckpt.storage.retry import RequestStats

MiB = 2**20
BLOCK = BLOCK_SIZE  # 1 MiB: a checked range is widened to whole CRC blocks
TORCH_DIST = ("torch_dist", 1)
T = TypeVar("T")


def reference(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def _shards(
    key: str, shape: tuple[int, ...], axis: int, tp: int, dtype: torch.dtype, empty: bool = False
) -> list[ShardedTensor]:
    """The ``tp`` shards of ``key`` cut along ``axis`` (empty ones: a load request)."""
    parts = reference(key, shape, dtype).chunk(tp, dim=axis)
    return [
        ShardedTensor.from_rank_offsets(
            key, torch.empty_like(part) if empty else part.clone(), (axis, rank, tp)
        )
        for rank, part in enumerate(parts)
    ]


def _save_tp2(
    uri: str,
    specs: dict[str, tuple[tuple[int, ...], int, torch.dtype]],
    options: dict[str, Any] | None = None,
) -> None:
    """One writer holding both TP2 shards of every key (``key: (shape, axis, dtype)``)."""
    state: dict[str, Any] = {}
    for key, (shape, axis, dtype) in specs.items():
        for rank, shard in enumerate(_shards(key, shape, axis, 2, dtype)):
            state[f"{key}.{rank}"] = shard
    cloudckpt.save(state, uri, sharded_strategy=TORCH_DIST, storage_options=options)


def _checkpoint(uri: str) -> DcpCheckpoint:
    """The DCP part of a committed checkpoint, its reads checked against the manifest."""
    storage = CheckpointStorage(uri)
    committed = open_committed(storage)
    return DcpCheckpoint(storage.with_expected(committed.expected_objects()))


def _counted(fn: Callable[[], T]) -> tuple[T, RequestStats]:
    before = process_stats()
    out = fn()
    return out, process_stats() - before


def _load_one(checkpoint: DcpCheckpoint, sh: ShardedTensor) -> tuple[torch.Tensor, RequestStats]:
    loaded, stats = _counted(lambda: checkpoint.load_tensors([sh]))
    return loaded[id(sh)], stats


def _strip_records(uri: str, options: dict[str, Any] | None = None) -> None:
    """Drop the records from ``.metadata``: the checkpoint as PyTorch DCP would write it."""
    storage = CheckpointStorage(uri, storage_options=options)
    metadata = read_metadata(storage)
    extra = metadata.mcore_data  # type: ignore[attr-defined]
    metadata.mcore_data = {  # type: ignore[attr-defined]
        key: {k: v for k, v in entry.items() if k != TENSOR_DATA_KEY}
        for key, entry in extra.items()
    }
    amend_manifest(storage, rewritten=[storage.write(METADATA_FNAME, pickle.dumps(metadata))])


def _item_bytes(checkpoint: DcpCheckpoint, key: str) -> dict[tuple[int, ...], int]:
    """Bytes of every stored item of ``key``, by chunk offsets."""
    return {
        tuple(index.offset or ()): info.length
        for index, info in (checkpoint.metadata.storage_data or {}).items()
        if index.fqn == key
    }


# -- the pieces --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(1000, dtype=torch.bfloat16),
        torch.randn(7, 3, 5),
        torch.tensor(2.5, dtype=torch.float64),
        torch.arange(13, dtype=torch.int8),
        torch.ones(4, 2, dtype=torch.bool),
    ],
    ids=["bf16", "f32-3d", "scalar", "int8-odd", "bool"],
)
def test_storage_record_locates_the_elements(tensor: torch.Tensor) -> None:
    buffer = io.BytesIO(b"x" * 100)
    buffer.seek(100)
    torch.save(tensor, buffer)
    raw = buffer.getvalue()[100:]
    with memoryview(raw) as view:
        record = storage_record(view)
    assert record is not None
    start, nbytes = record
    assert nbytes == tensor.numel() * tensor.element_size()
    elements = raw[start : start + nbytes]
    assert elements == tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("shape", "box"),
    [
        ((4, 6, 5), ((1, 2, 0), (2, 3, 5))),
        ((4, 6, 5), ((0, 0, 1), (4, 6, 3))),
        ((4, 6, 5), ((3, 0, 0), (1, 6, 5))),
        ((4, 6, 5), ((0, 0, 0), (4, 6, 5))),
        ((8,), ((2,), (5,))),
        ((), ((), ())),
        ((3, 4), ((1, 0), (0, 4))),
    ],
)
def test_element_runs_cover_exactly_the_box(shape: tuple[int, ...], box: Any) -> None:
    flat = torch.arange(math.prod(shape)).reshape(shape)
    index = tuple(slice(o, o + s) for o, s in zip(*box, strict=True))
    runs = element_runs(shape, box)
    covered = [i for start, length in runs for i in range(start, start + length)]
    assert covered == flat[index].reshape(-1).tolist()
    assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))  # apart


def test_read_box_widens_over_small_gaps_only() -> None:
    shape = (4, 8, 1024)  # rows of 1024 elements
    box = ((1, 2, 0), (2, 4, 512))  # half of each row: gaps of 512 elements
    assert read_box(shape, box, 4, gap=4096) == ((1, 2, 0), (2, 4, 1024))  # 2 KiB gaps
    assert read_box(shape, box, 4, gap=2048) == box  # gaps of exactly 2 KiB stay
    assert read_box(shape, ((1, 2, 0), (1, 1, 512)), 4, gap=MiB) == ((1, 2, 0), (1, 1, 512))
    assert read_box(shape, box, 4, gap=MiB) == ((1, 0, 0), (2, 8, 1024))  # whole planes


def test_read_counters_count_reads_and_bytes(tmp_path: Any) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    storage.write("obj", bytes(range(256)) * 4096)  # 1 MiB
    before, local = process_stats(), storage.transport.counters.snapshot()
    assert len(storage.read("obj")) == MiB
    assert len(storage.read("obj", 10, 1010)) == 1000
    buffer = bytearray(4096)
    storage.read_into("obj", buffer, 5000)
    for stats in (process_stats() - before, storage.transport.counters.snapshot() - local):
        assert (stats.reads, stats.bytes_read) == (3, MiB + 1000 + 4096)


# -- the format --------------------------------------------------------------------------


def test_records_live_in_mcore_data_and_stock_dcp_reads_the_checkpoint(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    _save_tp2(uri, {"w": ((64, 32), 0, torch.bfloat16), "v": ((6, 4), 1, torch.float32)})
    with open(tmp_path / "ckpt" / METADATA_FNAME, "rb") as f:
        metadata = pickle.load(f)  # as DCP's FileSystemReader and Megatron-Core read it
    assert {type(info) for info in metadata.storage_data.values()} == {_StorageInfo}
    for key, offsets in (("w", [(0, 0), (32, 0)]), ("v", [(0, 0), (0, 2)])):
        table = metadata.mcore_data[key][TENSOR_DATA_KEY]
        assert sorted(table) == offsets
        for offs, (start, nbytes) in table.items():
            info = metadata.storage_data[MetadataIndex(key, offs)]
            assert (
                start + nbytes <= info.length and nbytes == {"w": 32 * 32 * 2, "v": 6 * 2 * 4}[key]
            )
    target = {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "v": torch.zeros(6, 4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=uri)
    assert torch.equal(target["w"], reference("w", (64, 32), torch.bfloat16))
    assert torch.equal(target["v"], reference("v", (6, 4)))


# -- TP2 -> TP4: exact tensors, fewer bytes ------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((2048, 2048), torch.float32), ((4096, 2048), torch.bfloat16)],
    ids=["float32", "bfloat16"],
)
def test_tp2_to_tp4_along_dim_0_reads_each_quarter(
    tmp_path: Any, shape: tuple[int, int], dtype: torch.dtype
) -> None:
    uri = str(tmp_path / "ckpt")
    _save_tp2(uri, {"w": (shape, 0, dtype)})
    full = reference("w", shape, dtype)
    quarter = full.numel() * full.element_size() // 4  # 4 MiB
    totals = []
    for recorded in (True, False):
        if not recorded:
            _strip_records(uri)
        checkpoint = _checkpoint(uri)
        items = _item_bytes(checkpoint, "w")
        total = 0
        for rank, sh in enumerate(_shards("w", shape, 0, 4, dtype, empty=True)):
            loaded, stats = _load_one(checkpoint, sh)
            assert loaded.dtype == dtype and torch.equal(loaded, full.chunk(4)[rank])
            assert stats.reads == 1  # one ranged GET
            if recorded:  # the quarter, widened to CRC blocks
                assert quarter <= stats.bytes_read <= quarter + 2 * BLOCK
            else:  # the whole item (half the tensor), widened to CRC blocks
                assert stats.bytes_read >= items[(rank // 2 * shape[0] // 2, 0)]
            total += stats.bytes_read
        totals.append(total)
    ranged, whole = totals
    assert ranged <= 0.65 * whole, totals


def test_tp2_to_tp4_along_dim_1_long_rows_reads_two_ranges(tmp_path: Any) -> None:
    """Rows of 16 MiB: a quarter is 4 MiB of each of the item's two rows, 4 MiB apart."""
    uri = str(tmp_path / "ckpt")
    shape = (2, 2**22)
    _save_tp2(uri, {"w": (shape, 1, torch.float32)})
    full = reference("w", shape)
    checkpoint = _checkpoint(uri)
    for rank, sh in enumerate(_shards("w", shape, 1, 4, torch.float32, empty=True)):
        loaded, stats = _load_one(checkpoint, sh)
        assert torch.equal(loaded, full.chunk(4, dim=1)[rank])
        assert stats.reads == 2
        assert 8 * MiB <= stats.bytes_read <= 8 * MiB + 4 * BLOCK


def test_tp2_along_dim_1_short_rows(tmp_path: Any) -> None:
    """Rows of 4 KiB: a TP4 quarter along dim 1 needs half of every row of an item, so
    the item is read whole; a TP4 quarter along dim 0 needs a quarter of the rows of
    each of the two items, one range each."""
    uri = str(tmp_path / "ckpt")
    shape = (2048, 2048)
    _save_tp2(uri, {"w": (shape, 1, torch.float32)})
    full = reference("w", shape)
    checkpoint = _checkpoint(uri)
    items = _item_bytes(checkpoint, "w")
    for rank, sh in enumerate(_shards("w", shape, 1, 4, torch.float32, empty=True)):
        loaded, stats = _load_one(checkpoint, sh)
        assert torch.equal(loaded, full.chunk(4, dim=1)[rank])
        assert stats.reads == 1 and stats.bytes_read >= items[(0, rank // 2 * 1024)]
    needed = full.numel() * 4 // 4  # 4 MiB per TP4 rank, half from each item
    for rank, sh in enumerate(_shards("w", shape, 0, 4, torch.float32, empty=True)):
        loaded, stats = _load_one(checkpoint, sh)
        assert torch.equal(loaded, full.chunk(4, dim=0)[rank])
        assert stats.reads == 2
        assert needed <= stats.bytes_read <= needed + 4 * BLOCK


def _flat_state(tp: int, bounds: list[int], full: torch.Tensor, empty: bool) -> dict[str, Any]:
    """Distributed-optimizer state: each TP chunk of ``full`` (cut along dim 0) split
    into flat ranges ``bounds`` over data-parallel ranks, all in this one process."""
    state = {}
    for tp_rank, local in enumerate(full.chunk(tp, dim=0)):
        for dp_rank, (a, b) in enumerate(itertools.pairwise(bounds)):
            values = local.reshape(-1)[a:b]
            state[f"m.{tp_rank}.{dp_rank}"] = ShardedTensor.from_rank_offsets_flat(
                "m",
                torch.zeros_like(values) if empty else values.clone(),
                tuple(local.shape),
                (0, tp_rank, tp),
                flattened_range=slice(a, b),
            )
    return state


def test_flattened_ranges_tp2_dp2_to_tp4_dp2(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    shape = (2048, 1024)  # 8 MiB; TP2 chunks of 4 MiB, cut at element 400,000 over DP2
    full = reference("m", shape)
    cloudckpt.save(
        _flat_state(2, [0, 400_000, 1_048_576], full, empty=False),
        uri,
        sharded_strategy=TORCH_DIST,
    )
    totals = []
    for recorded in (True, False):
        if not recorded:
            _strip_records(uri)
        checkpoint = _checkpoint(uri)
        total = 0
        request = _flat_state(4, [0, 200_000, 524_288], full, empty=True)
        for name, sh in request.items():
            loaded, stats = _load_one(checkpoint, sh)
            tp_rank = int(name.split(".")[1])
            expected = full.chunk(4, dim=0)[tp_rank].reshape(-1)[sh.flattened_range]
            assert torch.equal(loaded, expected), name
            needed = expected.numel() * 4
            if recorded:  # the rows the range touches, at most one CRC block more per end
                assert needed <= stats.bytes_read <= needed + 4 * 1024 * 2 + 4 * BLOCK
            total += stats.bytes_read
        totals.append(total)
    ranged, whole = totals
    assert ranged <= 0.6 * whole, totals  # each DP rank reads its part, not whole pieces


# -- checkpoints written by others; damage ---------------------------------------------------


def test_a_stock_dcp_checkpoint_loads_reading_items_whole(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    full = reference("w", (256, 512), torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": full.clone()}, checkpoint_id=uri)  # FileSystemWriter: no records
    meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (tmp_path / "ckpt" / "metadata.json").write_text(json.dumps(meta))
    torch.save({}, str(tmp_path / "ckpt" / "common.pt"))
    item = full.numel() * 2
    for axis in (0, 1):
        for rank, sh in enumerate(_shards("w", (256, 512), axis, 4, torch.bfloat16, True)):
            loaded, stats = _counted(
                lambda sh=sh: cloudckpt.load({"w": sh}, uri, validate_access_integrity=False)
            )
            assert torch.equal(loaded["w"], full.chunk(4, dim=axis)[rank])
            assert stats.bytes_read >= item  # the whole item


def test_a_flipped_byte_in_a_needed_range_fails_the_load(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    shape = (2048, 1024)  # items of 4 MiB, quarters of 2 MiB
    _save_tp2(uri, {"w": (shape, 0, torch.float32)})
    full = reference("w", shape)
    checkpoint = _checkpoint(uri)
    info = checkpoint.metadata.storage_data[MetadataIndex("w", (0, 0))]  # type: ignore[index]
    start, _ = checkpoint.metadata.mcore_data["w"][TENSOR_DATA_KEY][(0, 0)]  # type: ignore[attr-defined]
    quarter = full.numel() * 4 // 4
    flip = info.offset + start + quarter + quarter // 2  # in the middle of TP4 rank 1's rows
    with open(tmp_path / "ckpt" / info.relative_path, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x01]))
    requests = _shards("w", shape, 0, 4, torch.float32, empty=True)
    for rank in (0, 2, 3):  # their blocks do not hold the byte
        loaded, _ = _load_one(checkpoint, requests[rank])
        assert torch.equal(loaded, full.chunk(4)[rank])
    with pytest.raises(CorruptObjectError, match=rf"{info.relative_path}.*CRC-32C"):
        _load_one(checkpoint, requests[1])
    whole = ShardedTensor.from_rank_offsets("w", torch.empty(shape))
    with pytest.raises(CorruptObjectError, match=rf"{info.relative_path}.*CRC-32C"):
        cloudckpt.load({"w": whole}, uri, validate_access_integrity=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_unresharded_load_reads_the_elements_straight_into_the_tensor(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Each rank needs exactly a stored item (the same TP2 layout): its elements are read
    straight into the new tensor, without torch.load (which would copy them and check
    torch's own CRC-32 again) - exact, and a flipped byte still fails the load."""
    uri = str(tmp_path / "ckpt")
    shape = (1024, 1024)  # items of 2 or 4 MiB
    _save_tp2(uri, {"w": (shape, 0, dtype)})
    full = reference("w", shape, dtype)
    checkpoint = _checkpoint(uri)

    def no_torch_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the item was decoded with torch.load")

    monkeypatch.setattr("cloudckpt.formats.dcp.reader.load_tensor_item", no_torch_load)
    half = full.numel() * full.element_size() // 2
    for rank, sh in enumerate(_shards("w", shape, 0, 2, dtype, empty=True)):
        loaded, stats = _load_one(checkpoint, sh)
        assert loaded.dtype == dtype and torch.equal(loaded, full.chunk(2)[rank])
        assert half <= stats.bytes_read <= half + 2 * BLOCK  # the elements, no zip records
    info = checkpoint.metadata.storage_data[MetadataIndex("w", (512, 0))]  # type: ignore[index]
    start, _ = checkpoint.metadata.mcore_data["w"][TENSOR_DATA_KEY][(512, 0)]  # type: ignore[attr-defined]
    with open(tmp_path / "ckpt" / info.relative_path, "r+b") as f:
        f.seek(info.offset + start + half // 3)
        byte = f.read(1)
        f.seek(info.offset + start + half // 3)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptObjectError, match=rf"{info.relative_path}.*CRC-32C"):
        _load_one(checkpoint, _shards("w", shape, 0, 2, dtype, empty=True)[1])


# -- every kind of store -------------------------------------------------------------------


def test_tp4_quarters_on_every_store(checkpoint_uri: tuple[str, dict[str, Any]]) -> None:
    uri, options = checkpoint_uri
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    shape = (4096, 2048)  # bfloat16, 16 MiB: items of 8 MiB, quarters of 4 MiB
    _save_tp2(uri, {"w": (shape, 0, torch.bfloat16)}, options)
    full = reference("w", shape, torch.bfloat16)
    totals = []
    for recorded in (True, False):
        if not recorded:
            _strip_records(uri, options)
        total = 0
        for rank, sh in enumerate(_shards("w", shape, 0, 4, torch.bfloat16, empty=True)):
            loaded, stats = _counted(
                lambda sh=sh: cloudckpt.load(
                    {"w": sh},
                    uri,
                    storage_options=options,
                    validate_access_integrity=False,
                )
            )
            assert torch.equal(loaded["w"], full.chunk(4)[rank])
            total += stats.bytes_read
        totals.append(total)
    ranged, whole = totals
    # 4 quarters (+ CRC blocks) instead of 4 halves, plus the same metadata reads
    assert whole - ranged >= 4 * (4 * MiB - 2 * BLOCK), totals


def test_a_whole_load_reads_in_few_large_requests_on_every_store(
    checkpoint_uri: tuple[str, dict[str, Any]],
) -> None:
    """Loading many items of one object: local disks read each item's elements straight
    into its tensor; object stores fetch the items' ranges in merged runs of blocks (a
    part at most per GET), not one GET per item and two per item boundary."""
    uri, options = checkpoint_uri
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    shape = (1000, 1500)  # float32: items of 3 MB, 36 MB in one object
    specs = {f"w{i}": (shape, 0, torch.float32) for i in range(6)}
    _save_tp2(uri, specs, options)
    request = {
        f"{key}.{rank}": sh
        for key in specs
        for rank, sh in enumerate(_shards(key, shape, 0, 2, torch.float32, empty=True))
    }
    loaded, stats = _counted(
        lambda: cloudckpt.load(
            request, uri, storage_options=options, validate_access_integrity=False
        )
    )
    for key in specs:
        for rank in range(2):
            assert torch.equal(loaded[f"{key}.{rank}"], reference(key, shape).chunk(2)[rank])
    assert stats.bytes_read >= 12 * 500 * 1500 * 4
    if uri.startswith(("s3://", "gs://")):  # two 32 MiB runs, plus the metadata reads
        assert stats.reads <= 8, stats
