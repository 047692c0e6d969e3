"""The box geometry both resharding readers use (cloudckpt.formats.geometry): boxes,
their intersection and bounding box, the slices of an overlap in each box, copying an
overlap, a shard's box and the boxes of a regular chunk grid."""

from __future__ import annotations

import itertools

import pytest
import torch

from cloudckpt import ShardedTensor
from cloudckpt.formats.geometry import (
    Box,
    absolute,
    bounding,
    copy_overlap,
    grid_box,
    grid_indices,
    intersection,
    overlap_slices,
    relative,
    shard_box,
    slices_in,
)


def test_a_box_is_its_offsets_and_sizes() -> None:
    box = Box((1, 2), (3, 4))
    assert (box.offsets, box.sizes) == ((1, 2), (3, 4))
    with pytest.raises(AttributeError):
        box.offsets = (0, 0)  # type: ignore[misc]
    assert hash(box) == hash(((1, 2), (3, 4)))
    assert box == ((1, 2), (3, 4))  # a plain (offsets, sizes) tuple is the same box


def test_intersection_and_overlap_slices() -> None:
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 3))
    assert intersection(a, b) == Box((2, 2), (2, 1))
    assert overlap_slices(a, b) == ((slice(2, 4), slice(0, 1)), (slice(0, 2), slice(2, 3)))
    assert intersection(a, Box((4, 0), (1, 9))) is None  # touching is empty
    assert overlap_slices(a, Box((4, 0), (1, 9))) is None
    assert intersection(Box((), ()), Box((), ())) == Box((), ())
    assert overlap_slices(Box((), ()), Box((), ())) == ((), ())
    with pytest.raises(ValueError):
        intersection(a, Box((0,), (1,)))
    assert slices_in(Box((2, 2), (2, 1)), a) == (slice(2, 4), slice(0, 1))


def test_bounding_relative_absolute() -> None:
    a, b = Box((1, 5), (2, 1)), Box((4, 0), (1, 2))
    assert bounding(a, b) == Box((1, 0), (4, 6))
    assert relative(a, (1, 2)) == Box((0, 3), (2, 1))
    assert absolute(relative(a, (1, 2)), (1, 2)) == a


@pytest.mark.parametrize(
    ("dst", "src"),
    [(Box((2, 1), (4, 5)), Box((0, 0), (4, 3))), (Box((0, 0), (3, 3)), Box((5, 5), (2, 2)))],
    ids=["overlapping", "disjoint"],
)
def test_copy_overlap_matches_the_global_tensor(dst: Box, src: Box) -> None:
    full = torch.arange(100, dtype=torch.float32).reshape(10, 10)

    def cut(box: Box) -> torch.Tensor:
        return full[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))].clone()

    out = torch.full(dst.sizes, -1.0)
    copy_overlap(out, dst, cut(src), src)
    for local in itertools.product(*(range(s) for s in dst.sizes)):
        point = tuple(o + i for o, i in zip(dst.offsets, local, strict=True))
        inside = all(o <= g < o + s for g, o, s in zip(point, *src, strict=True))
        assert out[local] == (full[point] if inside else -1.0)


def test_copy_overlap_from_a_tensor_larger_than_its_box() -> None:
    src = torch.arange(12).reshape(3, 4)  # a stored chunk; its box is clipped to (2, 3)
    out = torch.zeros(4, 4, dtype=src.dtype)
    copy_overlap(out, Box((0, 0), (4, 4)), src, Box((1, 1), (2, 3)))
    assert out[1:3, 1:4].tolist() == src[:2, :3].tolist()
    assert int(out.sum()) == int(src[:2, :3].sum())


def test_shard_box() -> None:
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 4), (1, 2, 3))
    assert shard_box(sh) == Box((2, 6), (2, 3))
    prepended = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(2, 3), (0, 5, 8), prepend_axis_num=1
    )
    assert shard_box(prepended) == Box((5, 0, 0), (1, 2, 3))


def test_grid_box_and_indices_match_brute_force() -> None:
    shape, chunk = (10, 7), (4, 3)
    assert grid_box((1, 2), chunk) == Box((4, 6), (4, 3))
    assert grid_box((2, 2), chunk, shape) == Box((8, 6), (2, 1))  # clipped to the array
    grid = list(itertools.product(range(3), range(3)))
    for box in [Box((1, 1), (2, 1)), Box((3, 2), (3, 3)), Box((6, 4), (6, 6)), Box((0, 0), shape)]:
        clipped = intersection(box, Box((0, 0), shape))
        expected = [i for i in grid if intersection(grid_box(i, chunk, shape), box) is not None]
        assert list(grid_indices(box, chunk, shape)) == expected
        assert clipped is not None
        covered = sum(
            _numel(intersection(grid_box(i, chunk, shape), box))
            for i in grid_indices(box, chunk, shape)
        )
        assert covered == _numel(clipped)
    assert list(grid_indices(Box((5, 3), (0, 2)), chunk, shape)) == []  # empty
    assert list(grid_indices(Box((10, 0), (3, 3)), chunk, shape)) == []  # outside
    assert list(grid_indices(Box((), ()), (), ())) == [()]  # 0-d: its one chunk


def _numel(box: Box | None) -> int:
    assert box is not None
    return box.sizes[0] * box.sizes[1]
