"""Tests for cloudckpt.mapping: ShardedTensor, ShardedObject, factories and helpers."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from cloudckpt.errors import CheckpointingException, ShardingValidationError
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)

GLOBAL = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def _shards_2x3() -> list[ShardedTensor]:
    """GLOBAL cut into a 2 x 3 grid of (2, 2) shards, one per rank."""
    return [
        ShardedTensor.from_rank_offsets(
            "w", GLOBAL[2 * i : 2 * i + 2, 2 * j : 2 * j + 2].clone(), (0, i, 2), (1, j, 3)
        )
        for i in range(2)
        for j in range(3)
    ]


def _valid_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "key": "layer.w",
        "data": torch.zeros(2, 3),
        "dtype": torch.float32,
        "local_shape": (2, 3),
        "global_shape": (4, 3),
        "global_offset": (2, 0),
        "axis_fragmentations": (2, 1),
    }
    kwargs.update(overrides)
    return kwargs


def _flat_kwargs(**overrides: Any) -> dict[str, Any]:
    return _valid_kwargs(**{"data": torch.zeros(3), "flattened_range": slice(1, 4), **overrides})


# ---------------------------------------------------------------- construction


def test_from_rank_offsets_fills_global_metadata() -> None:
    st = _shards_2x3()[5]  # i=1, j=2
    assert st.key == "w"
    assert st.dtype == torch.float32
    assert st.local_shape == (2, 2)
    assert st.global_shape == (4, 6)
    assert st.global_offset == (2, 4)
    assert st.axis_fragmentations == (2, 3)
    assert st.replica_id == 0 and st.prepend_axis_num == 0 and st.flattened_range is None


def test_from_rank_offsets_passes_replica_id_and_init_kwargs() -> None:
    st = ShardedTensor.from_rank_offsets(
        "k", torch.zeros(2), (0, 1, 2), replica_id=(0, 3), allow_shape_mismatch=True
    )
    assert st.replica_id == (0, 3)
    assert st.allow_shape_mismatch is True
    assert st.global_shape == (4,) and st.global_offset == (2,)


def test_from_rank_offsets_unsplit_axes_are_whole() -> None:
    st = ShardedTensor.from_rank_offsets("k", torch.zeros(3, 5))
    assert st.global_shape == (3, 5)
    assert st.global_offset == (0, 0)
    assert st.axis_fragmentations == (1, 1)


def test_from_rank_offsets_with_prepended_axis() -> None:
    st = ShardedTensor.from_rank_offsets(
        "k", torch.zeros(2, 3), (0, 3, 4), (2, 1, 2), prepend_axis_num=1
    )
    assert st.global_shape == (4, 2, 6)
    assert st.global_offset == (3, 0, 3)
    assert st.axis_fragmentations == (4, 1, 2)


@pytest.mark.parametrize(
    ("rank_offsets", "match"),
    [
        (((2, 0, 1),), "axis 2 is outside"),
        (((-1, 0, 1),), "axis -1 is outside"),
        (((0, 0, 2), (0, 1, 2)), "more than once"),
        (((0, 0, 0),), "fragmentation 0 must be positive"),
        (((0, 2, 2),), r"rank offset 2 is outside \[0, 2\)"),
        (((0, -1, 2),), "rank offset -1 is outside"),
        (((0, 1),), "not an .* triple"),
        ((("a", 0, 1),), "not an .* triple"),
    ],
)
def test_from_rank_offsets_rejects_bad_offsets(rank_offsets: Any, match: str) -> None:
    with pytest.raises(ShardingValidationError, match=match) as info:
        ShardedTensor.from_rank_offsets("my.key", torch.zeros(2, 3), *rank_offsets)
    assert "my.key" in str(info.value)


def test_from_rank_offsets_rejects_flattened_range() -> None:
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat") as info:
        ShardedTensor.from_rank_offsets("my.key", torch.zeros(4), flattened_range=slice(0, 2))
    assert "my.key" in str(info.value)


def test_constructor_normalises_shapes_to_int_tuples() -> None:
    st = ShardedTensor(
        **_valid_kwargs(
            local_shape=[2, 3],
            global_shape=torch.Size([4, 3]),
            global_offset=[2, 0],
            axis_fragmentations=[2, 1],
        )
    )
    assert st.local_shape == (2, 3) and type(st.local_shape) is tuple
    assert st.global_shape == (4, 3) and st.axis_fragmentations == (2, 1)


# ---------------------------------------------------------------- validate_metadata_integrity


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dtype": torch.float16}, "data dtype"),
        ({"data": torch.zeros(3, 2)}, "data shape"),
        ({"global_shape": (4, 3, 1), "global_offset": (2, 0, 0)}, "does not fit global_shape"),
        ({"prepend_axis_num": 1}, "does not fit global_shape"),
        (
            {
                "prepend_axis_num": -1,
                "global_shape": (4,),
                "global_offset": (2,),
                "axis_fragmentations": None,
            },
            "does not fit",
        ),
        ({"global_offset": (2, 0, 0)}, "global_offset .* rank"),
        ({"axis_fragmentations": (2,)}, "axis_fragmentations .* rank"),
        ({"axis_fragmentations": (2, 0)}, "must be positive"),
        ({"global_offset": (3, 0)}, "axis 0: offset 3 \\+ local extent 2 exceeds"),
        ({"global_shape": (4, 2)}, "axis 1: offset 0 \\+ local extent 3 exceeds"),
        ({"global_offset": (-2, 0)}, "negative"),
    ],
)
def test_validate_rejects_inconsistent_metadata(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ShardingValidationError, match=match) as info:
        ShardedTensor(**_valid_kwargs(**overrides))
    assert "layer.w" in str(info.value)
    assert isinstance(info.value, CheckpointingException) and isinstance(info.value, ValueError)
    assert info.value.violations


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"data": torch.zeros(1, 3)}, "1-D of length 3"),
        ({"data": torch.zeros(4)}, "1-D of length 3"),
        ({"flattened_range": slice(4, 7), "data": torch.zeros(3)}, "outside the 6 local"),
        ({"flattened_range": slice(-1, 2), "data": torch.zeros(3)}, "outside the 6 local"),
        ({"flattened_range": slice(3, 1), "data": None}, "outside the 6 local"),
        ({"flattened_range": slice(0, 6, 2), "data": torch.zeros(3)}, "step 2"),
        ({"flattened_range": slice(None, 3), "data": torch.zeros(3)}, "integer start and stop"),
    ],
)
def test_validate_rejects_bad_flat_shards(overrides: dict[str, Any], match: str) -> None:
    kwargs = _flat_kwargs()
    kwargs.update(overrides)
    with pytest.raises(ShardingValidationError, match=match) as info:
        ShardedTensor(**kwargs)
    assert "layer.w" in str(info.value)


def test_validate_accepts_valid_metadata_and_step_one() -> None:
    ShardedTensor(**_valid_kwargs())
    ShardedTensor(**_valid_kwargs(data=None))
    ShardedTensor(**_flat_kwargs(flattened_range=slice(1, 4, 1)))
    ShardedTensor(**_valid_kwargs(axis_fragmentations=None))


def test_validate_allow_shape_mismatch_lifts_bounds_check() -> None:
    st = ShardedTensor(**_valid_kwargs(global_offset=(3, 0), allow_shape_mismatch=True))
    assert st.global_offset == (3, 0)


def test_validate_reports_all_violations_at_once() -> None:
    with pytest.raises(ShardingValidationError) as info:
        ShardedTensor(**_valid_kwargs(dtype=torch.int64, global_offset=(3, 0)))
    assert len(info.value.violations) == 2
    assert "data dtype" in str(info.value) and "exceeds" in str(info.value)


def test_validate_catches_later_mutation() -> None:
    st = ShardedTensor(**_valid_kwargs())
    st.data = torch.zeros(5)
    with pytest.raises(ShardingValidationError, match="data shape"):
        st.validate_metadata_integrity()


# ---------------------------------------------------------------- geometry


def test_has_regular_grid() -> None:
    assert ShardedTensor(**_valid_kwargs()).has_regular_grid is True
    assert ShardedTensor(**_valid_kwargs(axis_fragmentations=None)).has_regular_grid is False


def test_global_slice_selects_local_data_from_global_tensor() -> None:
    shards = _shards_2x3()
    for st in shards:
        assert torch.equal(GLOBAL[st.global_slice()], st.data)
    assert shards[4].global_slice() == (slice(2, 4), slice(2, 4))


def test_global_slice_uses_ints_for_prepended_axes() -> None:
    stacked = torch.arange(3 * 4 * 6).reshape(3, 4, 6)
    local = stacked[2, :, 3:6]
    st = ShardedTensor.from_rank_offsets(
        "k", local.clone(), (0, 2, 3), (2, 1, 2), prepend_axis_num=1
    )
    assert st.global_slice() == (2, slice(0, 4), slice(3, 6))
    assert torch.equal(stacked[st.global_slice()], local)


@pytest.mark.parametrize("rng", [slice(0, 4), slice(2, 5), slice(3, 4), slice(5, 6)])
def test_flat_coordinates_index_local_and_global_tensors(rng: slice) -> None:
    local = GLOBAL[2:4, 3:6]  # rank (1, 1) of a 2 x 2 grid of (2, 3) shards
    data = local.flatten()[rng].clone()
    st = ShardedTensor.from_rank_offsets_flat(
        "k", data, (2, 3), (0, 1, 2), (1, 1, 2), flattened_range=rng
    )
    local_coords = st.local_coordinates()
    global_coords = st.global_coordinates()
    assert len(local_coords) == 2 and len(global_coords) == 2
    assert all(c.dtype == np.int64 for c in global_coords)
    assert torch.equal(local[tuple(torch.from_numpy(c) for c in local_coords)], data)
    assert torch.equal(GLOBAL[tuple(torch.from_numpy(c) for c in global_coords)], data)


def test_global_coordinates_with_prepended_axis() -> None:
    stacked = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    data = stacked[1].flatten()[4:9].clone()
    st = ShardedTensor.from_rank_offsets_flat(
        "k", data, (3, 4), (0, 1, 2), prepend_axis_num=1, flattened_range=slice(4, 9)
    )
    coords = st.global_coordinates()
    assert len(coords) == 3 and coords[0].tolist() == [1] * 5
    assert torch.equal(stacked[tuple(torch.from_numpy(c) for c in coords)], data)


@pytest.mark.parametrize("method", ["local_coordinates", "global_coordinates"])
def test_coordinates_require_flattened_range(method: str) -> None:
    st = ShardedTensor(**_valid_kwargs())
    with pytest.raises(CheckpointingException, match=r"layer.w"):
        getattr(st, method)()


def test_local_chunk_offset_in_global_matches_rank_offsets() -> None:
    offsets = [st.local_chunk_offset_in_global() for st in _shards_2x3()]
    assert offsets == [(i, j) for i in range(2) for j in range(3)]
    st = ShardedTensor.from_rank_offsets(
        "k", torch.zeros(2, 3), (0, 3, 4), (2, 1, 2), prepend_axis_num=1
    )
    assert st.local_chunk_offset_in_global() == (3, 0, 1)


def test_local_chunk_offset_in_global_zero_extent_axis() -> None:
    st = ShardedTensor.from_rank_offsets("k", torch.zeros(0, 2), (1, 1, 2))
    assert st.local_chunk_offset_in_global() == (0, 1)


def test_local_chunk_offset_in_global_rejects_misaligned_shard() -> None:
    st = ShardedTensor(**_valid_kwargs(global_offset=(1, 0), axis_fragmentations=None))
    with pytest.raises(CheckpointingException, match=r"layer.w.*not a multiple"):
        st.local_chunk_offset_in_global()


def test_max_allowed_chunks() -> None:
    assert _shards_2x3()[0].max_allowed_chunks() == (2, 2)
    st = ShardedTensor(**_valid_kwargs(global_shape=(5, 3), axis_fragmentations=(2, 1)))
    with pytest.raises(CheckpointingException, match=r"layer.w.*axis 0 of size 5"):
        st.max_allowed_chunks()
    padded = ShardedTensor(**_valid_kwargs(global_shape=(5, 3), allow_shape_mismatch=True))
    assert padded.max_allowed_chunks() == (2, 3)
    with pytest.raises(CheckpointingException, match="no regular grid"):
        ShardedTensor(**_valid_kwargs(axis_fragmentations=None)).max_allowed_chunks()


def test_without_data_keeps_metadata_and_original() -> None:
    st = _shards_2x3()[1]
    bare = st.without_data()
    assert bare.data is None and st.data is not None
    assert dataclasses.replace(bare, data=st.data) == st


# ---------------------------------------------------------------- flat construction, init_data


def test_from_rank_offsets_flat_builds_flat_shard() -> None:
    st = ShardedTensor.from_rank_offsets_flat(
        "k",
        torch.ones(3, dtype=torch.int32),
        (2, 4),
        (0, 1, 2),
        flattened_range=slice(2, 5),
        replica_id=1,
    )
    assert st.flattened_range == slice(2, 5)
    assert st.local_shape == (2, 4) and st.global_shape == (4, 4) and st.global_offset == (2, 0)
    assert st.dtype == torch.int32 and st.replica_id == 1 and st.data is not None
    assert st.data.device.type == "cpu"


@pytest.mark.parametrize(
    ("data", "rng", "match"),
    [
        (torch.zeros(3), None, "needs a non-empty"),
        (torch.zeros(0), slice(2, 2), "needs a non-empty"),
        (torch.zeros(3), slice(None, 3), "needs a non-empty"),
        (torch.zeros(3), slice(6, 9), "outside the 8 local"),
        (torch.zeros(2), slice(0, 4, 2), "step 2"),
        (torch.zeros(1, 3), slice(0, 3), "1-D"),
        (torch.zeros(4), slice(0, 3), "1-D of length 3"),
    ],
)
def test_from_rank_offsets_flat_rejects_bad_input(data: torch.Tensor, rng: Any, match: str) -> None:
    with pytest.raises(ShardingValidationError, match=match) as info:
        ShardedTensor.from_rank_offsets_flat("flat.key", data, (2, 4), flattened_range=rng)
    assert "flat.key" in str(info.value)


def test_init_data_allocates_local_or_flat_shape_only_when_missing() -> None:
    st = ShardedTensor(**_valid_kwargs(data=None, dtype=torch.float64))
    st.init_data("cpu", init_fn=torch.ones)
    assert st.data is not None and st.data.shape == (2, 3) and st.data.dtype == torch.float64
    assert torch.all(st.data == 1)
    flat = ShardedTensor(**_flat_kwargs(data=None))
    flat.init_data(torch.device("cpu"))
    assert flat.data is not None and flat.data.shape == (3,)
    keep = torch.full((2, 3), 7.0)
    full = ShardedTensor(**_valid_kwargs(data=keep))
    full.init_data("cpu", init_fn=torch.zeros)
    assert full.data is keep


# ---------------------------------------------------------------- narrow


def _assemble(shards: list[ShardedTensor]) -> torch.Tensor:
    out = torch.full(shards[0].global_shape, float("nan"))
    for st in shards:
        out[st.global_slice()] = st.data
    return out


@pytest.mark.parametrize(
    ("dim", "start", "length"), [(0, 0, 1), (0, 1, 1), (1, 1, 1), (1, 0, 2), (1, 0, 0)]
)
def test_narrow_non_flat_on_every_rank_narrows_each_chunk(
    dim: int, start: int, length: int
) -> None:
    narrowed = [r for st in _shards_2x3() for r in st.narrow(dim, start, length)]
    assert len(narrowed) == 6
    grid = (2, 3)
    # Narrowing each (2, 2) chunk == narrowing the chunk axis of a blocked view of GLOBAL.
    blocked = GLOBAL.reshape(2, 2, 3, 2)
    expected = blocked.narrow(2 * dim + 1, start, length).reshape(
        tuple(g * length if a == dim else g * 2 for a, g in enumerate(grid))
    )
    assert narrowed[0].global_shape == expected.shape
    assert all(st.axis_fragmentations == (2, 3) for st in narrowed)
    if length:
        assert torch.equal(_assemble(narrowed), expected)


def test_narrow_unsplit_axis_matches_narrowing_the_full_tensor() -> None:
    shards = [
        ShardedTensor.from_rank_offsets("w", GLOBAL[2 * i : 2 * i + 2].clone(), (0, i, 2))
        for i in range(2)
    ]
    narrowed = [st.narrow(1, 2, 3)[0] for st in shards]
    assert narrowed[1].global_shape == (4, 3) and narrowed[1].global_offset == (2, 0)
    assert narrowed[1].local_shape == (2, 3)
    assert torch.equal(_assemble(narrowed), GLOBAL.narrow(1, 2, 3))


def test_narrow_with_prepended_axis_and_without_data() -> None:
    st = ShardedTensor.from_rank_offsets(
        "k", torch.zeros(4, 2), (0, 1, 3), (1, 1, 2), prepend_axis_num=1
    )
    (out,) = st.without_data().narrow(0, 1, 2)
    assert out.data is None
    assert out.local_shape == (2, 2)
    assert out.global_shape == (3, 4, 2) and out.global_offset == (1, 2, 0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((2, 0, 1), "bad narrow dim 2"),
        ((-1, 0, 1), "bad narrow dim"),
        ((0, 1, 2), "exceeds the local extent 2"),
        ((0, -1, 1), "exceeds"),
    ],
)
def test_narrow_rejects_bad_arguments(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(CheckpointingException, match=match):
        _shards_2x3()[0].narrow(*args)


def test_narrow_requires_regular_grid_along_dim() -> None:
    st = ShardedTensor(**_valid_kwargs(global_shape=(5, 3), axis_fragmentations=None))
    with pytest.raises(CheckpointingException, match=r"layer.w.*regular grid along dim 0"):
        st.narrow(0, 0, 1)
    misaligned = ShardedTensor(**_valid_kwargs(global_offset=(1, 0), axis_fragmentations=None))
    with pytest.raises(CheckpointingException, match="regular grid"):
        misaligned.narrow(0, 0, 1)
    assert len(st.narrow(1, 0, 1)) == 1  # the unsplit axis is still fine


FLAT_CASES = [
    (slice(5, 10), 1, 1),  # partial overlap on both ends
    (slice(0, 12), 0, 3),  # full overlap
    (slice(0, 12), 1, 2),
    (slice(0, 3), 1, 2),  # no overlap: range ends before the kept rows
    (slice(9, 12), 0, 2),  # no overlap: range starts after the kept rows
    (slice(8, 12), 0, 2),  # touching, still no overlap
    (slice(3, 5), 1, 1),  # one element of overlap
    (slice(4, 8), 1, 1),  # exactly one row
    (slice(2, 11), 2, 1),
]


@pytest.mark.parametrize(("rng", "start", "length"), FLAT_CASES)
def test_narrow_flat_matches_narrowing_full_local_tensor(
    rng: slice, start: int, length: int
) -> None:
    local = torch.arange(12).reshape(3, 4)  # values == flat indices
    st = ShardedTensor.from_rank_offsets_flat(
        "f", local.flatten()[rng].clone(), (3, 4), (0, 1, 2), flattened_range=rng
    )
    result = st.narrow(0, start, length)
    narrowed_local = local.narrow(0, start, length).flatten()
    expected = [v for v in narrowed_local.tolist() if rng.start <= v < rng.stop]
    if not expected:
        assert result == []
        return
    (out,) = result
    assert out.data is not None and out.data.tolist() == expected
    assert out.flattened_range is not None
    assert narrowed_local[out.flattened_range].tolist() == expected
    assert out.local_shape == (length, 4)
    assert out.global_shape == (2 * length, 4) and out.global_offset == (length, 0)


def test_narrow_flat_example_from_megatron() -> None:
    data = torch.arange(5, 10)
    st = ShardedTensor.from_rank_offsets_flat("f", data, (3, 4), flattened_range=slice(5, 10))
    (out,) = st.narrow(0, 1, 1)
    assert out.flattened_range == slice(1, 4)
    assert out.data is not None and out.data.tolist() == [5, 6, 7]


def test_narrow_flat_global_coordinates_index_narrowed_global() -> None:
    full = torch.arange(24).reshape(6, 4)  # two (3, 4) chunks along dim 0
    st = ShardedTensor.from_rank_offsets_flat(
        "f", full[3:6].flatten()[2:11].clone(), (3, 4), (0, 1, 2), flattened_range=slice(2, 11)
    )
    (out,) = st.narrow(0, 1, 2)
    narrowed_global = full.reshape(2, 3, 4)[:, 1:3].reshape(4, 4)
    coords = tuple(torch.from_numpy(c) for c in out.global_coordinates())
    assert out.data is not None and torch.equal(narrowed_global[coords], out.data)


def test_narrow_flat_only_along_dim_zero() -> None:
    st = ShardedTensor.from_rank_offsets_flat(
        "flat.key", torch.zeros(4), (3, 4), flattened_range=slice(0, 4)
    )
    with pytest.raises(CheckpointingException, match=r"flat.key.*dim 0"):
        st.narrow(1, 0, 2)


def test_narrow_flat_without_data() -> None:
    st = ShardedTensor.from_rank_offsets_flat(
        "f", torch.zeros(5), (3, 4), flattened_range=slice(5, 10)
    ).without_data()
    (out,) = st.narrow(0, 1, 1)
    assert out.data is None and out.flattened_range == slice(1, 4)


# ---------------------------------------------------------------- replicas, nonpersistent


@pytest.mark.parametrize(
    ("replica_id", "expected"),
    [(0, True), (1, False), ((0, 0, 0), True), ((0, 1), False), ((2, 0), False), ((), True)],
)
def test_is_main_replica(replica_id: Any, expected: bool) -> None:
    assert is_main_replica(replica_id) is expected


def test_local_nonpersistent_object_unwraps_same_object() -> None:
    obj = {"rng": [1, 2]}
    wrapped = LocalNonpersistentObject(obj)
    assert wrapped.unwrap() is obj


def test_sharded_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        ShardedBase()  # type: ignore[abstract]
    assert isinstance(ShardedObject("k", None, (1,), (0,)), ShardedBase)
    assert isinstance(_shards_2x3()[0], ShardedBase)


# ---------------------------------------------------------------- ShardedObject


def test_sharded_object_unique_key_and_str() -> None:
    obj = ShardedObject("optimizer/rng", {"s": 1}, (2, 8), (1, 3), replica_id=2)
    assert obj.unique_key == "optimizer/rng/shard_1.3_2.8"
    assert str(obj) == "ShardedObject(key='optimizer/rng')"
    bare = obj.without_data()
    assert bare.data is None and obj.data == {"s": 1}
    assert bare.unique_key == obj.unique_key and bare.replica_id == 2


@pytest.mark.parametrize(
    ("key", "shape", "offset"),
    [("a", (4,), (3,)), ("a/b/c", (2, 8), (1, 3)), ("x", (), ()), ("with_underscore", (1,), (0,))],
)
def test_sharded_object_unique_key_round_trip(
    key: str, shape: tuple[int, ...], offset: tuple[int, ...]
) -> None:
    obj = ShardedObject(key, "payload", shape, offset)
    back = ShardedObject.empty_from_unique_key(obj.unique_key, replica_id=(0, 1))
    assert back.key == key and back.global_shape == shape and back.global_offset == offset
    assert back.data is None and back.replica_id == (0, 1)
    assert back.unique_key == obj.unique_key


@pytest.mark.parametrize(
    "unique_key",
    [
        "noslash",
        "/shard_0_1",
        "k/shard_0_1_2",
        "k/shrd_0_1",
        "k/shard_a_1",
        "k/shard_0",
        "k/",
        "k/shard_0..1_2.2",
    ],
)
def test_empty_from_unique_key_rejects_malformed_keys(unique_key: str) -> None:
    with pytest.raises(CheckpointingException, match="Malformed") as info:
        ShardedObject.empty_from_unique_key(unique_key)
    assert repr(unique_key) in str(info.value)


@pytest.mark.parametrize(
    ("shape", "offset", "match"),
    [
        ((2, 2), (0,), "differ in rank"),
        ((2,), (2,), "outside"),
        ((2,), (-1,), "outside"),
        ((0,), (0,), "outside"),
    ],
)
def test_sharded_object_validation(
    shape: tuple[int, ...], offset: tuple[int, ...], match: str
) -> None:
    with pytest.raises(ShardingValidationError, match=f"'obj.key'.*{match}"):
        ShardedObject("obj.key", None, shape, offset)


# ---------------------------------------------------------------- factories


def _split_build(
    key: str, data: torch.Tensor, replica_id: Any, flattened_range: slice | None
) -> ShardedStateDict:
    half = data.shape[0] // 2
    return {
        "lo": ShardedTensor.from_rank_offsets(f"{key}.lo", data[:half], replica_id=replica_id),
        "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", data[half:], replica_id=replica_id),
    }


def _split_merge(sub: Any) -> torch.Tensor:
    return torch.cat([sub["lo"], sub["hi"]])


def _factory(key: str = "f", data: torch.Tensor | None = None) -> ShardedTensorFactory:
    data = torch.arange(4.0) if data is None else data
    return ShardedTensorFactory(key, data, _split_build, _split_merge, replica_id=1)


def test_factory_build_passes_its_fields_to_build_fn() -> None:
    calls: list[tuple[Any, ...]] = []
    data = torch.ones(2)
    factory = ShardedTensorFactory(
        "k",
        data,
        lambda *a: calls.append(a) or {"x": 1},
        _split_merge,
        replica_id=(0, 2),
        flattened_range=slice(0, 1),
    )
    assert factory.build() == {"x": 1}
    assert calls == [("k", data, (0, 2), slice(0, 1))]
    assert factory.validate_metadata_integrity() is None


def test_factory_without_data_cannot_build() -> None:
    bare = _factory("fac.key").without_data()
    assert bare.data is None and bare.build_fn is _split_build and bare.replica_id == 1
    with pytest.raises(CheckpointingException, match=r"fac.key"):
        bare.build()


def test_apply_factories_replaces_factories_in_nested_dicts_and_lists() -> None:
    plain = torch.zeros(1)
    sd: dict[str, Any] = {"a": _factory("a"), "n": {"l": [1, _factory("b")]}, "p": plain}
    apply_factories(sd)
    assert set(sd["a"]) == {"lo", "hi"} and sd["a"]["hi"].key == "a.hi"
    assert sd["a"]["lo"].replica_id == 1
    assert sd["n"]["l"][0] == 1 and sd["n"]["l"][1]["lo"].key == "b.lo"
    assert sd["p"] is plain


def test_apply_factory_merges_round_trip_nested() -> None:
    factories: dict[str, Any] = {
        "a": _factory("a", torch.arange(4.0)),
        "n": {"l": [_factory("b", torch.arange(6.0))]},
    }
    built: dict[str, Any] = {
        "a": _factory("a").build(),
        "n": {"l": [_factory("b", torch.arange(6.0)).build()]},
        "other": 5,
    }
    loaded = {
        "a": {k: v.data for k, v in built["a"].items()},
        "n": {"l": [{k: v.data for k, v in built["n"]["l"][0].items()}]},
        "other": 5,
    }
    out = apply_factory_merges(loaded, factories)
    assert out is loaded
    assert torch.equal(loaded["a"], torch.arange(4.0))
    assert torch.equal(loaded["n"]["l"][0], torch.arange(6.0))
    assert loaded["other"] == 5


def test_apply_factory_merges_list_matched_by_int_keyed_dict() -> None:
    loaded: dict[str, Any] = {"l": ["keep", {"lo": torch.ones(1), "hi": torch.zeros(1)}]}
    apply_factory_merges(loaded, {"l": {1: _factory()}})
    assert loaded["l"][0] == "keep" and torch.equal(loaded["l"][1], torch.tensor([1.0, 0.0]))


def test_apply_factory_merges_top_level_factory_returns_merged() -> None:
    merged = apply_factory_merges({"lo": torch.ones(1), "hi": torch.ones(1)}, _factory())
    assert torch.equal(merged, torch.ones(2))


@pytest.mark.parametrize(
    ("x1", "x2", "match"),
    [
        ({"a": 1}, {"b": _factory()}, r"key \('b',\) is missing"),
        ({"a": [1, 2]}, {"a": [_factory()]}, r"key \('a',\) does not match a list of length 1"),
        ({"a": {"x": 1}}, {"a": [_factory()]}, r"dict at key \('a',\)"),
        ({"a": [1]}, {"a": {3: _factory()}}, r"key \('a', 3\) is missing"),
        ({"a": [1]}, {"a": {"x": _factory()}}, r"key \('a', 'x'\) is missing"),
        ({"a": {"b": 1}}, {"a": {"b": 2}}, r"cannot merge int into int at key \('a', 'b'\)"),
        ({"a": 1}, {"a": {"b": _factory()}}, r"cannot merge dict into int at key \('a',\)"),
    ],
)
def test_apply_factory_merges_structure_mismatch_names_key(x1: Any, x2: Any, match: str) -> None:
    with pytest.raises(CheckpointingException, match=match):
        apply_factory_merges(x1, x2)


def test_flat_coordinates_of_zero_dim_shard_with_prepended_axes() -> None:
    stacked = torch.arange(3.0)
    st = ShardedTensor.from_rank_offsets_flat(
        "s", stacked[2:3].clone(), (), (0, 2, 3), prepend_axis_num=1, flattened_range=slice(0, 1)
    )
    assert st.local_coordinates() == ()
    (coords,) = st.global_coordinates()
    assert coords.tolist() == [2]
    assert torch.equal(stacked[torch.from_numpy(coords)], st.data)
