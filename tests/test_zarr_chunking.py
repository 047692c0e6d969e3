"""Shards larger than the chunk size are written as several zarr chunks.

Covers the pure chunk-shape rule (``split_chunk_shape``), single-process save/load
with split chunks (object counts, ``.zarray``, bit-exact and resharded reloads,
bfloat16, zarr-python interop, byte compatibility of unsplit shards) and a 4-rank
save/load of tensor-parallel and flattened optimizer shards.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pathlib
import zlib
from typing import Any

import numpy as np
import pytest
import torch
import zarr

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.formats.zarr.layout import ArrayMeta, shard_chunk_indices, split_chunk_shape
from cloudckpt.formats.zarr.reader import TensorReader, _direct_reads
from cloudckpt.launch import RankPool
from cloudckpt.storage import open_checkpoint
from cloudckpt.strategies.zarr import ZarrSaveShardedStrategy

# --- split_chunk_shape --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_shape", "itemsize", "max_bytes", "expected"),
    [
        pytest.param((4, 8), 4, 128, (4, 8), id="fits-exactly"),
        pytest.param((4, 8), 4, 10**9, (4, 8), id="fits"),
        pytest.param((12, 4), 4, 100, (6, 4), id="axis0-divisor"),
        pytest.param((7, 4), 4, 100, (1, 4), id="axis0-prime-d1"),
        pytest.param((2, 10), 4, 24, (1, 5), id="row-too-big-split-axis1"),
        pytest.param((1, 30), 2, 20, (1, 10), id="one-row-split-axis1"),
        pytest.param((100,), 4, 64, (10,), id="1d"),
        pytest.param((1000, 1000), 4, None, (1000, 1000), id="none"),
        pytest.param((), 4, 1, (), id="0d"),
        pytest.param((0, 5), 4, 1, (0, 5), id="empty"),
        pytest.param((8, 6), 2, 40, (2, 6), id="itemsize2"),
        pytest.param((1, 6, 4), 4, 40, (1, 2, 4), id="prepended-axis"),
        pytest.param((3, 5, 7), 8, 100, (1, 1, 7), id="3d-inner-axis"),
        pytest.param((3,), 4, 2, (1,), id="below-itemsize"),
    ],
)
def test_split_chunk_shape_table(
    local_shape: tuple[int, ...],
    itemsize: int,
    max_bytes: int | None,
    expected: tuple[int, ...],
) -> None:
    assert split_chunk_shape(local_shape, itemsize, max_bytes) == expected


def test_split_chunk_shape_invariants_brute_force() -> None:
    """Divides the shard, fits the limit, and is (1, ..., 1, d, full, ..., full)."""
    for shape in itertools.product([1, 2, 6, 7, 12], [1, 3, 10], [1, 4, 5]):
        for itemsize, max_bytes in itertools.product([1, 2, 4], [4, 7, 16, 50, 10**6]):
            chunks = split_chunk_shape(shape, itemsize, max_bytes)
            assert all(n % c == 0 for n, c in zip(shape, chunks, strict=True))
            assert math.prod(chunks) * itemsize <= max_bytes
            cut = [i for i, (n, c) in enumerate(zip(shape, chunks, strict=True)) if n != c]
            if cut:
                split = cut[-1]
                assert all(c == 1 for c in chunks[:split])
                assert chunks[split + 1 :] == shape[split + 1 :]
                # largest: one more row of the split axis's next divisor would not fit
                bigger = [
                    d for d in range(chunks[split] + 1, shape[split] + 1) if shape[split] % d == 0
                ]
                inner = math.prod(shape[split + 1 :]) * itemsize
                assert not bigger or bigger[0] * inner > max_bytes


def test_split_chunk_shape_rejects_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        split_chunk_shape((4,), 4, 0)
    with pytest.raises(ValueError, match="chunk_size"):
        ZarrSaveShardedStrategy("zarr", 1, chunk_size=0)


def test_shard_chunk_indices_follow_shard_bytes() -> None:
    assert shard_chunk_indices((1, 2), (4, 6), (2, 3)) == [(2, 4), (2, 5), (3, 4), (3, 5)]
    assert shard_chunk_indices((3,), (5,), (5,)) == [(3,)]
    assert shard_chunk_indices((), (), ()) == [()]
    assert shard_chunk_indices((0, 1), (6, 4), (2, 4)) == [(0, 1), (1, 1), (2, 1)]


def test_default_chunk_size_is_the_config_value() -> None:
    assert ZarrSaveShardedStrategy().chunk_size == 256 * 2**20
    assert ZarrSaveShardedStrategy("zarr", 1, chunk_size=None).chunk_size is None


# --- single process -----------------------------------------------------------------------


def _ref(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


def _strategy(chunk_size: int | None) -> ZarrSaveShardedStrategy:
    return ZarrSaveShardedStrategy("zarr", 1, chunk_size=chunk_size)


def _objects(uri: str, key: str) -> list[str]:
    return sorted(os.listdir(os.path.join(uri, key)))


def _zarray(uri: str, key: str) -> dict[str, Any]:
    return json.loads(pathlib.Path(uri, key, ".zarray").read_text())


def _load(request: dict[str, Any], uri: str) -> dict[str, Any]:
    result = cloudckpt.load(request, uri, validate_access_integrity=False)
    assert isinstance(result, dict)
    return result


@pytest.fixture
def split_ckpt(tmp_path: pathlib.Path) -> tuple[str, torch.Tensor]:
    """(12, 10) float32 in two (6, 10) shards of 240 bytes; chunk_size 80 -> (2, 10) chunks."""
    full = _ref("w", (12, 10))
    shards = [
        ShardedTensor.from_rank_offsets("w", full[6 * i : 6 * i + 6].clone(), (0, i, 2))
        for i in range(2)
    ]
    uri = str(tmp_path / "ck")
    cloudckpt.save({"w": shards}, uri, sharded_strategy=_strategy(80))
    return uri, full


def test_split_shards_write_chunk_objects(split_ckpt: tuple[str, torch.Tensor]) -> None:
    uri, full = split_ckpt
    assert _objects(uri, "w") == [".zarray", *(f"{i}.0" for i in range(6))]
    zarray = _zarray(uri, "w")
    assert zarray["chunks"] == [2, 10] and zarray["shape"] == [12, 10]
    assert zarray["dtype"] == "<f4" and zarray["compressor"] is None
    for i in range(6):  # every chunk is the C-order bytes of its two rows
        raw = pathlib.Path(uri, "w", f"{i}.0").read_bytes()
        assert raw == full[2 * i : 2 * i + 2].numpy().tobytes()


def test_split_shards_reload_bit_exact_and_resharded(split_ckpt: tuple[str, torch.Tensor]) -> None:
    uri, full = split_ckpt
    whole = _load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(12, 10))}, uri)
    assert torch.equal(whole["w"], full)
    for i in range(3):  # (4, 10) shards: each spans chunk boundaries and the old shards
        part = _load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 10), (0, i, 3))}, uri
        )
        assert torch.equal(part["w"], full[4 * i : 4 * i + 4])
    tile = ShardedTensor.from_rank_offsets("w", torch.empty(3, 5), (0, 2, 4), (1, 1, 2))
    assert torch.equal(_load({"w": tile}, uri)["w"], full[6:9, 5:10])
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", torch.empty(47), (6, 10), (0, 1, 2), flattened_range=slice(3, 50)
    )
    assert torch.equal(_load({"w": flat}, uri)["w"], full[6:12].reshape(-1)[3:50])


def test_split_shards_metadata_reports_global_shape(split_ckpt: tuple[str, torch.Tensor]) -> None:
    uri, _ = split_ckpt
    for metadata in (cloudckpt.load_tensors_metadata(uri), cloudckpt.load_sharded_metadata(uri)):
        sh = metadata["w"]
        assert isinstance(sh, ShardedTensor)
        assert tuple(sh.global_shape) == (12, 10) and sh.dtype == torch.float32
    assert torch.equal(cloudckpt.load_plain_tensors(uri)["w"], split_ckpt[1])


@pytest.mark.parametrize("chunk_size", [4, 12, 40, 100, 1000])
def test_every_request_layout_reads_back_exact(tmp_path: pathlib.Path, chunk_size: int) -> None:
    """A 3-D tensor saved as (2, 6, 4) shards, read back as every regular grid and flat ranges."""
    full = _ref("t", (4, 6, 4))
    shards = [
        ShardedTensor.from_rank_offsets("t", full[2 * i : 2 * i + 2].clone(), (0, i, 2))
        for i in range(2)
    ]
    uri = str(tmp_path / "ck")
    cloudckpt.save({"t": shards}, uri, sharded_strategy=_strategy(chunk_size))
    for grid in itertools.product([1, 2, 4], [1, 2, 3, 6], [1, 2, 4]):
        local = tuple(n // g for n, g in zip(full.shape, grid, strict=True))
        cells = list(itertools.product(*(range(g) for g in grid)))
        request = {  # every cell of the grid in one load
            str(cell): ShardedTensor.from_rank_offsets(
                "t",
                torch.empty(local),
                *((axis, i, g) for axis, (i, g) in enumerate(zip(cell, grid, strict=True))),
            )
            for cell in cells
        }
        loaded = _load(request, uri)
        for cell in cells:
            box = tuple(slice(i * n, (i + 1) * n) for i, n in zip(cell, local, strict=True))
            assert torch.equal(loaded[str(cell)], full[box]), (grid, cell)
    for start, stop in [(0, 48), (5, 29), (17, 18), (40, 48)]:
        flat = ShardedTensor.from_rank_offsets_flat(
            "t", torch.empty(stop - start), (2, 6, 4), (0, 1, 2), flattened_range=slice(start, stop)
        )
        assert torch.equal(_load({"t": flat}, uri)["t"], full[2:].reshape(-1)[start:stop])


def test_split_chunks_read_directly_into_result(split_ckpt: tuple[str, torch.Tensor]) -> None:
    """Whole shards and axis-0 reshards of (d, full) chunks skip the staging copy."""
    uri, _ = split_ckpt
    meta = TensorReader(open_checkpoint(uri)).metas(["w"])["w"]
    shard = ShardedTensor.from_rank_offsets("w", torch.empty(6, 10), (0, 1, 2))
    reads = _direct_reads(shard, meta)
    assert reads is not None
    assert [(r.request.path, r.request.start, r.request.end) for r in reads] == [
        (f"w/{i}.0", 0, 80) for i in (3, 4, 5)
    ]
    reshard = ShardedTensor.from_rank_offsets("w", torch.empty(4, 10), (0, 1, 3))
    reads = _direct_reads(reshard, meta)
    assert reads is not None and [r.request.path for r in reads] == ["w/2.0", "w/3.0"]
    tile = ShardedTensor.from_rank_offsets("w", torch.empty(6, 5), (0, 0, 2), (1, 0, 2))
    assert _direct_reads(tile, meta) is None  # columns of a chunk: the staged path


def test_bfloat16_row_split_along_axis_1(tmp_path: pathlib.Path) -> None:
    """A (1, 30) bfloat16 shard of 60 bytes with chunk_size 20 -> three (1, 10) chunks."""
    full = _ref("emb", (1, 30), torch.bfloat16)
    uri = str(tmp_path / "ck")
    sh = ShardedTensor.from_rank_offsets("emb", full.clone())
    cloudckpt.save({"emb": sh}, uri, sharded_strategy=_strategy(20))
    assert _objects(uri, "emb") == [".zarray", "0.0", "0.1", "0.2"]
    zarray = _zarray(uri, "emb")
    assert zarray["chunks"] == [1, 10] and zarray["dtype"] == "bfloat16"
    assert pathlib.Path(uri, "emb", "0.1").read_bytes() == (
        full[:, 10:20].contiguous().view(torch.int16).numpy().tobytes()
    )
    whole = _load({"emb": ShardedTensor.from_rank_offsets("emb", torch.empty_like(full))}, uri)
    assert torch.equal(whole["emb"], full)
    for i in range(2):  # (1, 15) halves straddle the middle chunk
        half = ShardedTensor.from_rank_offsets(
            "emb", torch.empty(1, 15, dtype=torch.bfloat16), (1, i, 2)
        )
        assert torch.equal(_load({"emb": half}, uri)["emb"], full[:, 15 * i : 15 * i + 15])


def test_flattened_shards_split_on_one_process(tmp_path: pathlib.Path) -> None:
    """Flat pieces assembled into an (8, 6) shard of 192 bytes; chunk_size 48 -> (2, 6)."""
    full = _ref("exp_avg", (8, 6))
    bounds = [0, 20, 48]
    pieces = [
        ShardedTensor.from_rank_offsets_flat(
            "exp_avg", full.reshape(-1)[a:b].clone(), (8, 6), flattened_range=slice(a, b)
        )
        for a, b in itertools.pairwise(bounds)
    ]
    uri = str(tmp_path / "ck")
    cloudckpt.save({"exp_avg": pieces}, uri, sharded_strategy=_strategy(48))
    assert _objects(uri, "exp_avg") == [".zarray", "0.0", "1.0", "2.0", "3.0"]
    assert _zarray(uri, "exp_avg")["chunks"] == [2, 6]
    flat = ShardedTensor.from_rank_offsets_flat(
        "exp_avg", torch.empty(25), (8, 6), flattened_range=slice(5, 30)
    )
    assert torch.equal(_load({"exp_avg": flat}, uri)["exp_avg"], full.reshape(-1)[5:30])
    assert torch.equal(cloudckpt.load_plain_tensors(uri)["exp_avg"], full)


def test_split_float32_array_opens_in_zarr_python(split_ckpt: tuple[str, torch.Tensor]) -> None:
    uri, full = split_ckpt
    array = zarr.open_array(store=os.path.join(uri, "w"), mode="r", zarr_format=2)
    assert array.shape == (12, 10) and array.chunks == (2, 10)
    np.testing.assert_array_equal(array[:], full.numpy())
    np.testing.assert_array_equal(array[3:7, 2:9], full[3:7, 2:9].numpy())


def _tree(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parent != root  # tensor arrays only (common.pt embeds times)
    }


def test_shards_under_the_chunk_size_are_byte_identical(tmp_path: pathlib.Path) -> None:
    full = _ref("w", (6, 8))
    state = {
        "w": [
            ShardedTensor.from_rank_offsets("w", full[3 * i : 3 * i + 3].clone(), (0, i, 2))
            for i in range(2)
        ],
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(2.5)),
        "e": ShardedTensor.from_rank_offsets("e", torch.empty(0, 4)),
    }
    for name, strategy in [
        ("unsplit", _strategy(None)),
        ("default", ("zarr", 1)),
        ("tiny", _strategy(1)),
    ]:
        cloudckpt.save(state, str(tmp_path / name), sharded_strategy=strategy)
    unsplit = _tree(tmp_path / "unsplit")
    assert sorted(unsplit) == [
        "e/.zarray",
        "e/0.0",
        "s/.zarray",
        "s/0",
        "w/.zarray",
        "w/0.0",
        "w/1.0",
    ]
    assert _tree(tmp_path / "default") == unsplit
    tiny = _tree(tmp_path / "tiny")  # 0-d and empty arrays are never split
    assert {k: v for k, v in tiny.items() if not k.startswith("w/")} == {
        k: v for k, v in unsplit.items() if not k.startswith("w/")
    }
    assert json.loads(tiny["w/.zarray"])["chunks"] == [1, 1]
    assert len([k for k in tiny if k.startswith("w/")]) == 1 + 48


# --- four ranks ---------------------------------------------------------------------------

# key -> (global shape, tensor-parallel axis); local (8, 6) / (6, 8) float32 = 192 bytes
TP_KEYS = {"w_col": ((16, 6), 0), "w_row": ((6, 16), 1)}
CHUNK = 50  # bytes: splits every shard of this section into several chunks


def _tp_state(rank: int, tp: int) -> dict[str, ShardedTensor]:
    tp_rank, dp_rank = rank % tp, rank // tp
    state = {}
    for key, (shape, axis) in TP_KEYS.items():
        local = _ref(key, shape).chunk(tp, dim=axis)[tp_rank].clone()
        state[key] = ShardedTensor.from_rank_offsets(
            key, local, (axis, tp_rank, tp), replica_id=dp_rank
        )
    return state


def _flat_state(rank: int, tp: int, bounds: list[int], full: torch.Tensor) -> ShardedTensor:
    """``rank``'s distributed-optimizer piece: a flat range of its TP shard of ``full``."""
    tp_rank, dp_rank = rank % tp, rank // tp
    local = full.chunk(tp, dim=0)[tp_rank]
    rng = slice(bounds[dp_rank], bounds[dp_rank + 1])
    return ShardedTensor.from_rank_offsets_flat(
        "exp_avg",
        local.reshape(-1)[rng].clone(),
        tuple(local.shape),
        (0, tp_rank, tp),
        flattened_range=rng,
    )


def _chunked_scenario(rank: int, world: int, uri: str) -> int:
    exp_avg = _ref("exp_avg", (12, 5))  # TP shards (6, 5) = 120 bytes -> (2, 5) chunks
    state: dict[str, Any] = {
        **_tp_state(rank, tp=2),
        "exp_avg": _flat_state(rank, 2, [0, 13, 30], exp_avg),
    }
    cloudckpt.save(state, uri, sharded_strategy=ZarrSaveShardedStrategy(chunk_size=CHUNK))
    checked = 0
    for tp in (4, 1):
        loaded = _load(_tp_state(rank, tp), uri)
        for key, (shape, axis) in TP_KEYS.items():
            assert torch.equal(loaded[key], _ref(key, shape).chunk(tp, dim=axis)[rank % tp])
            checked += 1
    bounds = [0, 7, 30, 41, 60]  # one TP shard, flat ranges over 4 ranks
    request = ShardedTensor.from_rank_offsets_flat(
        "exp_avg",
        torch.empty(bounds[rank + 1] - bounds[rank]),
        (12, 5),
        flattened_range=slice(bounds[rank], bounds[rank + 1]),
    )
    loaded = cloudckpt.load({"exp_avg": request}, uri)
    assert torch.equal(loaded["exp_avg"], exp_avg.reshape(-1)[bounds[rank] : bounds[rank + 1]])
    row, col = divmod(rank, 2)  # 2 x 2 tiles of w_row (6, 16): (3, 8) each
    tile = ShardedTensor.from_rank_offsets("w_row", torch.empty(3, 8), (0, row, 2), (1, col, 2))
    expected = _ref("w_row", (6, 16))[3 * row : 3 * row + 3, 8 * col : 8 * col + 8]
    assert torch.equal(_load({"tile": tile}, uri)["tile"], expected)
    return checked + 2


def test_four_ranks_split_tp_and_flattened_shards(
    rank_pool: RankPool, tmp_path: pathlib.Path
) -> None:
    uri = str(tmp_path / "ck")
    assert rank_pool.run(_chunked_scenario, uri) == [6] * 4
    assert _zarray(uri, "w_col")["chunks"] == [2, 6]  # (8, 6) shards -> 4 chunks each
    assert _objects(uri, "w_col") == [".zarray", *(f"{i}.0" for i in range(8))]
    assert _zarray(uri, "w_row")["chunks"] == [1, 8]  # (6, 8) shards -> 6 chunks each
    assert _objects(uri, "w_row") == [".zarray", *(f"{i}.{j}" for i in range(6) for j in range(2))]
    assert _zarray(uri, "exp_avg")["chunks"] == [2, 5]  # (6, 5) shards -> 3 chunks each
    assert _objects(uri, "exp_avg") == [".zarray", *(f"{i}.0" for i in range(6))]
    meta = ArrayMeta.from_json(pathlib.Path(uri, "exp_avg", ".zarray").read_bytes())
    assert meta.grid == (6, 1) and meta.chunk_nbytes == 40
    plain = cloudckpt.load_plain_tensors(uri)
    assert torch.equal(plain["exp_avg"], _ref("exp_avg", (12, 5)))
    for key, (shape, _) in TP_KEYS.items():
        assert torch.equal(plain[key], _ref(key, shape))
