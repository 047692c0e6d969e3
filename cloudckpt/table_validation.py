"""The coordinator's checks of a save's gathered :class:`~cloudckpt.shard_table.ShardTable`
s: every rank's keys (:mod:`cloudckpt.keys`) and sharding (:mod:`cloudckpt.validation`),
vectorized, with the errors of the object-based checks, word for word.

The tables are grouped by their static part (DP replicas share one), whose keys are
decoded once per group. The checks then run on arrays and only *prove validity*:

* keys: :func:`~cloudckpt.keys.validate_key_set` runs once on the distinct keys (with
  a placeholder rank: the ranks holding a key change a message, never the verdict);
  if it raises, it runs again on the real key set (ranks included), which raises the
  error to report;
* sharding, per key: every shard agrees on kind, dtype, flattening, global and local
  shape; every offset is on the chunk grid; the main replicas cover every chunk once
  (bincounts over chunk ids); flattened main ranges tile each chunk, which holds when
  each chunk has one range starting at 0 and one ending at its size, no empty range,
  and, per chunk, the other starts are the other stops (two sorts of ``chunk, start``
  and ``chunk, stop``). A key that is not proven valid (a violation, uneven or empty
  shards, one the arrays cannot hold) is *suspicious*: its shards are rebuilt from the
  tables and :func:`~cloudckpt.validation.validate_sharding_integrity` runs on them
  (valid keys add no violation, so the error is the one all shards would give).
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloudckpt.array_utils import sorted_unique, unique_rows
from cloudckpt.errors import CheckpointingException
from cloudckpt.keys import (
    KeyLayout,
    KeySet,
    gather_keys,
    key_set,
    tensor_shapes,
    validate_key_set,
)
from cloudckpt.mapping import ShardedBase
from cloudckpt.shard_table import (
    DTYPE,
    FLAGS,
    FLAT,
    KEY,
    KIND,
    NDIM,
    OBJECT,
    PREPEND,
    TENSOR,
    ShardTable,
    StaticPart,
    chunk_offset,
    decode_static,
    rebuild_shards,
)
from cloudckpt.validation import validate_sharding_integrity

logger = logging.getLogger(__name__)

_CELL_LIMIT = 1 << 62  # chunk id x (range bound + 1) must stay below this (int64)


def check_gathered_tables(
    tables: Sequence[ShardTable],
    layout: KeyLayout,
    uri: str,
    rank: int,
    sharding: bool = True,
    regular_grid_for: str | None = None,
) -> None:
    """Check every rank's keys and (``sharding``) sharding, as :func:`check_shards`
    does on the shards the tables were built from (same errors).

    Raises:
        InvalidKeyError, KeyCollisionError: from :func:`validate_key_set`.
        ShardingValidationError: from :func:`validate_sharding_integrity`.
    """
    gathered = Gathered.of(tables)
    if gathered is None:  # some rank sent objects: the object-based checks, on all
        shards = [rebuild_shards(t) for t in tables]
        check_shards(shards, layout, uri, rank, sharding, regular_grid_for)
        return
    shapes = gathered.tensor_shapes() if layout.needs_shapes else None
    try:
        validate_key_set(gathered.distinct_keys(), layout, uri, rank, shapes)
    except CheckpointingException:
        validate_key_set(gathered.key_set(), layout, uri, rank, shapes)  # raises, with ranks
        logger.warning("the key checks of %s disagreed; the exact ones passed", uri)
    if not sharding:
        return
    _check_unproven(gathered, uri, regular_grid_for)


def check_gathered_sharding(
    tables: Sequence[ShardTable], uri: str, regular_grid_for: str | None = None
) -> None:
    """The sharding checks alone (a load's, on every rank's requested shards), as
    :func:`~cloudckpt.validation.validate_sharding_integrity` runs them on the shards
    the tables were built from (same errors): vectorized, then shard by shard for the
    keys not proven valid.

    Raises:
        ShardingValidationError: from :func:`validate_sharding_integrity`.
    """
    gathered = Gathered.of(tables)
    if gathered is None:  # some rank sent objects: the object-based checks, on all
        validate_sharding_integrity([rebuild_shards(t) for t in tables], uri, regular_grid_for)
        return
    _check_unproven(gathered, uri, regular_grid_for)


def _check_unproven(gathered: Gathered, uri: str, regular_grid_for: str | None) -> None:
    """The exact, shard-by-shard checks of the keys the vectorized ones did not prove
    valid (none in the common case)."""
    suspicious = gathered.suspicious_keys()
    if suspicious.size:
        logger.debug("checking %d key(s) of %s shard by shard", suspicious.size, uri)
        validate_sharding_integrity(gathered.shards_of(suspicious), uri, regular_grid_for)


def check_shards(
    gathered: Sequence[Sequence[ShardedBase]],
    layout: KeyLayout,
    uri: str,
    rank: int,
    sharding: bool = True,
    regular_grid_for: str | None = None,
) -> None:
    """The object-based checks of every rank's shards (``gathered[rank]``)."""
    per_rank = dict(enumerate(gathered))
    shapes = tensor_shapes(per_rank) if layout.needs_shapes else None
    validate_key_set(gather_keys(per_rank), layout, uri, rank, shapes)
    if sharding:
        validate_sharding_integrity(gathered, uri, regular_grid_for)


@dataclass(frozen=True)
class Group:
    """Ranks with one static part: their key ids and stacked dynamic columns."""

    part: StaticPart
    ranks: list[int]
    tables: list[ShardTable]
    gids: np.ndarray  # global key id per row

    @property
    def kinds(self) -> np.ndarray:
        return self.part.columns[:, KIND]

    @functools.cached_property
    def dynamic(self) -> np.ndarray:
        """[ranks, 4, rows]: cell, main, start, stop."""
        return np.stack([t.dynamic for t in self.tables])


@dataclass(frozen=True)
class Gathered:
    """Every rank's table, grouped by static part."""

    groups: list[Group]
    names: list[str]  # key by global id
    ranks: int

    @classmethod
    def of(cls, tables: Sequence[ShardTable]) -> Gathered | None:
        """None when a table holds objects, or two static parts share a digest."""
        by_digest: dict[bytes, tuple[ShardTable, list[int]]] = {}
        for rank, table in enumerate(tables):
            if table.shards is not None:
                return None
            first, ranks = by_digest.setdefault(table.digest, (table, []))
            if first.static != table.static:
                return None
            ranks.append(rank)
        ids: dict[str, int] = {}
        groups = []
        for first, ranks in by_digest.values():
            part = decode_static(first.static)
            local = np.fromiter(
                (ids.setdefault(k, len(ids)) for k in part.keys), np.int64, len(part.keys)
            )
            gids = local[part.columns[:, KEY]]
            groups.append(Group(part, ranks, [tables[r] for r in ranks], gids))
        return cls(groups, list(ids), len(tables))

    # -- keys ----------------------------------------------------------------------------

    def _unique_keys(self, group: Group) -> tuple[np.ndarray, list[str]]:
        """Per rank and object row of ``group``: the index of its unique key in the
        returned distinct unique keys."""
        rows = np.flatnonzero(group.kinds == OBJECT)
        cells = group.dynamic[:, 0, rows].astype(np.int64)  # [ranks, object rows]
        pairs = np.stack([np.broadcast_to(rows, cells.shape), cells], -1).reshape(-1, 2)
        distinct, inverse = unique_rows(pairs)
        inverse = inverse.reshape(cells.shape)
        names: list[str] = []
        statics = group.part.columns.tolist()
        for row, cell in distinct.tolist():
            offset = chunk_offset(group.part, statics[row], cell) if cell >= 0 else ()
            names.append(self._unique_key(group, row, offset))
        for i, j in zip(*np.nonzero(cells < 0), strict=True):  # odd: offsets sent apart
            table, row = group.tables[i], int(rows[j])
            odd = table.odd[table.odd[:, 0] == row][0, 1:].tolist()
            inverse[i, j] = len(names)
            names.append(self._unique_key(group, row, odd[: statics[row][NDIM]]))
        return inverse, names

    def _unique_key(self, group: Group, row: int, offset: Sequence[int]) -> str:
        """:attr:`ShardedObject.unique_key` of ``row`` at ``offset``."""
        ndim = int(group.part.columns[row, NDIM])
        shape = group.part.global_shapes[row, :ndim].tolist()
        offsets, shapes = (".".join(map(str, t)) for t in (offset, shape))
        return f"{self.names[group.gids[row]]}/shard_{offsets}_{shapes}"

    def distinct_keys(self) -> KeySet:
        """The key set with a placeholder rank (0) for every key."""
        tensors: set[str] = set()
        objects: set[str] = set()
        for group in self.groups:
            tensor_ids = sorted_unique(group.gids[group.kinds == TENSOR]).tolist()
            tensors.update(self.names[i] for i in tensor_ids)
            objects.update(self._unique_keys(group)[1])  # every one held by some rank
        return key_set(dict.fromkeys(tensors, (0,)), dict.fromkeys(objects, (0,)))

    def key_set(self) -> KeySet:
        """The key set, with the ranks holding each key (as :func:`gather_keys`)."""
        tensors: dict[str, set[int]] = defaultdict(set)
        objects: dict[str, set[int]] = defaultdict(set)
        for group in self.groups:
            for i in sorted_unique(group.gids[group.kinds == TENSOR]).tolist():
                tensors[self.names[i]].update(group.ranks)
            index, names = self._unique_keys(group)
            for rank, row in zip(group.ranks, index.tolist(), strict=True):
                for i in row:
                    objects[names[i]].add(rank)
        return key_set(tensors, objects)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor key's global shape (its first row's; the sharding checks compare
        the others), for the path limits of :func:`validate_key_set`."""
        shapes: dict[str, tuple[int, ...]] = {}
        for group in self.groups:
            rows = np.flatnonzero(group.kinds == TENSOR)
            gids, first = np.unique(group.gids[rows], return_index=True)
            for gid, row in zip(gids.tolist(), rows[first].tolist(), strict=True):
                ndim = int(group.part.columns[row, NDIM])
                shapes.setdefault(
                    self.names[gid], tuple(group.part.global_shapes[row, :ndim].tolist())
                )
        return shapes

    # -- sharding --------------------------------------------------------------------------

    def suspicious_keys(self) -> np.ndarray:
        """Global ids of the keys not proven valid (sorted)."""
        layout = _KeyLayout.of(self)
        bad = layout.bad.copy()
        cover: list[np.ndarray] = [np.zeros(0, np.int64)]
        ends, starts, stops = list(cover), list(cover), list(cover)
        for group, rows in zip(self.groups, layout.rows, strict=True):
            whole, first, last, start, stop = _group_cells(group, rows, layout, bad)
            cover += [whole, first]
            ends.append(last)
            starts.append(start)
            stops.append(stop)
        total = int(layout.ncells.sum())
        counts = np.bincount(np.concatenate(cover), minlength=total)
        last = np.bincount(np.concatenate(ends), minlength=total)
        flat_cells = np.repeat(layout.flat, layout.ncells)
        bad_cells = (counts != 1) | (flat_cells & (last != 1))
        key_of_cell = np.repeat(np.arange(len(self.names)), layout.ncells)
        bad[key_of_cell[bad_cells]] = True
        _check_tiling(
            np.concatenate(starts), np.concatenate(stops), layout, bad_cells, key_of_cell, bad
        )
        return np.flatnonzero(bad)

    def shards_of(self, keys: np.ndarray) -> list[list[ShardedBase]]:
        """Every rank's shards (rebuilt) of the given global key ids, in its order."""
        out: list[list[ShardedBase]] = [[] for _ in range(self.ranks)]
        for group in self.groups:
            rows = np.flatnonzero(np.isin(group.gids, keys)).tolist()
            if rows:
                for rank, table in zip(group.ranks, group.tables, strict=True):
                    out[rank] = rebuild_shards(table, group.part, rows)
        return out


@dataclass(frozen=True)
class _KeyLayout:
    """Per key: whether it is suspicious from its static columns alone, its chunk
    count and first chunk id, flattened or not, chunk size; per group: the row arrays
    :func:`_group_cells` needs."""

    bad: np.ndarray
    ncells: np.ndarray
    base: np.ndarray
    flat: np.ndarray
    numel: np.ndarray
    bound: int
    rows: list[_Rows]

    @classmethod
    def of(cls, gathered: Gathered) -> _KeyLayout:
        nkeys = len(gathered.names)
        width = max((g.part.width for g in gathered.groups), default=0)
        rows = [_Rows.of(g.part, width) for g in gathered.groups]
        sig = np.concatenate([r.signature for r in rows]) if rows else np.zeros((0, 1), np.int64)
        gids = np.concatenate([g.gids for g in gathered.groups]) if rows else np.zeros(0, np.int64)
        ref = np.zeros(nkeys, np.int64)
        ref[gids] = np.arange(len(gids))
        bad = np.zeros(nkeys, bool)
        bad[gids[(sig != sig[ref[gids]]).any(1)]] = True
        reference = np.concatenate([r.key_columns for r in rows])[ref] if rows else np.zeros((0, 3))
        present = np.zeros(nkeys, bool)
        present[gids] = True
        counts = np.zeros(nkeys, np.int64)
        for group in gathered.groups:
            counts += np.bincount(group.gids, minlength=nkeys) * len(group.ranks)
        ncells_f, numel, flat = reference[:, 0], reference[:, 1], reference[:, 2].astype(bool)
        bad |= ~present | (ncells_f > counts) | (ncells_f < 1) | (numel < 1)
        ncells = np.where(bad, 0, ncells_f).astype(np.int64)
        base = np.concatenate([[0], np.cumsum(ncells)[:-1]]).astype(np.int64)
        flat &= ~bad
        numel_i = np.where(bad, 0, numel).astype(np.int64)
        bound = int(numel_i[flat].max(initial=0)) + 1
        if int(ncells.sum()) * bound >= _CELL_LIMIT:  # chunk ids x bound overflow: by shard
            bad |= flat
            flat[:] = False
            ncells[bad] = 0
            base = np.concatenate([[0], np.cumsum(ncells)[:-1]]).astype(np.int64)
        return cls(bad, ncells, base, flat, numel_i, bound, rows)


@dataclass(frozen=True)
class _Rows:
    """Per row of one static part: flattened or not, the signature compared across a
    key's shards, and (chunks, chunk size, flattened) as floats (0 for empty ones)."""

    flat: np.ndarray
    signature: np.ndarray
    key_columns: np.ndarray

    @classmethod
    def of(cls, part: StaticPart, width: int) -> _Rows:
        cols, w = part.columns, part.width
        ndim, prepend = cols[:, NDIM], cols[:, PREPEND]
        is_object = cols[:, KIND] == OBJECT
        at = np.arange(w)[None, :]
        inside = at < ndim[:, None]
        local_at = np.clip(at - prepend[:, None], 0, max(w - 1, 0))
        local = np.take_along_axis(part.local_shapes, local_at, 1)
        chunk = np.where(inside & (at >= prepend[:, None]) & ~is_object[:, None], local, 1)
        shape = np.where(inside, part.global_shapes, 1)
        grid = np.where(is_object[:, None], shape, -(-shape // np.maximum(chunk, 1)))
        empty = ((chunk < 1) | (shape < 1)).any(1)
        flat = (cols[:, FLAGS] & FLAT) != 0
        ncells = np.where(empty, 0, np.prod(grid.astype(np.float64), axis=1))
        numel = np.where(empty, 0, np.prod(chunk.astype(np.float64), axis=1))
        pad = np.zeros((len(cols), width - w), np.int64)
        signature = np.concatenate(
            [
                cols[:, [KIND, DTYPE, NDIM, PREPEND]],
                flat[:, None],
                part.global_shapes,
                pad,
                np.where(is_object[:, None], 0, part.local_shapes),
                pad,
            ],
            1,
        )
        key_columns = np.stack([ncells, numel, flat.astype(np.float64)], 1)
        return cls(flat, signature, key_columns)


def _group_cells(
    group: Group, rows: _Rows, layout: _KeyLayout, bad: np.ndarray
) -> list[np.ndarray]:
    """Of one group's ranks: chunk ids of unflattened main replicas, of flattened main
    ranges starting at 0, of those ending at their chunk's size, and ``chunk, start`` /
    ``chunk, stop`` of the other flattened main ranges (as ``chunk * bound + value``).
    Keys with an odd shard (off the grid, bad range) are marked in ``bad``."""
    dyn = group.dynamic  # [ranks, 4, rows]
    gids = group.gids
    cell, main, start, stop = (dyn[:, i] for i in range(4))
    odd = cell < 0
    if odd.any():
        bad[gids[odd.any(0)]] = True
    use = (main != 0) & ~odd & ~layout.bad[gids]
    cell = cell + layout.base[gids]
    whole = cell[use & ~rows.flat]
    at = np.flatnonzero(use & rows.flat)
    cell, start, stop = cell.ravel()[at], start.ravel()[at], stop.ravel()[at]
    numel = np.broadcast_to(layout.numel[gids], use.shape).ravel()[at]
    first, last = start == 0, stop == numel
    bound = layout.bound
    return [
        whole,
        cell[first],
        cell[last],
        (cell * bound + start)[~first],
        (cell * bound + stop)[~last],
    ]


def _check_tiling(
    starts: np.ndarray,
    stops: np.ndarray,
    layout: _KeyLayout,
    bad_cells: np.ndarray,
    key_of_cell: np.ndarray,
    bad: np.ndarray,
) -> None:
    """Mark the keys of chunks whose other starts are not their other stops (each
    chunk of ``starts``/``stops`` has one range from 0 and one to its end, unless in
    ``bad_cells``)."""
    bound = layout.bound
    if bad_cells.any():
        starts = starts[~bad_cells[starts // bound]]
        stops = stops[~bad_cells[stops // bound]]
    if len(starts) != len(stops):  # cannot happen (equal counts per chunk): be safe
        bad[layout.flat] = True
        return
    starts, stops = np.sort(starts, kind="stable"), np.sort(stops, kind="stable")
    differ = np.flatnonzero(starts != stops)
    if differ.size:
        bad[key_of_cell[starts[differ] // bound]] = True
        bad[key_of_cell[stops[differ] // bound]] = True
