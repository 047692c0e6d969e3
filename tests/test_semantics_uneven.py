"""Uneven sharding and dtype casts on load, with 4 real gloo
ranks.

Uneven sharding - shards of one tensor with different local shapes, no regular grid
(``axis_fragmentations=None``) - is valid in Megatron-Core with torch_dist: cloudckpt
saves and loads it there (resharding both ways), refuses it for zarr (one chunk shape per
array) naming the key, the ranks and the way out, and still refuses overlaps and gaps.
Loading a tensor as another dtype than stored casts, as Megatron-Core's torch_dist load
(DCP copying into the requested tensor) does.
"""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.errors import ShardingValidationError
from cloudckpt.validation import validate_sharding_integrity
from tests.test_multirank import reference

ROWS = [3, 1, 2, 2]  # uneven rows of an (8, 4) matrix and of an (8,) vector over 4 ranks
OTHER_ROWS = [1, 4, 1, 2]


def _uneven(
    key: str,
    full: torch.Tensor,
    rows: list[int],
    rank: int,
    empty: bool = False,
    dtype: torch.dtype | None = None,
) -> ShardedTensor:
    """Rank ``rank``'s rows of ``full`` (rows split as ``rows``), built as Megatron-Core
    builds uneven shards: no grid (``axis_fragmentations=None``)."""
    start = sum(rows[:rank])
    local = full[start : start + rows[rank]].clone()
    if dtype is not None:
        local = local.to(dtype)
    if empty:
        local = torch.empty_like(local)
    return ShardedTensor(
        key,
        local,
        local.dtype,
        tuple(local.shape),
        tuple(full.shape),
        (start,) + (0,) * (full.dim() - 1),
        None,
    )


def _state(
    rank: int, rows: list[int], empty: bool = False, dtype: torch.dtype | None = None
) -> dict:
    return {
        "m": _uneven("m", reference("m", (8, 4)), rows, rank, empty, dtype),
        "v": _uneven("v", reference("v", (8,)), rows, rank, empty, dtype),
    }


def _uneven_scenario(rank: int, world: int, uri: str) -> int:
    cloudckpt.save(_state(rank, ROWS), uri, sharded_strategy=("torch_dist", 1))
    checked = 0
    for rows in (ROWS, OTHER_ROWS):  # the same and another uneven layout
        loaded = cloudckpt.load(_state(rank, rows, empty=True), uri)
        for key, shape in (("m", (8, 4)), ("v", (8,))):
            expected = _uneven(key, reference(key, shape), rows, rank).data
            assert torch.equal(loaded[key], expected), (key, rows, rank)
            checked += 1
    # a regular grid (2 x 2 tiles of m) from the uneven save
    row, col = divmod(rank, 2)
    tile = ShardedTensor.from_rank_offsets("m", torch.empty(4, 2), (0, row, 2), (1, col, 2))
    loaded = cloudckpt.load({"tile": tile}, uri)
    assert torch.equal(
        loaded["tile"], reference("m", (8, 4))[4 * row : 4 * row + 4, 2 * col : 2 * col + 2]
    )
    return checked + 1


def _regular_to_uneven_scenario(rank: int, world: int, uri: str) -> int:
    m = ShardedTensor.from_rank_offsets(
        "m", reference("m", (8, 4)).chunk(4)[rank].clone(), (0, rank, 4)
    )
    cloudckpt.save({"m": m}, uri)  # torch_dist, the default
    loaded = cloudckpt.load({"m": _uneven("m", reference("m", (8, 4)), ROWS, rank, True)}, uri)
    assert torch.equal(loaded["m"], _uneven("m", reference("m", (8, 4)), ROWS, rank).data)
    return 1


def test_uneven_sharding_saves_and_reshards_with_torch_dist(rank_pool, tmp_path):
    assert rank_pool.run(_uneven_scenario, str(tmp_path / "uneven")) == [5] * 4
    assert rank_pool.run(_regular_to_uneven_scenario, str(tmp_path / "regular")) == [1] * 4


def _zarr_refuses_uneven(rank: int, world: int, uri: str) -> tuple[str, str, list[str]]:
    try:
        cloudckpt.save(_state(rank, ROWS), uri, sharded_strategy=("zarr", 1))
    except ShardingValidationError as exc:
        return type(exc).__name__, str(exc), list(exc.violations)
    return "saved", "", []


def test_zarr_refuses_uneven_sharding_clearly(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    for kind, message, violations in rank_pool.run(_zarr_refuses_uneven, uri):
        assert kind == "ShardingValidationError" and len(violations) == 2
        for key, rows in (("m", ((3, 4), (1, 4), (2, 4))), ("v", ((3,), (1,), (2,)))):
            (violation,) = [v for v in violations if f"tensor {key!r}" in v]
            assert "uneven sharding" in violation and "zarr backend" in violation
            assert "regular grid" in violation and "torch_dist" in violation
            assert f"{rows[0]} on ranks 0" in violation and f"{rows[1]} on ranks 1" in violation
            assert f"{rows[2]} on ranks 2, 3" in violation
        assert uri in message
    assert not cloudckpt.check_is_distributed_checkpoint(uri)


def _cast_scenario(rank: int, world: int, uri: str) -> int:
    cloudckpt.save(_state(rank, ROWS), uri, sharded_strategy=("torch_dist", 1))  # float32
    checked = 0
    for dtype in (torch.bfloat16, torch.float64, torch.float16):
        loaded = cloudckpt.load(_state(rank, OTHER_ROWS, empty=True, dtype=dtype), uri)
        for key, shape in (("m", (8, 4)), ("v", (8,))):
            expected = _uneven(key, reference(key, shape), OTHER_ROWS, rank).data.to(dtype)
            assert loaded[key].dtype == dtype and torch.equal(loaded[key], expected)
            checked += 1
    return checked


def test_loading_as_another_dtype_casts_like_torch_dist(rank_pool, tmp_path):
    assert rank_pool.run(_cast_scenario, str(tmp_path / "ckpt")) == [6] * 4


def test_cast_of_flattened_and_plain_tensors_in_one_process(tmp_path):
    uri = str(tmp_path / "ckpt")
    full = reference("w", (4, 6)).to(torch.bfloat16)
    flat = ShardedTensor.from_rank_offsets_flat(
        "f", full.reshape(-1)[5:17].clone(), (4, 6), flattened_range=slice(5, 17)
    )
    rest = [
        ShardedTensor.from_rank_offsets_flat(
            "f", full.reshape(-1)[a:b].clone(), (4, 6), flattened_range=slice(a, b), replica_id=0
        )
        for a, b in ((0, 5), (17, 24))
    ]
    state = {"w": ShardedTensor.from_rank_offsets("w", full.clone()), "f": [flat, *rest]}
    cloudckpt.save(state, uri)
    loaded = cloudckpt.load(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, dtype=torch.float32)),
            "f": ShardedTensor.from_rank_offsets("f", torch.empty(4, 6, dtype=torch.float64)),
        },
        uri,
    )
    assert loaded["w"].dtype == torch.float32 and torch.equal(loaded["w"], full.float())
    assert loaded["f"].dtype == torch.float64 and torch.equal(loaded["f"], full.double())


# -- validation alone (all ranks' shards given by hand) -----------------------------------


def _box(
    key: str,
    local: tuple[int, ...],
    offset: tuple[int, ...],
    glob: tuple[int, ...],
    replica: int = 0,
) -> ShardedTensor:
    return ShardedTensor(key, None, torch.float32, local, glob, offset, None, replica)


def test_uneven_validation_accepts_tilings_and_rejects_overlaps_and_gaps():
    tiling = [
        [_box("t", (3, 4), (0, 0), (5, 6))],
        [_box("t", (3, 2), (0, 4), (5, 6))],
        [_box("t", (2, 6), (3, 0), (5, 6))],
        [_box("t", (2, 6), (3, 0), (5, 6), replica=1)],
    ]  # a non-main copy
    validate_sharding_integrity(tiling, "s3://b/ckpt")
    overlap = [
        [_box("t", (3,), (0,), (6,))],
        [_box("t", (2,), (2,), (6,))],
        [_box("t", (2,), (4,), (6,))],
    ]
    with pytest.raises(ShardingValidationError) as info:
        validate_sharding_integrity(overlap, "s3://b/ckpt")
    (violation,) = info.value.violations
    assert "1 pair(s) of main replicas overlap" in violation
    assert "rank 0 at offset (0,)" in violation and "rank 1 at offset (2,)" in violation
    gap = [[_box("t", (3,), (0,), (7,))], [_box("t", (2,), (4,), (7,))]]
    with pytest.raises(ShardingValidationError, match=r"2 of 7 element\(s\) have no main replica"):
        validate_sharding_integrity(gap)


def test_uneven_shards_must_not_declare_a_grid_nor_be_flattened():
    declared = [
        [ShardedTensor.from_rank_offsets("g", torch.empty(3), (0, 0, 2))],
        [_box("g", (3,), (3,), (6,))],
        [_box("g", (0,), (6,), (6,))],
    ]
    with pytest.raises(ShardingValidationError, match="local_shape differs across shards") as info:
        validate_sharding_integrity(declared)
    assert "axis_fragmentations" in str(info.value) and "ranks 0 declare" in str(info.value)
    flat = [
        [
            ShardedTensor(
                "f", None, torch.float32, (4,), (6,), (0,), None, flattened_range=slice(0, 4)
            )
        ],
        [
            ShardedTensor(
                "f", None, torch.float32, (2,), (6,), (4,), None, flattened_range=slice(0, 2)
            )
        ],
    ]
    with pytest.raises(ShardingValidationError, match="flattened shards"):
        validate_sharding_integrity(flat)
