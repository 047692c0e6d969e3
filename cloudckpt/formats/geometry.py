"""Boxes of a global tensor and their overlaps: the geometry both resharding readers use.

A requested shard and a stored piece (a DCP chunk, a zarr chunk, the part of one that
was read) are each a :class:`Box` of the global tensor: offsets and sizes per axis, in
global coordinates. Loading a shard is the same in both formats: find the stored boxes
that meet the shard's box (:func:`intersection`; for a regular chunk grid
:func:`grid_indices` and :func:`grid_box`), read them, and copy each overlap from the
stored tensor into the shard's (:func:`copy_overlap`, through the slices of the overlap
in each box, :func:`overlap_slices`). Pure functions, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import torch

from cloudckpt.mapping import ShardedTensor
from cloudckpt.validation import chunk_shape

Slices = tuple[slice, ...]


class Box(NamedTuple):
    """A box of a tensor: ``offsets`` and ``sizes`` per axis (immutable; equal to the
    plain ``(offsets, sizes)`` tuple)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def shard_box(sh: ShardedTensor) -> Box:
    """The box of the global tensor that ``sh``'s chunk covers: its global offset and
    its local shape (prepended axes of size 1)."""
    return Box(tuple(sh.global_offset), chunk_shape(sh))


def intersection(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover (same coordinates), or None if empty."""
    offsets, sizes = [], []
    for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(oa, ob), min(oa + sa, ob + sb)
        if lo >= hi:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


def slices_in(box: Box, outer: Box) -> Slices:
    """The slices selecting ``box`` in a tensor that holds ``outer`` (from its first
    element on each axis)."""
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(box[0], box[1], outer[0], strict=True))


def overlap_slices(a: Box, b: Box) -> tuple[Slices, Slices] | None:
    """Slices of ``a`` and of ``b`` selecting their intersection, or None if empty."""
    overlap = intersection(a, b)
    if overlap is None:
        return None
    return slices_in(overlap, a), slices_in(overlap, b)


def copy_overlap(out: torch.Tensor, out_box: Box, src: torch.Tensor, src_box: Box) -> None:
    """Copy the elements of ``src`` (holding ``src_box``, from its first element on each
    axis) that ``out_box`` also covers into ``out`` (holding ``out_box``)."""
    overlap = overlap_slices(src_box, out_box)
    if overlap is not None:
        in_src, in_out = overlap
        out[in_out] = src[in_src]


def bounding(a: Box, b: Box) -> Box:
    """The smallest box covering ``a`` and ``b``."""
    lo = [min(oa, ob) for oa, ob in zip(a[0], b[0], strict=True)]
    hi = [max(oa + sa, ob + sb) for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1], strict=True)]
    return Box(tuple(lo), tuple(h - low for h, low in zip(hi, lo, strict=True)))


def relative(box: Box, origin: tuple[int, ...]) -> Box:
    """``box`` in the coordinates of a box starting at ``origin``."""
    return Box(tuple(o - g for o, g in zip(box[0], origin, strict=True)), box[1])


def absolute(box: Box, origin: tuple[int, ...]) -> Box:
    """``box`` (relative to a box starting at ``origin``) in global coordinates."""
    return Box(tuple(o + g for o, g in zip(box[0], origin, strict=True)), box[1])


# -- regular chunk grids ------------------------------------------------------------------


def grid_box(
    index: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...] | None = None
) -> Box:
    """The box of the chunk at ``index`` of the regular grid of ``chunk``-shaped chunks
    starting at the origin; clipped to a tensor of ``shape`` when given."""
    offsets = tuple(i * c for i, c in zip(index, chunk, strict=True))
    if shape is None:
        return Box(offsets, tuple(chunk))
    sizes = tuple(min(c, n - o) for o, c, n in zip(offsets, chunk, shape, strict=True))
    return Box(offsets, sizes)


def grid_indices(
    box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]
) -> Iterator[tuple[int, ...]]:
    """The indices, in C order, of the chunks of the regular grid of ``chunk``-shaped
    chunks over a tensor of ``shape`` that ``box`` meets (clipped to the tensor: none
    when nothing of it is inside)."""
    ranges = []
    for offset, size, dim, length in zip(box[0], box[1], shape, chunk, strict=True):
        stop = min(offset + size, dim)
        if stop <= offset:
            return
        ranges.append(range(offset // length, (stop - 1) // length + 1))
    yield from itertools.product(*ranges)
