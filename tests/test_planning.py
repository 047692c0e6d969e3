"""The coordinator's planning of flattened chunks (:func:`plan_flat_exchange`) against
the all-ranks reference (:func:`plan_flat_chunks`): same chunks, assemblers and pieces
on random layouts, and transfers that pair up; a rank failing before the planning fails
the zarr save on every rank (4 real gloo processes)."""

from __future__ import annotations

import itertools
import math
import pickle
import random

import numpy as np
import pytest
import torch

from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import ShardedTensor, is_main_replica
from cloudckpt.planning import (
    RankFlatPlan,
    chunk_id,
    chunk_plans,
    flat_shard_table,
    plan_flat_chunks,
    plan_flat_exchange,
)
from cloudckpt.storage import open_checkpoint
from cloudckpt.strategies.zarr import ZarrSaveShardedStrategy
from cloudckpt.validation import chunk_index
from tests.test_failure_agreement import _outcome

Piece = tuple[str, tuple[int, ...], int, int]


def flat(key: str, local: tuple[int, ...], grid: tuple[int, ...], rng: slice, replica: int = 0):
    """A data-less flattened ShardedTensor: piece ``rng`` of chunk ``grid``."""
    glob = tuple(n * 4 for n in local)
    offset = tuple(g * n for g, n in zip(grid, local, strict=True))
    return ShardedTensor(
        key, None, torch.float32, local, glob, offset, None, replica, 0, flattened_range=rng
    )


def random_world(seed: int, ranks: int) -> list[list[ShardedTensor]]:
    """Chunks of several keys cut into pieces (often equal ones: ties) spread over random
    ranks (a rank may hold several pieces of one chunk, or none), plus non-main replicas."""
    rnd = random.Random(seed)
    world: list[list[ShardedTensor]] = [[] for _ in range(ranks)]
    for k in range(rnd.randint(1, 6)):
        local = tuple(rnd.randint(1, 5) for _ in range(rnd.randint(1, 3)))
        numel = math.prod(local)
        for grid in {tuple(rnd.randrange(4) for _ in local) for _ in range(rnd.randint(1, 4))}:
            parts = rnd.randint(1, min(numel, 5))
            if rnd.random() < 0.5 and numel % parts == 0:  # equal pieces: ties
                cuts = [numel * i // parts for i in range(parts + 1)]
            else:
                cuts = sorted({0, numel, *rnd.sample(range(1, numel + 1), parts - 1)})
            for start, stop in itertools.pairwise(cuts):
                owner = rnd.randrange(ranks)
                world[owner].append(flat(f"k{k}", local, grid, slice(start, stop)))
                if rnd.random() < 0.2:
                    other = rnd.randrange(ranks)
                    world[other].append(flat(f"k{k}", local, grid, slice(start, stop), 1))
    for shards in world:
        rnd.shuffle(shards)
    return world


def exchange(world: list[list[ShardedTensor]]) -> tuple[list[list[Piece]], list[RankFlatPlan]]:
    """Each rank's table (pickled, as sent), the coordinator's plans (pickled back)."""
    pieces, tables = [], []
    for shards in world:
        entries = []
        for sh in shards:
            if is_main_replica(sh.replica_id):
                index = chunk_index(sh)
                assert index is not None and sh.flattened_range is not None
                rng = sh.flattened_range
                entries.append((sh.key, index, rng.start, rng.stop, math.prod(sh.local_shape)))
        order, table = flat_shard_table(entries)
        pieces.append([entries[i][:4] for i in order])
        tables.append(pickle.loads(pickle.dumps(table)))
    plans = [pickle.loads(pickle.dumps(p)) for p in plan_flat_exchange(tables)]
    return pieces, plans


@pytest.mark.parametrize("seed", range(40))
def test_coordinator_plans_are_the_reference_plans(seed: int) -> None:
    world = random_world(seed, ranks=random.Random(seed).randint(1, 9))
    pieces, plans = exchange(world)
    assert chunk_plans(pieces, plans) == plan_flat_chunks(world)


@pytest.mark.parametrize("seed", range(10))
def test_every_send_pairs_with_one_receive(seed: int) -> None:
    world = random_world(100 + seed, ranks=7)
    pieces, plans = exchange(world)
    sends = {
        (rank, int(asm), int(tag)): pieces[rank][row][2:]
        for rank, plan in enumerate(plans)
        for row, asm, tag in plan.sends.tolist()
    }
    recvs = {
        (int(peer), rank, int(tag)): (int(start), int(stop))
        for rank, plan in enumerate(plans)
        for _, peer, start, stop, tag in plan.recvs.tolist()
    }
    assert sends == recvs
    assert len({tag for _, _, tag in sends}) == len(sends)  # tags are unique
    reference = plan_flat_chunks(world)
    assert len(sends) == sum(p.rank != c.assembler for c in reference for p in c.pieces)


def test_assembler_is_the_largest_piece_lowest_rank_on_ties() -> None:
    world = [
        [],
        [flat("t", (8,), (0,), slice(4, 8))],
        [flat("t", (8,), (0,), slice(0, 4))],
        [flat("u", (9,), (1,), slice(0, 2))],
        [flat("u", (9,), (1,), slice(2, 9))],
    ]
    _, plans = exchange(world)
    assert [p.sends.tolist() for p in plans] == [[], [], [[0, 1, 2]], [[0, 4, 3]], []]
    assert plans[1].recvs.tolist() == [[0, 2, 0, 4, 2]]
    assert plans[4].recvs.tolist() == [[0, 3, 0, 2, 3]]


def test_a_rank_keeps_its_own_pieces_of_the_chunks_it_assembles() -> None:
    world = [[flat("t", (6,), (0,), slice(0, 2)), flat("t", (6,), (0,), slice(4, 6))]]
    world.append([flat("t", (6,), (0,), slice(2, 4))])
    _, plans = exchange(world)
    assert plans[0].sends.tolist() == []  # both its pieces stay: it assembles (lowest rank)
    assert [r[1:4] for r in plans[0].recvs.tolist()] == [[1, 2, 4]]
    assert [r[1] for r in plans[1].sends.tolist()] == [0]


def test_no_flattened_pieces_anywhere() -> None:
    plans = plan_flat_exchange([np.empty((0, 4), np.int64)] * 3)
    assert [(p.sends.shape, p.recvs.shape) for p in plans] == [((0, 3), (0, 5))] * 3


def test_overlapping_pieces_or_an_id_shared_by_two_chunks_fail() -> None:
    _, overlap = flat_shard_table([("t", (0,), 0, 5, 8), ("t", (0,), 3, 8, 8)])
    with pytest.raises(CheckpointingException, match="overlap or disagree"):
        plan_flat_exchange([overlap])
    same_id = chunk_id("t", (0,))
    clash = np.array([[same_id, 0, 8, 8], [same_id, 0, 4, 4]], dtype=np.int64)
    with pytest.raises(CheckpointingException, match="overlap or disagree"):
        plan_flat_exchange([clash])


def test_chunk_ids_name_key_and_index() -> None:
    assert chunk_id("a", (1, 0)) == chunk_id("a", (1, 0))
    assert len({chunk_id("a", (1, 0)), chunk_id("a", (0, 1)), chunk_id("a,1", (0,))}) == 3


def test_what_a_rank_receives_does_not_grow_with_the_world() -> None:
    """DP slices of one TP x PP layout: a rank's plan is about its own chunks only."""

    def world(dp: int, groups: int) -> list[list[ShardedTensor]]:
        out = []
        for g in range(groups):
            for d in range(dp):
                out.append(
                    [
                        flat(f"g{g}.w{i}", (dp * 4,), (0,), slice(4 * d, 4 * d + 4))
                        for i in range(20)
                    ]
                )
        return out

    small = exchange(world(4, 2))[1]
    large = exchange(world(4, 32))[1]
    assert max(len(pickle.dumps(p)) for p in large) == max(len(pickle.dumps(p)) for p in small)


def _off_grid_on_rank_2(rank: int, world: int, uri: str) -> dict:
    """Each rank holds a quarter of one flattened chunk; rank 2's offset is off the grid."""
    data = torch.arange(2.0) + 2 * rank
    offset = (3,) if rank == 2 else (0,)
    sh = ShardedTensor(
        "t",
        data,
        torch.float32,
        (8,),
        (16,),
        offset,
        None,
        0,
        0,
        flattened_range=slice(2 * rank, 2 * rank + 2),
    )
    fmt = ZarrSaveShardedStrategy().save_format()
    return _outcome(fmt.plan, open_checkpoint(uri), {"t": sh})


def test_a_rank_failing_before_the_plan_fails_every_rank(rank_pool, tmp_path) -> None:
    """The coordinator plans nothing when a rank sent no table; every rank raises,
    naming it, instead of waiting for a transfer."""
    outcomes = rank_pool.run(_off_grid_on_rank_2, str(tmp_path / "ckpt"))
    for out in outcomes:
        assert out["raised"] and "CheckpointingException" in out["kinds"], out
        assert out["failed_ranks"] == [2], out
        assert "planning the assembly of flattened chunks" in out["message"], out
        assert "not on the chunk grid" in out["message"], out
        assert out["elapsed"] < 10.0, out


def test_plans_travel_as_the_narrowest_integers() -> None:
    big = 1 << 40
    _, table = flat_shard_table([("t", (0,), 0, big, 2 * big)])
    _, other = flat_shard_table([("t", (0,), big, 2 * big, 2 * big)])
    plans = plan_flat_exchange([table, other])
    assert plans[1].sends.dtype == np.int16 and plans[1].sends.tolist() == [[0, 0, 2]]
    assert plans[0].recvs.dtype == np.int64 and plans[0].recvs.tolist() == [[0, 1, big, 2 * big, 2]]
