"""The coordinator's check that a torch_dist save's chunks tile their tensors on a grid
(cloudckpt.formats.dcp.grid.valid_chunks), against a
brute-force painting of every cell: it proves only exact tilings, proves every grid
(whole, evenly split and unevenly split dimensions, chunks in any order), and sorts
only the unevenly split dimensions."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloudckpt.formats.dcp import grid as _dcp_grid
from cloudckpt.formats.dcp.grid import GridChunks, valid_chunks
from cloudckpt.formats.dcp.plan import linear_global_columns

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_simulate as sim

from tests.test_dcp_plan import _local_plans
from tests.test_dcp_plan_sent_columns import _sent

Chunk = tuple[tuple[int, ...], tuple[int, ...]]
Tensor = tuple[tuple[int, ...], list[Chunk]]


def _checked(tensors: list[Tensor], check_fill: bool = True) -> bool:
    """``valid_chunks`` on tensors of one rank (dimensions), each (size, chunks)."""
    tids = [t for t, (_, chunks) in enumerate(tensors) for _ in chunks]
    off = [c[0] for _, chunks in tensors for c in chunks]
    sz = [c[1] for _, chunks in tensors for c in chunks]
    arrays = (np.array(a, dtype=np.int64) for a in (off, sz, [s for s, _ in tensors], tids))
    return valid_chunks(GridChunks.of_rows(*arrays), check_fill)


def _painted(tensors: list[Tensor]) -> bool:
    """Whether every tensor's chunks cover each of its elements exactly once."""
    for size, chunks in tensors:
        grid = np.zeros(size, dtype=np.int64)
        for offsets, sizes in chunks:
            if any(
                o < 0 or s < 0 or o + s > e for o, s, e in zip(offsets, sizes, size, strict=True)
            ):
                return False
            grid[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))] += 1
        if not (grid == 1).all():
            return False
    return True


def _cuts(extent: int, how: str, rng: random.Random) -> list[int]:
    if how == "whole" or extent == 1:
        return [0, extent]
    if how == "even":
        parts = rng.choice([p for p in range(1, extent + 1) if extent % p == 0])
        return list(range(0, extent + 1, extent // parts))
    inner = rng.sample(range(1, extent), rng.randrange(1, min(extent - 1, 4) + 1))
    return [0, *sorted(inner), extent]


def _grid(size: tuple[int, ...], hows: list[str], rng: random.Random) -> list[Chunk]:
    per_dim = [
        list(itertools.pairwise(_cuts(e, how, rng))) for e, how in zip(size, hows, strict=True)
    ]
    return [
        (tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
        for cell in itertools.product(*per_dim)
    ]


def _damaged(chunks: list[Chunk], rng: random.Random) -> list[Chunk]:
    chunks = list(chunks)
    i = rng.randrange(len(chunks))
    (o, s), d = chunks[i], rng.randrange(len(chunks[i][0]))
    how = rng.randrange(4)
    if how == 0:
        o = tuple(v + rng.choice([-1, 1]) if k == d else v for k, v in enumerate(o))
    elif how == 1:
        s = tuple(v + rng.choice([-1, 1]) if k == d else v for k, v in enumerate(s))
    if how == 2 and len(chunks) > 1:
        chunks.pop(i)
    elif how == 3:
        chunks.insert(rng.randrange(len(chunks) + 1), (o, s))
    else:
        chunks[i] = (o, s)
    return chunks


@pytest.fixture(params=[None, 2], ids=["blocks", "two-chunk-blocks"])
def rows(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks' passes in their own blocks, or in blocks of two chunks (every
    check then spans blocks)."""
    if request.param is not None:
        monkeypatch.setattr(_dcp_grid, "_ROWS", request.param)


@pytest.mark.parametrize("seed", range(300))
def test_grids_are_proven_and_nothing_else(seed: int, rows: None) -> None:
    rng = random.Random(seed)
    ndim = rng.randrange(1, 4)
    tensors: list[Tensor] = []
    damaged = False
    for _ in range(rng.randrange(1, 5)):
        size = tuple(rng.randrange(1, 9) for _ in range(ndim))
        chunks = _grid(size, [rng.choice(["whole", "even", "uneven"]) for _ in size], rng)
        rng.shuffle(chunks)
        if rng.random() < 0.4:
            chunks, damaged = _damaged(chunks, rng), True
        tensors.append((size, chunks))
    checked = _checked(tensors)
    assert not checked or _painted(tensors), tensors  # sound
    if not damaged:
        assert checked, tensors  # complete on grids


def _counting_sorts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = _dcp_grid._sorted_cells

    def spy(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(_dcp_grid, "_sorted_cells", spy)
    return calls


def test_only_uneven_splits_are_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    sorts = _counting_sorts(monkeypatch)
    size = (4, 1, 432)  # a TP-split flat tensor, as Megatron reformulates it
    tp_only = [((t, 0, 0), (1, 1, 432)) for t in range(4)]
    even = [((t, 0, lo), (1, 1, 144)) for lo in (0, 144, 288) for t in range(4)]
    uneven = [((t, 0, lo), (1, 1, hi - lo)) for lo, hi in ((0, 100), (100, 432)) for t in range(4)]
    assert _checked([(size, tp_only)]) and _checked([(size, even)])
    assert sorts == []
    assert _checked([(size, uneven)])  # a distributed optimizer's uneven flat shards
    assert sorts == [1]  # the last dimension only


def test_the_simulated_layouts_are_proven_without_a_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    sorts = _counting_sorts(monkeypatch)
    plans = _local_plans(sim.World(4, 2, 3, 24), 13)
    assert linear_global_columns(_sent(plans)) is not None
    assert sorts == []


def test_cells_are_numbered_within_each_tensor(rows: None) -> None:
    """Many tensors split in every dimension: the cells' numbers stay below the chunks'
    count (numbering them over all tensors at once would overflow int64 at scale)."""
    rng = random.Random(1)
    tensors = [((6, 6, 6), _grid((6, 6, 6), ["uneven"] * 3, rng)) for _ in range(300)]
    assert _checked(tensors)
    tensors[-1] = (tensors[-1][0], [*tensors[-1][1], tensors[-1][1][0]])  # one chunk twice
    assert not _checked(tensors, check_fill=False)


def test_sparse_grids_are_told_apart_by_sorting(rows: None) -> None:
    """One plan (no volume check): chunks on the diagonal of a grid of 1,600 cells, more
    than a count per cell is worth; a chunk twice is still found."""
    diagonal = [((i, i), (1, 1)) for i in range(40)]
    assert _checked([((40, 40), diagonal)], check_fill=False)
    assert not _checked([((40, 40), [*diagonal, diagonal[7]])], check_fill=False)
    assert not _checked([((40, 40), diagonal)])  # with the volume: a tenth covered


def test_offsets_past_int64_are_left_to_dcp(rows: None) -> None:
    """An offset near 2**63 (its sum with the size would wrap around) is not proven."""
    assert not _checked([((4,), [((2**63 - 1,), (2,)), ((0,), (4,))])], check_fill=False)


def test_cells_past_int64_over_all_tensors_are_left_to_dcp() -> None:
    """Four tensors of 2**61 cells each (two chunks of one element, one plan): numbered
    over all tensors the cells would pass int64, so the check leaves them to DCP."""
    size = (2**40, 2**21)
    chunks = [((0, 0), (1, 1)), ((2**39, 2**20), (1, 1))]
    assert _checked([(size, chunks)], check_fill=False)  # one: numbered in int64
    assert not _checked([(size, chunks)] * 4, check_fill=False)
