"""The columnar exchange of a save's sharding metadata (cloudckpt.shard_table) and the
coordinator's vectorized checks of it (cloudckpt.table_validation): on many random
layouts, valid and broken, they give exactly the verdict and the message of the
object-based checks (keys, then sharding), and a table rebuilds the shards it holds."""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.errors import (
    InvalidKeyError,
    KeyCollisionError,
    ShardingValidationError,
)
from cloudckpt.keys import KeyLayout
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from cloudckpt.shard_table import ShardTable, decode_static, rebuild_shards
from cloudckpt.table_validation import Gathered, check_gathered_tables, check_shards
from tests.test_validation_fast import layout as fast_layout

World = list[list[ShardedBase]]
URI = "s3://bucket/ckpt"
BACKENDS = {  # backend -> (key layout, regular_grid_for)
    "zarr": (KeyLayout(tensor_dirs=True, object_files=True), "zarr"),
    "torch_dist": (KeyLayout(tensor_dirs=False, object_files=False), None),
}
NAMES = ["w", "layers.0.w", "opt.exp_avg", "a/b", "rng", "bias"]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


# -- random layouts ------------------------------------------------------------------------


def _replica(rng: random.Random, index: int) -> int | tuple[int, ...]:
    return index if rng.random() < 0.5 else (0, index, 0)


def _holders(rng: random.Random, ranks: int, count: int) -> list[int]:
    return rng.sample(range(ranks), min(count, ranks))


def _grid(rng: random.Random) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(prepended axes, local shape, fragmentations per global axis)."""
    ndim = rng.randint(0, 3)
    prepend = rng.randint(0, ndim)
    local = tuple(rng.randint(1, 4) for _ in range(ndim - prepend))
    frags = tuple(rng.randint(1, 3) for _ in range(ndim))
    return prepend, local, frags


def _even(rng: random.Random, world: World, key: str) -> None:
    prepend, local, frags = _grid(rng)
    chunk = (1,) * prepend + local
    shape = tuple(c * f for c, f in zip(chunk, frags, strict=True))
    dtype = rng.choice(DTYPES)
    flat = rng.random() < 0.4 and local != ()
    for index in itertools.product(*(range(f) for f in frags)):
        offset = tuple(i * c for i, c in zip(index, chunk, strict=True))
        if flat:
            _flat_pieces(rng, world, key, dtype, local, shape, offset, prepend, frags)
            continue
        for i, rank in enumerate(_holders(rng, len(world), rng.randint(1, 3))):
            world[rank].append(
                ShardedTensor(
                    key, None, dtype, local, shape, offset, frags, _replica(rng, i), prepend
                )
            )


def _flat_pieces(
    rng: random.Random,
    world: World,
    key: str,
    dtype: torch.dtype,
    local: tuple[int, ...],
    shape: tuple[int, ...],
    offset: tuple[int, ...],
    prepend: int,
    frags: tuple[int, ...],
) -> None:
    """One chunk as flattened ranges on random ranks (and some non-main copies)."""
    numel = math.prod(local)
    cuts = sorted(rng.sample(range(1, numel), min(numel - 1, rng.randint(0, 3))))
    bounds = [0, *cuts, numel]
    for start, stop in itertools.pairwise(bounds):
        for i, rank in enumerate(_holders(rng, len(world), rng.randint(1, 2))):
            world[rank].append(
                ShardedTensor(
                    key,
                    None,
                    dtype,
                    local,
                    shape,
                    offset,
                    frags,
                    _replica(rng, i),
                    prepend,
                    flattened_range=slice(start, stop),
                )
            )


def _object(rng: random.Random, world: World, key: str) -> None:
    shape = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
    for offset in itertools.product(*(range(n) for n in shape)):
        for i, rank in enumerate(_holders(rng, len(world), rng.randint(1, 3))):
            world[rank].append(ShardedObject(key, None, shape, offset, _replica(rng, i)))


def _uneven(rng: random.Random, world: World, key: str) -> None:
    """A 1-D or 2-D tensor split into pieces of different sizes along axis 0."""
    sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 4))]
    rest = (rng.randint(1, 3),) if rng.random() < 0.5 else ()
    shape = (sum(sizes), *rest)
    at = 0
    for size in sizes:
        for i, rank in enumerate(_holders(rng, len(world), rng.randint(1, 2))):
            world[rank].append(
                ShardedTensor(
                    key,
                    None,
                    torch.float32,
                    (size, *rest),
                    shape,
                    (at, *(0 for _ in rest)),
                    None,
                    _replica(rng, i),
                )
            )
        at += size


def random_world(rng: random.Random) -> World:
    """A valid layout of 1-6 ranks and 1-6 keys of every kind."""
    world: World = [[] for _ in range(rng.randint(1, 6))]
    for k in range(rng.randint(1, 6)):
        make = rng.choice([_even, _even, _object, _uneven])
        make(rng, world, f"{rng.choice(NAMES)}{k}")
    for shards in world:
        rng.shuffle(shards)
    return world


# -- random breakage -----------------------------------------------------------------------


def _pick(rng: random.Random, world: World, want: type | None = None) -> tuple[int, int] | None:
    spots = [
        (r, i)
        for r, shards in enumerate(world)
        for i, sh in enumerate(shards)
        if want is None or type(sh) is want
    ]
    return rng.choice(spots) if spots else None


def _edit(rng: random.Random, world: World, change: Callable[[Any], None], want: type) -> None:
    spot = _pick(rng, world, want)
    if spot is not None:
        r, i = spot
        sh = copy.copy(world[r][i])
        change(sh)
        world[r][i] = sh


def _shift(sh: ShardedTensor) -> None:
    if sh.global_offset:
        sh.global_offset = (sh.global_offset[0] + 1, *sh.global_offset[1:])


def _range(rng: random.Random) -> Callable[[ShardedTensor], None]:
    def change(sh: ShardedTensor) -> None:
        numel = math.prod(sh.local_shape)
        start = rng.randint(0, numel)
        sh.flattened_range = slice(start, rng.randint(start, numel))

    return change


def _mutations(rng: random.Random) -> list[Callable[[World], None]]:
    def drop(w: World) -> None:
        spot = _pick(rng, w)
        if spot:
            del w[spot[0]][spot[1]]

    def duplicate(w: World) -> None:
        spot = _pick(rng, w)
        if spot:
            sh = copy.copy(w[spot[0]][spot[1]])
            sh.replica_id = 0
            w[rng.randrange(len(w))].append(sh)

    def add(sh: ShardedBase) -> Callable[[World], None]:
        return lambda w: w[rng.randrange(len(w))].append(sh)

    existing = f"{rng.choice(NAMES)}{rng.randint(0, 5)}"
    return [
        drop,
        duplicate,
        lambda w: _edit(rng, w, lambda sh: setattr(sh, "replica_id", 0), ShardedTensor),
        lambda w: _edit(rng, w, lambda sh: setattr(sh, "replica_id", 1), ShardedTensor),
        lambda w: _edit(rng, w, lambda sh: setattr(sh, "dtype", torch.float16), ShardedTensor),
        lambda w: _edit(
            rng, w, lambda sh: setattr(sh, "global_shape", (*sh.global_shape, 1)), ShardedTensor
        ),
        lambda w: _edit(rng, w, _shift, ShardedTensor),
        lambda w: _edit(rng, w, _range(rng), ShardedTensor),
        lambda w: _edit(rng, w, lambda sh: setattr(sh, "flattened_range", None), ShardedTensor),
        lambda w: _edit(
            rng,
            w,
            lambda sh: setattr(sh, "local_shape", tuple(n + 1 for n in sh.local_shape)),
            ShardedTensor,
        ),
        lambda w: _edit(rng, w, lambda sh: setattr(sh, "replica_id", 0), ShardedObject),
        lambda w: _edit(
            rng,
            w,
            lambda sh: setattr(sh, "global_offset", (9,) * len(sh.global_offset)),
            ShardedObject,
        ),
        lambda w: _edit(
            rng, w, lambda sh: setattr(sh, "global_shape", (2, *sh.global_shape)), ShardedObject
        ),
        add(ShardedObject(existing, None, (1,), (0,))),
        add(ShardedTensor(existing, None, torch.float32, (2,), (2,), (0,), (1,))),
        add(ShardedTensor(f"{existing}/0", None, torch.float32, (2,), (2,), (0,), (1,))),
        add(
            ShardedTensor(
                rng.choice(["manifest.json", "../x", "a//b", "x/.zarray"]),
                None,
                torch.float32,
                (1,),
                (1,),
                (0,),
                (1,),
            )
        ),
        add(ShardedObject("common_state", None, (1,), (0,))),
        add(ShardedTensor("empty", None, torch.float32, (0, 2), (0, 2), (0, 0), (1, 1))),
    ]


def broken_world(rng: random.Random) -> World:
    world = random_world(rng)
    mutations = _mutations(rng)
    for _ in range(rng.randint(1, 3)):
        rng.choice(mutations)(world)
    return world


# -- comparing -----------------------------------------------------------------------------


def verdict(check: Callable[..., None], *args: Any) -> tuple[type, str, Any] | None:
    try:
        check(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the object checks raise, compared
        return type(exc), str(exc), getattr(exc, "violations", None)
    return None


def travelled(world: World) -> list[ShardTable]:
    """Every rank's table, as the coordinator receives it (pickled)."""
    return [pickle.loads(pickle.dumps(ShardTable.of(s), pickle.HIGHEST_PROTOCOL)) for s in world]


def assert_same_verdict(world: World, sharding: bool = True) -> tuple[type, str, Any] | None:
    """The table checks raise what the object checks raise (or nothing), both backends."""
    found = None
    for backend, (layout, grid) in BACKENDS.items():
        exact = verdict(check_shards, world, layout, URI, 0, sharding, grid)
        fast = verdict(check_gathered_tables, travelled(world), layout, URI, 0, sharding, grid)
        assert fast == exact, (backend, world)
        found = found or exact
    return found


@pytest.mark.parametrize("seed", range(300))
def test_random_valid_layouts_agree(seed: int) -> None:
    world = random_world(random.Random(seed))
    assert_same_verdict(world)


def test_random_valid_layouts_pass() -> None:
    """Most random valid layouts pass both (the generator makes valid ones)."""
    passed = sum(
        verdict(check_shards, random_world(random.Random(s)), *_torch_dist_args()) is None
        for s in range(100)
    )
    assert passed >= 90


def _torch_dist_args() -> tuple[Any, ...]:
    layout, grid = BACKENDS["torch_dist"]
    return layout, URI, 0, True, grid


@pytest.mark.parametrize("seed", range(600))
def test_random_broken_layouts_agree(seed: int) -> None:
    rng = random.Random(10_000 + seed)
    assert_same_verdict(broken_world(rng), sharding=rng.random() < 0.85)


def test_broken_layouts_raise_every_kind_of_error() -> None:
    """The random breakage reaches every error (so the agreement above is no vacuous one)."""
    kinds: dict[type, int] = {}
    for seed in range(600):
        rng = random.Random(10_000 + seed)
        world = broken_world(rng)
        found = verdict(check_shards, world, *_torch_dist_args())
        if found is not None:
            kinds[found[0]] = kinds.get(found[0], 0) + 1
    assert set(kinds) >= {InvalidKeyError, KeyCollisionError, ShardingValidationError}, kinds
    assert kinds[ShardingValidationError] > 150, kinds


# -- the table itself ----------------------------------------------------------------------


def _fields(sh: ShardedBase) -> tuple[Any, ...]:
    if isinstance(sh, ShardedObject):
        return ("o", sh.key, sh.global_shape, sh.global_offset, is_main_replica(sh.replica_id))
    assert isinstance(sh, ShardedTensor)
    main = is_main_replica(sh.replica_id)
    rng = sh.flattened_range
    return (
        "t",
        sh.key,
        sh.dtype,
        sh.local_shape,
        sh.global_shape,
        sh.global_offset,
        sh.axis_fragmentations,
        main,
        sh.prepend_axis_num,
        sh.allow_shape_mismatch,
        None if rng is None else (rng.start, rng.stop),
    )


@pytest.mark.parametrize("seed", range(40))
def test_rebuilt_shards_equal_the_originals(seed: int) -> None:
    rng = random.Random(seed)
    world = broken_world(rng) if seed % 2 else random_world(rng)
    for shards in world:
        table = travelled([shards])[0]
        rebuilt = rebuild_shards(table)
        assert [type(s) for s in rebuilt] == [type(s) for s in shards]
        assert [_fields(s) for s in rebuilt] == [_fields(s) for s in shards]
        assert all(s.data is None for s in rebuilt)
        if shards:
            rows = sorted(rng.sample(range(len(shards)), rng.randint(1, len(shards))))
            assert [_fields(s) for s in rebuild_shards(table, None, rows)] == [
                _fields(shards[i]) for i in rows
            ]


def test_dp_replicas_share_one_static_part_and_keys_decode_once() -> None:
    shards = [
        ShardedTensor("w", None, torch.float32, (2, 3), (8, 3), (2 * t, 0), (4, 1), (0, d))
        for t in range(4)
        for d in range(3)
    ]
    world = [[s] for s in shards]
    tables = travelled(world)
    assert len({t.digest for t in tables}) == 1
    assert len({t.static for t in tables}) == 1
    gathered = Gathered.of(tables)
    assert gathered is not None and len(gathered.groups) == 1
    assert gathered.groups[0].ranks == list(range(12))
    assert gathered.suspicious_keys().size == 0
    assert decode_static(tables[0].static).keys == ["w"]


def test_keys_travel_exactly() -> None:
    odd_keys = ["ключ/é", "a\x00b", "tab\tkey", "\udcff-surrogate"]
    shards = [ShardedObject(k, None, (1,), (0,)) for k in odd_keys]
    assert [s.key for s in rebuild_shards(travelled([shards])[0])] == odd_keys


class _Subclass(ShardedTensor):
    pass


def test_shards_the_columns_cannot_hold_travel_as_objects() -> None:
    sub = _Subclass("s", None, torch.float32, (2,), (2,), (0,), (1,))
    plain = ShardedTensor("p", None, torch.float32, (2,), (2,), (0,), (1,))
    table = ShardTable.of([plain, sub])
    assert table.shards is not None and [s.key for s in table.shards] == ["p", "s"]
    assert rebuild_shards(table)[1] is table.shards[1]
    world: World = [[plain, sub], [copy.copy(sub)]]  # the subclass is saved twice (main)
    found = assert_same_verdict(world)
    assert found is not None and found[0] is ShardingValidationError


def test_tables_are_small_and_static_parts_compress() -> None:
    shards: list[ShardedBase] = [
        ShardedTensor(
            f"decoder.layers.{i}.mlp.weight",
            None,
            torch.bfloat16,
            (64, 32),
            (256, 32),
            (64, 0),
            (4, 1),
            (0, 1, 0),
        )
        for i in range(500)
    ]
    raw = pickle.dumps(ShardTable.of(shards), pickle.HIGHEST_PROTOCOL)
    objects = pickle.dumps([s.without_data() for s in shards], pickle.HIGHEST_PROTOCOL)
    assert len(raw) * 4 < len(objects), (len(raw), len(objects))


def test_an_empty_rank_and_an_empty_world() -> None:
    plain = ShardedTensor("p", None, torch.float32, (2,), (2,), (0,), (1,))
    assert assert_same_verdict([[], [plain], []]) is None
    assert assert_same_verdict([[]]) is None


def test_only_the_broken_key_is_rebuilt() -> None:
    """In a valid world of many ranks, one broken key is the only one not proven valid
    (the others never become objects again), and the error is the object checks' one."""
    world = fast_layout()
    victim = world[5][0]
    assert isinstance(victim, ShardedTensor)
    moved = copy.copy(victim)
    moved.global_offset = (moved.global_offset[0] + 1, *moved.global_offset[1:])
    world[5][0] = moved
    gathered = Gathered.of(travelled(world))
    assert gathered is not None
    suspicious = gathered.suspicious_keys()
    assert [gathered.names[i] for i in suspicious] == [victim.key]
    rebuilt = gathered.shards_of(suspicious)
    assert {sh.key for shards in rebuilt for sh in shards} == {victim.key}
    found = assert_same_verdict(world)
    assert found is not None and "not aligned to the chunk grid" in found[1]


def test_a_valid_world_of_many_ranks_is_proven_without_objects() -> None:
    gathered = Gathered.of(travelled(fast_layout()))
    assert gathered is not None
    assert len(gathered.groups) < len(fast_layout())  # DP replicas share static parts
    assert gathered.suspicious_keys().size == 0


def test_random_valid_layouts_are_proven_by_the_arrays_but_uneven_keys() -> None:
    """Only uneven keys are left to the object checks, so the agreement tests exercise
    the array proofs."""
    proven = 0
    for seed in range(100):
        world = random_world(random.Random(seed))
        gathered = Gathered.of(travelled(world))
        assert gathered is not None
        for i in gathered.suspicious_keys().tolist():
            shapes = {
                sh.local_shape
                for shards in world
                for sh in shards
                if sh.key == gathered.names[i] and isinstance(sh, ShardedTensor)
            }
            assert len(shapes) > 1, (seed, gathered.names[i])
        proven += len(gathered.names) - gathered.suspicious_keys().size
    assert proven > 200


def _state(edit: Callable[[ShardedTensor], None] | None = None) -> dict[str, Any]:
    weight = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))
    half = ShardedTensor.from_rank_offsets("h", torch.ones(4))
    if edit is not None:
        edit(half)
    return {"w": weight, "h": half, "rng": ShardedObject("rng", 7, (1,), (0,)), "step": 3}


@pytest.mark.parametrize("backend", ["zarr", "torch_dist"])
def test_a_save_checks_keys_and_sharding_through_tables(tmp_path, backend: str) -> None:
    """One process's save: valid state saves and loads back; a shard edited after it
    was made fails on its rank with its own metadata error; a sharding error names
    the key; an invalid key fails even without the sharding checks."""
    uri = str(tmp_path / "ok")
    cloudckpt.save(_state(), uri, (backend, 1))
    loaded = cloudckpt.load(_state(), uri)
    assert torch.equal(loaded["w"], torch.ones(2, 3)) and loaded["step"] == 3

    def grow(sh: ShardedTensor) -> None:
        sh.global_offset = (2,)  # 2 + 4 > 4: the constructor refuses it

    with pytest.raises(ShardingValidationError, match=r"Invalid ShardedTensor 'h'.*exceeds"):
        cloudckpt.save(_state(grow), str(tmp_path / "grown"), (backend, 1))

    def not_main(sh: ShardedTensor) -> None:
        sh.replica_id = 1

    with pytest.raises(ShardingValidationError, match="tensor 'h': 1 chunk"):
        cloudckpt.save(_state(not_main), str(tmp_path / "no-main"), (backend, 1))
    state = _state()
    state["other"] = ShardedObject("w", None, (1,), (0,))
    with pytest.raises(ShardingValidationError, match="used by ShardedObject and ShardedTensor"):
        cloudckpt.save(state, str(tmp_path / "both"), (backend, 1))
    state["other"] = ShardedTensor.from_rank_offsets("../up", torch.ones(1))
    with pytest.raises(InvalidKeyError, match=r"tensor '\.\./up' \(rank 0\)"):
        cloudckpt.save(state, str(tmp_path / "reserved"), (backend, 1), None, False)
