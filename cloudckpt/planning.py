"""Write planning: who writes which chunk (pure functions, no I/O, no collectives).

A chunk of a non-flat ShardedTensor is written by the rank holding its main
replica. A chunk of a *flattened* ShardedTensor (distributed-optimizer state) is
spread over several ranks, each holding a contiguous flat range of it; an object
store cannot assemble an object from several writers, so one rank (the
*assembler*) receives the other pieces and writes the whole chunk.

:func:`plan_flat_chunks` is the reference: it plans every chunk from every rank's
shards. A save plans on the coordinator only (:func:`plan_flat_exchange`, from each
rank's small :func:`flat_shard_table`) and sends each rank just its own transfers
(:class:`RankFlatPlan`), whose tags pair each send with its receive.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloudckpt.array_utils import stable_order
from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import ShardedTensor, is_main_replica
from cloudckpt.validation import chunk_index


@dataclass(frozen=True, slots=True)
class FlatPiece:
    """One rank's contiguous range ``[start, stop)`` of a flattened chunk."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class FlatChunkPlan:
    """How one chunk of a flattened tensor reaches storage.

    Attributes:
        key: tensor key.
        index: chunk index in the chunk grid.
        assembler: the rank that gathers the pieces and writes the chunk.
        pieces: every main-replica piece of the chunk, sorted by ``start``.
    """

    key: str
    index: tuple[int, ...]
    assembler: int
    pieces: tuple[FlatPiece, ...]


def plan_flat_chunks(global_shards: Sequence[Sequence[ShardedTensor]]) -> list[FlatChunkPlan]:
    """Plan the assembly of every flattened chunk.

    Args:
        global_shards: per rank, that rank's flattened ShardedTensors (data not needed).

    Returns:
        Plans sorted by (key, index): the same list on every rank. The assembler of a
        chunk is the rank holding its largest piece (fewest bytes moved), the lowest
        such rank on ties.
    """
    pieces: dict[tuple[str, tuple[int, ...]], list[FlatPiece]] = defaultdict(list)
    for rank, shards in enumerate(global_shards):
        for sh in shards:
            rng = sh.flattened_range
            if rng is None or not is_main_replica(sh.replica_id):
                continue
            index = chunk_index(sh)
            if index is None:
                continue  # rejected by validation; nothing sensible to plan
            pieces[(sh.key, index)].append(FlatPiece(rank, rng.start, rng.stop))
    plans = []
    for (key, index), found in sorted(pieces.items()):
        found.sort(key=lambda p: p.start)
        assembler = min(found, key=lambda p: (p.start - p.stop, p.rank)).rank
        plans.append(FlatChunkPlan(key, index, assembler, tuple(found)))
    return plans


# -- the exchanged form: compact tables, planned on the coordinator only ---------------------
#
# ``plan_flat_chunks`` needs every rank's shards on every rank: each rank receives the
# metadata of all ranks (bytes growing with the world size) and plans all chunks. The
# functions below split the planning instead: each rank describes its flattened pieces
# in a small integer table (:func:`flat_shard_table`), the coordinator alone groups
# them by chunk with a few vectorized passes (:func:`plan_flat_exchange`), and each rank
# receives only its own transfers (:class:`RankFlatPlan`). The chunks and assemblers are
# those of ``plan_flat_chunks``; a rank names its pieces by their row in its own table.

#: Columns of a rank's flat-shard table: chunk id, range start, range stop, chunk elements.
FLAT_TABLE_COLUMNS = 4


def chunk_id(key: str, index: Sequence[int]) -> int:
    """A 64-bit id of chunk ``index`` of tensor ``key``, the same on every rank (a hash:
    two chunks sharing one is detected by :func:`plan_flat_exchange`, which then fails)."""
    name = f"{key}\0{','.join(map(str, index))}".encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little", signed=True)


def flat_shard_table(
    pieces: Sequence[tuple[str, Sequence[int], int, int, int]],
) -> tuple[list[int], np.ndarray]:
    """This rank's flattened pieces as the coordinator plans them.

    Args:
        pieces: per main-replica flattened shard: (key, chunk index, range start, range
            stop, elements of the chunk).

    Returns:
        The order of the rows (positions in ``pieces``, sorted by chunk id: the
        coordinator merges presorted runs) and the table, ``(n, FLAT_TABLE_COLUMNS)``
        int64; row ``i`` describes ``pieces[order[i]]``.
    """
    table = np.empty((len(pieces), FLAT_TABLE_COLUMNS), dtype=np.int64)
    for row, (key, index, start, stop, numel) in enumerate(pieces):
        table[row] = (chunk_id(key, index), start, stop, numel)
    order = np.argsort(table[:, 0], kind="stable")
    return order.tolist(), table[order]


@dataclass(frozen=True)
class RankFlatPlan:
    """One rank's part in the assembly of the flattened chunks.

    Attributes:
        sends: ``(k, 3)`` integers (the narrowest that hold them): (row of the piece,
            assembler rank, tag) for each piece this rank sends; its other rows are
            pieces of chunks it assembles itself.
        recvs: ``(m, 5)`` integers: (row of this rank's piece of the chunk, peer rank,
            start, stop, tag) for each piece this rank receives into a chunk it assembles.

    Rows index the rank's own :func:`flat_shard_table`. A send pairs with the receive of
    the same tag on its assembler.
    """

    sends: np.ndarray
    recvs: np.ndarray


def _empty_plan() -> RankFlatPlan:
    return RankFlatPlan(np.empty((0, 3), np.int64), np.empty((0, 5), np.int64))


def plan_flat_exchange(tables: Sequence[np.ndarray]) -> list[RankFlatPlan]:
    """The coordinator's planning: every rank's part, from every rank's table.

    Args:
        tables: per rank, its :func:`flat_shard_table`.

    Returns:
        Per rank, its :class:`RankFlatPlan`. The assembler of a chunk is the rank holding
        its largest piece, the lowest such rank on ties (as :func:`plan_flat_chunks`).

    Raises:
        CheckpointingException: a chunk's pieces hold more elements than the chunk
            (overlapping pieces, or two chunks with one id), or disagree on its size.
    """
    world = len(tables)
    counts = np.array([len(t) for t in tables], dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return [_empty_plan() for _ in range(world)]
    columns = np.concatenate([t.reshape(-1, FLAT_TABLE_COLUMNS) for t in tables]).T
    ids, starts, stops, numels = (np.ascontiguousarray(c) for c in columns)
    order = np.argsort(ids, kind="stable")  # merges the ranks' sorted runs
    offsets = np.cumsum(counts) - counts  # first row of each rank
    # the rank of each sorted piece ("right": past the equal offsets of ranks without rows)
    rank = np.searchsorted(offsets, order, side="right") - 1
    row = order - offsets[rank]
    ids = ids[order]
    first = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    sizes = np.diff(np.append(first, total))
    length = (stops - starts)[order]
    _check_chunks(numels[order], length, first)
    longest = np.repeat(np.maximum.reduceat(length, first), sizes)
    position = np.arange(total, dtype=np.int64)
    # within a chunk the pieces are in rank order: the first of the longest is the lowest rank
    chosen = np.minimum.reduceat(np.where(length == longest, position, total), first)
    assembler = np.repeat(rank[chosen], sizes)
    assembler_row = np.repeat(row[chosen], sizes)
    tag = position + 1
    remote = np.flatnonzero(rank != assembler)
    by_sender = remote[stable_order(rank[remote], world)]
    sends = _split_by(rank[by_sender], world, row[by_sender], assembler[by_sender], tag[by_sender])
    by_assembler = remote[stable_order(assembler[remote], world)]
    source = order[by_assembler]
    recvs = _split_by(
        assembler[by_assembler],
        world,
        assembler_row[by_assembler],
        rank[by_assembler],
        starts[source],
        stops[source],
        tag[by_assembler],
    )
    return [RankFlatPlan(s, r) for s, r in zip(sends, recvs, strict=True)]


def _check_chunks(numel: np.ndarray, length: np.ndarray, first: np.ndarray) -> None:
    """Each chunk's pieces agree on its size and hold at most its elements."""
    covered = np.add.reduceat(length, first)
    bad = (covered > numel[first]) | (
        np.maximum.reduceat(numel, first) != np.minimum.reduceat(numel, first)
    )
    if bad.any():
        raise CheckpointingException(
            f"{int(bad.sum())} flattened chunk(s) have pieces that overlap or disagree on "
            "the chunk's size; cannot plan their assembly"
        )


def _split_by(owner: np.ndarray, world: int, *columns: np.ndarray) -> list[np.ndarray]:
    """The rows of ``columns`` side by side, split by ``owner`` (sorted): one array per rank."""
    stacked = np.stack(columns) if len(owner) else np.empty((len(columns), 0), np.int64)
    bounds = np.searchsorted(owner, np.arange(world + 1))
    return [_narrowed(stacked[:, lo:hi].T) for lo, hi in itertools.pairwise(bounds)]


def _narrowed(part: np.ndarray) -> np.ndarray:
    """``part`` as the narrowest signed integers that hold its values (fewer bytes to send)."""
    if not part.size:
        return np.ascontiguousarray(part, dtype=np.int16)
    low, high = int(part.min()), int(part.max())
    for dtype in (np.int16, np.int32):
        limits = np.iinfo(dtype)
        if limits.min <= low and high <= limits.max:
            return np.ascontiguousarray(part, dtype=dtype)
    return np.ascontiguousarray(part, dtype=np.int64)


def chunk_plans(
    pieces: Sequence[Sequence[tuple[str, tuple[int, ...], int, int]]],
    plans: Sequence[RankFlatPlan],
) -> list[FlatChunkPlan]:
    """The :class:`FlatChunkPlan` list that ``plans`` amount to (for tests and tools).

    Args:
        pieces: per rank, (key, chunk index, start, stop) of each row of its table.
        plans: per rank, its :class:`RankFlatPlan`.
    """
    found: dict[tuple[str, tuple[int, ...]], tuple[int, list[FlatPiece]]] = {}
    for rank, (own, plan) in enumerate(zip(pieces, plans, strict=True)):
        sent = {int(r) for r in plan.sends[:, 0]}
        for row, (key, index, start, stop) in enumerate(own):
            if row not in sent:
                found.setdefault((key, index), (rank, []))[1].append(FlatPiece(rank, start, stop))
        for asm_row, peer, start, stop, _ in plan.recvs.tolist():
            key, index = own[asm_row][:2]
            found.setdefault((key, index), (rank, []))[1].append(FlatPiece(peer, start, stop))
    return [
        FlatChunkPlan(key, index, assembler, tuple(sorted(got, key=lambda p: p.start)))
        for (key, index), (assembler, got) in sorted(found.items())
    ]
