"""Write planning: who writes which chunk (pure functions, no I/O, no collectives).

A chunk of a non-flat ShardedTensor is written by the rank holding its main
replica. A chunk of a *flattened* ShardedTensor (distributed-optimizer state) is
spread over several ranks, each holding a contiguous flat range of it; an object
store cannot assemble an object from several writers, so one rank (the
*assembler*) receives the other pieces and writes the whole chunk. The plan is
computed identically on every rank from the gathered sharding metadata, so the
point-to-point transfers it implies match up without further negotiation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

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
