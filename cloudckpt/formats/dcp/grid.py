"""The torch_dist coordinator's proof that every tensor's chunks tile it: within
bounds, on a grid (each chunk spans exactly one cell between consecutive chunk
offsets, in every dimension, and no two chunks share a cell) and, with ``check_fill``,
covering its volume. Where it holds, DCP's ``_validate_global_plan`` finds no error
and no two chunks of a tensor overlap or share their offsets; where it cannot be
proven the check answers False and the caller runs DCP's own step.

The chunks are ids into rows of offsets and sizes (:class:`GridChunks`: the plans send
each distinct ``torch.Size`` once), and the passes run over blocks of chunks: at
4,096 ranks x 2,000 tensors a save has millions of chunks, and whole-array
temporaries (tens of MB each, fresh pages from the kernel every time) cost more than
the arithmetic. A block's temporaries stay in the cache and are reused from malloc's
heap. Besides a flag per chunk (its tensor has several) and a count per cell, only
chunks of tensors with one chunk mixed in (the others copied out), unevenly split
dimensions (sorted) and grids with many empty cells (sorted keys) hold per-chunk arrays
for the whole plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from cloudckpt.array_utils import sorted_unique

#: offsets and sizes above this are left to DCP (their sums and volumes stay in int64)
_MAX_EXTENT = 1 << 40
_MAX_KEY = 1 << 62
_MAX_VOLUME = 2.0**62
#: chunks per block of a pass: a block's int64 temporaries (a few hundred kB) stay in
#: the cache and below malloc's mmap threshold
_ROWS = 1 << 15


@dataclass(frozen=True)
class GridChunks:
    """Chunks of tensors as ids into rows.

    Attributes:
        tids: per chunk, its tensor (a row of ``extents``).
        off_ids: per chunk, its offsets (a row of ``off_rows``).
        sz_ids: per chunk, its sizes (a row of ``sz_rows``).
        off_rows: offsets, one row each, all of one width.
        sz_rows: sizes, one row each, the width of ``off_rows``.
        extents: per tensor, its size (a row of that width).
    """

    tids: Any
    off_ids: Any
    sz_ids: Any
    off_rows: Any
    sz_rows: Any
    extents: Any

    @classmethod
    def of_rows(cls, off: Any, sz: Any, extents: Any, tids: Any) -> GridChunks:
        """Chunks given by their own rows of offsets and sizes."""
        ids = np.arange(len(tids), dtype=np.int64)
        return cls(tids, ids, ids, off, sz, extents)

    def __len__(self) -> int:
        return len(self.tids)

    @property
    def width(self) -> int:
        return int(self.extents.shape[1])

    def blocks(self) -> Iterator[slice]:
        """The chunks in blocks of :data:`_ROWS`."""
        return (slice(lo, lo + _ROWS) for lo in range(0, len(self), _ROWS))

    def off(self, block: slice, dim: int | slice = slice(None)) -> Any:
        """The offsets of a block's chunks (all dimensions, or one)."""
        return self.off_rows[self.off_ids[block], dim]

    def sz(self, block: slice, dim: int | slice = slice(None)) -> Any:
        """The sizes of a block's chunks (all dimensions, or one)."""
        return self.sz_rows[self.sz_ids[block], dim]

    def subset(self, mask: Any) -> GridChunks:
        """The chunks where ``mask`` holds."""
        return GridChunks(
            self.tids[mask],
            self.off_ids[mask],
            self.sz_ids[mask],
            self.off_rows,
            self.sz_rows,
            self.extents,
        )


def valid_chunks(chunks: GridChunks, check_fill: bool) -> bool:
    """True when every chunk lies within its tensor, every tensor's chunks form a grid
    and (``check_fill``) cover its volume; False when that is not proven."""
    ext = chunks.extents
    if ext.size and (ext.min() < 0 or ext.max() > _MAX_EXTENT):
        return False
    for block in chunks.blocks():
        off, sz = chunks.off(block), chunks.sz(block)
        if off.size and (min(off.min(), sz.min()) < 0 or max(off.max(), sz.max()) > _MAX_EXTENT):
            return False  # (no overflow in the sum below)
        if (off + sz > ext[chunks.tids[block]]).any():
            return False
    count = np.bincount(chunks.tids, minlength=len(ext))
    if check_fill and not _fills(chunks):
        return False
    return _on_grid(chunks, count)


def _fills(chunks: GridChunks) -> bool:
    """Whether the chunks' volumes add up to each tensor's (none above int64)."""
    ext = chunks.extents
    if np.prod(ext.astype(np.float64), axis=1).max(initial=0) > _MAX_VOLUME:
        return False
    volume = np.zeros(len(ext), dtype=np.int64)
    for block in chunks.blocks():
        sz = chunks.sz(block)
        if np.prod(sz.astype(np.float64), axis=1).max(initial=0) > _MAX_VOLUME:
            return False
        np.add.at(volume, chunks.tids[block], np.prod(sz, axis=1))
    return bool((volume == np.prod(ext, axis=1)).all())


@dataclass(frozen=True)
class _Cells:
    """Along one dimension: each tensor's number of cells and each chunk's cell: 0
    (the dimension is whole), its offset over its tensor's ``step`` (split evenly) or
    ``positions`` (sorted)."""

    cells: Any
    step: Any = None
    positions: Any = None

    def of(self, chunks: GridChunks, block: slice, dim: int) -> Any:
        if self.positions is not None:
            return self.positions[block]
        return chunks.off(block, dim) // self.step[chunks.tids[block]]


def _on_grid(chunks: GridChunks, count: Any) -> bool:
    """True when, in every tensor with two or more chunks, every chunk spans exactly
    one cell of the grid made by the chunks' offsets in each dimension, and no two
    chunks lie in the same cell (then they are disjoint). A chunk's cell is numbered
    within its tensor (so the numbers stay below the chunks' count, whatever the
    world), and the cells are told apart by a count, not a sort."""
    several = np.empty(len(chunks), dtype=bool)
    for block in chunks.blocks():
        several[block] = count[chunks.tids[block]] >= 2
    if not several.any():
        return True
    if not several.all():  # else no copy (every chunk shares its tensor: the usual case)
        chunks = chunks.subset(several)
    per_tensor = np.ones(len(chunks.extents), dtype=np.int64)  # each tensor's cells
    split: dict[int, _Cells] = {}  # the dimensions not whole in every chunk
    for dim in range(chunks.width):
        found = _dim_cells(chunks, dim)
        if found is None:
            return False
        if found.step is None and found.positions is None:
            continue  # one cell per tensor
        if (per_tensor.astype(np.float64) * found.cells).max(initial=0) > _MAX_KEY:
            return False
        per_tensor *= found.cells
        split[dim] = found
    return _distinct_cells(chunks, split, per_tensor)


def _distinct_cells(chunks: GridChunks, split: dict[int, _Cells], per_tensor: Any) -> bool:
    """Whether no two chunks share a cell: by a count per cell where the cells are
    few, else by sorting the chunks' cells."""
    if per_tensor.astype(np.float64).sum() > _MAX_KEY:
        return False  # the cells of all tensors would not number in int64
    base = np.cumsum(per_tensor) - per_tensor  # each tensor's first cell, all tensors'
    total = int(per_tensor.sum())
    dense = total <= 4 * len(chunks) + 1024  # a grid's cells, each held by one chunk
    held = np.zeros(total if dense else 0, dtype=np.int64)
    keys = []
    for block in chunks.blocks():
        tids = chunks.tids[block]
        key = np.zeros(len(tids), dtype=np.int64)
        for dim, cells in split.items():
            key *= cells.cells[tids]
            key += cells.of(chunks, block, dim)
        key += base[tids]
        if dense:
            np.add.at(held, key, 1)
        else:
            keys.append(key)
    if dense:
        return bool((held <= 1).all())
    every = np.sort(np.concatenate(keys))
    return bool((every[1:] != every[:-1]).all())


def _dim_cells(chunks: GridChunks, dim: int) -> _Cells | None:
    """Along one dimension: each tensor's number of cells and how to find each chunk's
    cell (its position among its tensor's cells), where every chunk spans exactly one
    cell of its tensor's grid (the cells between the tensor's chunk offsets and its
    end); None where one does not. Without a sort where the dimension is whole in
    every chunk, or split evenly (every chunk of a tensor of one size, which divides
    its offset and the tensor's size: TP's splits); by the sorted offsets otherwise."""
    ext = chunks.extents[:, dim]
    if all(_whole(chunks, block, dim) for block in chunks.blocks()):
        return _Cells(np.ones(len(ext), dtype=np.int64))
    step = np.zeros(len(ext), dtype=np.int64)
    for block in chunks.blocks():
        step[chunks.tids[block]] = chunks.sz(block, dim)
    if all(_even(chunks, block, dim, step) for block in chunks.blocks()):
        cells = np.ones(len(ext), dtype=np.int64)
        used = step > 0
        cells[used] = ext[used] // step[used]
        return _Cells(cells, step=step)
    return _sorted_cells(chunks, dim)


def _whole(chunks: GridChunks, block: slice, dim: int) -> bool:
    """Whether every chunk of the block spans the whole dimension."""
    ext = chunks.extents[chunks.tids[block], dim]
    return bool(((chunks.off(block, dim) == 0) & (chunks.sz(block, dim) == ext)).all())


def _even(chunks: GridChunks, block: slice, dim: int, step: Any) -> bool:
    """Whether every chunk of the block has its tensor's ``step`` as size (not 0), and
    the step divides its offset and its tensor's size."""
    tids, sz = chunks.tids[block], chunks.sz(block, dim)
    each = step[tids]
    if not ((sz > 0).all() and (each == sz).all()):
        return False
    ext = chunks.extents[tids, dim]
    return not ((chunks.off(block, dim) % each).any() or (ext % each).any())


def _sorted_cells(chunks: GridChunks, dim: int) -> _Cells | None:
    """:func:`_dim_cells` by sorting every tensor's offsets and end."""
    ext = chunks.extents[:, dim]
    radix = int(ext.max(initial=0)) + 1
    if radix * len(ext) > _MAX_KEY:
        return None
    every = slice(None)
    tids, off, sz = chunks.tids, chunks.off(every, dim), chunks.sz(every, dim)
    tensor_ids = np.arange(len(ext), dtype=np.int64)
    starts = tids * radix + off
    bounds = sorted_unique(np.concatenate([starts, tensor_ids * radix + ext]))
    pos = np.searchsorted(bounds, starts)
    following = np.append(bounds, -1)[pos + 1]
    if not (following == starts + sz).all():
        return None
    first = np.searchsorted(bounds, tensor_ids * radix)
    cells = np.searchsorted(bounds, tensor_ids * radix + ext, side="right") - first - 1
    return _Cells(cells, positions=pos - first[tids])


__all__ = ["GridChunks", "valid_chunks"]
