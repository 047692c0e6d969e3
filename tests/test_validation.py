"""Tests for cloudckpt.validation and cloudckpt.planning (pure: shards built by hand per rank)."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from cloudckpt.errors import CheckpointingException, ShardingValidationError
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor
from cloudckpt.planning import FlatChunkPlan, FlatPiece, plan_flat_chunks
from cloudckpt.validation import (
    StrictHandling,
    chunk_index,
    chunk_shape,
    group_by_key,
    parse_strict_flag,
    validate_sharding_integrity,
)

URI = "s3://bucket/run/iter_10"


def st(
    key: str,
    local: tuple[int, ...],
    glob: tuple[int, ...],
    offset: tuple[int, ...],
    replica: int | tuple[int, ...] = 0,
    dtype: torch.dtype = torch.float32,
    flat: slice | None = None,
    prepend: int = 0,
) -> ShardedTensor:
    """A data-less ShardedTensor, as gathered from another rank."""
    return ShardedTensor(
        key, None, dtype, local, glob, offset, None, replica, prepend, flattened_range=flat
    )


def obj(
    key: str, glob: tuple[int, ...], offset: tuple[int, ...], replica: int | tuple[int, ...] = 0
) -> ShardedObject:
    return ShardedObject(key, None, glob, offset, replica)


def tp_dp_layout(tp: int = 2, dp: int = 2) -> list[list[ShardedBase]]:
    """A TPxDP world: row-split weight, replicated bias, flat optimizer state, stacked layers,
    per-rank RNG objects. Rank r has tp rank r % tp and dp rank r // tp."""
    world: list[list[ShardedBase]] = []
    for rank in range(tp * dp):
        t, d = rank % tp, rank // tp
        per_dp = 12 // dp
        world.append(
            [
                st("decoder.w", (2, 6), (2 * tp, 6), (2 * t, 0), replica=d),
                st("decoder.bias", (6,), (6,), (0,), replica=rank),
                st(
                    "optimizer.exp_avg",
                    (2, 6),
                    (2 * tp, 6),
                    (2 * t, 0),
                    flat=slice(d * per_dp, (d + 1) * per_dp),
                ),
                *[
                    st("layers.w", (3,), (2, 3 * tp), (layer, 3 * t), replica=(0, d), prepend=1)
                    for layer in range(2)
                ],
                obj("rng", (tp * dp,), (rank,)),
                obj("sched", (1,), (0,), replica=rank),
            ]
        )
    return world


def violations_of(world: list[list[ShardedBase]]) -> tuple[str, ...]:
    with pytest.raises(ShardingValidationError) as info:
        validate_sharding_integrity(world, URI)
    assert isinstance(info.value, CheckpointingException) and isinstance(info.value, ValueError)
    assert URI in str(info.value)
    for violation in info.value.violations:
        assert violation in str(info.value)
    return info.value.violations


def replace_shard(
    world: list[list[ShardedBase]], rank: int, key: str, new: ShardedBase | None
) -> list[list[ShardedBase]]:
    """A copy of ``world`` where ``rank``'s first shard of ``key`` is replaced (or dropped)."""
    out = [list(shards) for shards in world]
    pos = next(i for i, sh in enumerate(out[rank]) if sh.key == key)
    if new is None:
        del out[rank][pos]
    else:
        out[rank][pos] = new
    return out


# --- valid layouts ---------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 2), (4, 1), (1, 4), (2, 3)])
def test_valid_tp_dp_layouts_pass(tp: int, dp: int) -> None:
    validate_sharding_integrity(tp_dp_layout(tp, dp), URI)


def test_two_dimensional_grid_and_uneven_edges_pass() -> None:
    world: list[list[ShardedBase]] = [
        [st("m", (4, 3), (8, 6), (4 * (r // 2), 3 * (r % 2)))] for r in range(4)
    ]
    validate_sharding_integrity(world)
    # A rank may hold several shards of one key; a rank may hold nothing.
    validate_sharding_integrity([[st("v", (2,), (4,), (0,)), st("v", (2,), (4,), (2,))], []])


def test_empty_world_passes() -> None:
    validate_sharding_integrity([[], []])


# --- tensor violations -----------------------------------------------------------------


def test_missing_chunk_is_reported() -> None:
    world = replace_shard(
        tp_dp_layout(), 1, "decoder.w", st("decoder.w", (2, 6), (4, 6), (2, 0), replica=1)
    )
    world = replace_shard(world, 3, "decoder.w", None)
    (violation,) = violations_of(world)
    assert "'decoder.w'" in violation and "no main replica" in violation and "(1, 0)" in violation


def test_missing_chunks_listing_is_truncated() -> None:
    (violation,) = violations_of([[st("big", (1,), (20,), (0,))]])
    assert "19 chunk(s)" in violation and "(14 more)" in violation


def test_doubly_saved_chunk_names_ranks() -> None:
    world = replace_shard(tp_dp_layout(), 2, "decoder.w", st("decoder.w", (2, 6), (4, 6), (0, 0)))
    (violation,) = violations_of(world)
    assert "'decoder.w'" in violation and "chunk (0, 0)" in violation
    assert "2 main replicas" in violation and "ranks 0, 2" in violation


@pytest.mark.parametrize(
    ("new", "attr"),
    [
        (st("decoder.w", (2, 6), (4, 6), (2, 0), replica=0, dtype=torch.bfloat16), "dtype"),
        (st("decoder.w", (2, 6), (4, 7), (2, 0)), "global_shape"),
    ],
)
def test_metadata_disagreement_is_reported(new: ShardedTensor, attr: str) -> None:
    (violation,) = violations_of(replace_shard(tp_dp_layout(), 1, "decoder.w", new))
    assert f"'decoder.w': {attr} differs across shards" in violation
    assert "ranks 0, 2, 3" in violation and "ranks 1" in violation


def test_a_smaller_shard_is_uneven_sharding_and_its_gap_is_reported() -> None:
    # local_shape (1, 6) among (2, 6) shards: uneven sharding, valid if the main
    # replicas tile the tensor; here row 3 has no main replica
    world = replace_shard(tp_dp_layout(), 1, "decoder.w", st("decoder.w", (1, 6), (4, 6), (2, 0)))
    (violation,) = violations_of(world)
    assert "'decoder.w'" in violation and "6 of 24 element(s) have no main replica" in violation


def test_mixed_flattened_and_not_is_reported() -> None:
    world = replace_shard(
        tp_dp_layout(), 0, "optimizer.exp_avg", st("optimizer.exp_avg", (2, 6), (4, 6), (0, 0))
    )
    (violation,) = violations_of(world)
    assert "'optimizer.exp_avg'" in violation and "flattened_range" in violation


def test_misaligned_offset_is_reported_with_rank() -> None:
    world = replace_shard(tp_dp_layout(), 1, "decoder.w", st("decoder.w", (2, 6), (4, 6), (1, 0)))
    violations = violations_of(world)
    assert any(
        "'decoder.w'" in v and "rank 1" in v and "offset (1, 0)" in v and "not aligned" in v
        for v in violations
    )


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        ([(0, 5), (6, 12)], "elements [5, 6) are not saved (Flattened ranges dont cover"),
        ([(0, 6)], "elements [6, 12) are not saved"),
        ([(2, 12)], "elements [0, 2) are not saved"),
        ([(0, 7), (6, 12)], "flattened range [6, 12) on rank 1 overlaps"),
    ],
    ids=["gap", "tail", "head", "overlap"],
)
def test_flattened_gaps_and_overlaps(ranges: list[tuple[int, int]], expected: str) -> None:
    world: list[list[ShardedBase]] = [
        [st("flat", (2, 6), (2, 6), (0, 0), flat=slice(a, b))] for a, b in ranges
    ]
    (violation,) = violations_of(world)
    assert "'flat'" in violation and "chunk (0, 0)" in violation and expected in violation


def test_flattened_non_main_replicas_do_not_count() -> None:
    world: list[list[ShardedBase]] = [
        [st("flat", (4,), (4,), (0,), flat=slice(0, 2))],
        [st("flat", (4,), (4,), (0,), flat=slice(2, 4))],
        [st("flat", (4,), (4,), (0,), flat=slice(1, 4), replica=1)],  # would overlap
    ]
    validate_sharding_integrity(world)
    world[1] = [st("flat", (4,), (4,), (0,), flat=slice(2, 4), replica=1)]
    assert any("[2, 4) are not saved" in v for v in violations_of(world))


# --- object violations -----------------------------------------------------------------


def test_object_duplicate_main_replicas() -> None:
    world = replace_shard(tp_dp_layout(), 3, "rng", obj("rng", (4,), (0,)))
    violations = violations_of(world)
    assert any("'rng'" in v and "rng/shard_0_4" in v and "ranks 0, 3" in v for v in violations)
    assert any("'rng'" in v and "3 distinct" in v and "expected 4" in v for v in violations)


def test_object_wrong_count() -> None:
    world = replace_shard(tp_dp_layout(), 2, "rng", obj("rng", (4,), (2,), replica=1))
    (violation,) = violations_of(world)
    assert "'rng'" in violation and "3 distinct main-replica shards" in violation


def test_object_global_shape_disagreement() -> None:
    world = replace_shard(tp_dp_layout(), 2, "rng", obj("rng", (5,), (2,)))
    (violation,) = violations_of(world)
    assert "'rng'" in violation and "global_shape differs" in violation


def test_key_used_by_tensor_and_object() -> None:
    world = tp_dp_layout()
    world[1].append(obj("decoder.bias", (1,), (0,)))
    (violation,) = violations_of(world)
    assert "'decoder.bias'" in violation
    assert "ShardedObject and ShardedTensor" in violation


def test_several_violations_reported_together() -> None:
    world = replace_shard(tp_dp_layout(), 1, "decoder.w", None)  # chunk (1, 0): no main
    world = replace_shard(
        world,
        1,
        "decoder.bias",
        st("decoder.bias", (6,), (6,), (0,), replica=1, dtype=torch.float16),
    )
    world = replace_shard(world, 2, "sched", obj("sched", (1,), (0,)))  # two main replicas
    world = replace_shard(
        world,
        0,
        "optimizer.exp_avg",
        st("optimizer.exp_avg", (2, 6), (4, 6), (0, 0), flat=slice(0, 5)),
    )
    world[0].append(obj("layers.w", (1,), (0,)))
    violations = violations_of(world)
    assert len(violations) == 5, violations
    expected = [
        ("'decoder.w'", "no main replica"),
        ("'decoder.bias'", "dtype differs"),
        ("'sched'", "ranks 0, 2"),
        ("'optimizer.exp_avg'", "[5, 6) are not saved"),
        ("'layers.w'", "used by ShardedObject and ShardedTensor"),
    ]
    for key, what in expected:
        assert any(key in v and what in v for v in violations), (key, what, violations)
    with pytest.raises(ShardingValidationError, match=r"5 problem\(s\)"):
        validate_sharding_integrity(world, URI)


# --- helpers ---------------------------------------------------------------------------


def test_group_by_key_and_chunk_helpers() -> None:
    a0, b1, a1 = st("a", (2,), (4,), (0,)), obj("b", (1,), (0,)), st("a", (2,), (4,), (2,))
    assert group_by_key([[a0, b1], [a1]]) == {"a": [(0, a0), (1, a1)], "b": [(0, b1)]}
    assert list(group_by_key([[b1], [a0]])) == ["a", "b"]
    layered = st("l", (3,), (2, 6), (1, 3), prepend=1)
    assert chunk_shape(layered) == (1, 3) and chunk_index(layered) == (1, 1)
    assert chunk_index(st("m", (2,), (4,), (1,))) is None


# --- StrictHandling --------------------------------------------------------------------


@pytest.mark.parametrize("member", list(StrictHandling), ids=lambda m: m.name)
def test_parse_strict_flag_accepts_members_and_values_in_any_case(member: StrictHandling) -> None:
    assert parse_strict_flag(member) is member
    assert parse_strict_flag(member.value) is member
    assert parse_strict_flag(member.value.upper()) is member
    assert parse_strict_flag(member.value.title()) is member


@pytest.mark.parametrize("junk", ["raise", "", "strict", 3, None])
def test_parse_strict_flag_rejects_junk_listing_valid_values(junk: object) -> None:
    with pytest.raises(ValueError) as info:
        parse_strict_flag(junk)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(junk) in message
    for member in StrictHandling:
        assert member.value in message


def test_strict_handling_predicates() -> None:
    assert not StrictHandling.requires_explicit_ckpt_mismatch_check(
        StrictHandling.ASSUME_OK_UNEXPECTED
    )
    # as Megatron-Core: only the *_ALL modes gather every rank's keys (for missing keys)
    assert {m for m in StrictHandling if StrictHandling.requires_global_app_metadata(m)} == {
        StrictHandling.LOG_ALL,
        StrictHandling.RAISE_ALL,
        StrictHandling.RETURN_ALL,
        StrictHandling.IGNORE_ALL,
    }
    assert {m for m in StrictHandling if StrictHandling.requires_returning_mismatch_keys(m)} == {
        StrictHandling.RETURN_UNEXPECTED,
        StrictHandling.RETURN_ALL,
    }


# --- plan_flat_chunks ------------------------------------------------------------------


def flat_world() -> list[list[ShardedTensor]]:
    """Two keys; chunk (0,) of 'a' split 3/6/3 over ranks 0-2, chunk (1,) tied 6/6."""

    def a(rank_off: int, start: int, stop: int, replica: int = 0) -> ShardedTensor:
        return st("a", (12,), (24,), (12 * rank_off,), flat=slice(start, stop), replica=replica)

    return [
        [
            a(0, 0, 3),
            st("dense", (4,), (4,), (0,)),
            st("b", (2, 2), (2, 2), (0, 0), flat=slice(0, 4)),
        ],
        [a(0, 3, 9), a(1, 6, 12)],
        [a(0, 9, 12), a(1, 0, 6), a(0, 0, 12, replica=1)],  # non-main replica: ignored
    ]


def test_plan_flat_chunks_assembler_and_sorted_pieces() -> None:
    plans = plan_flat_chunks(flat_world())
    assert plans == [
        FlatChunkPlan("a", (0,), 1, (FlatPiece(0, 0, 3), FlatPiece(1, 3, 9), FlatPiece(2, 9, 12))),
        FlatChunkPlan("a", (1,), 1, (FlatPiece(2, 0, 6), FlatPiece(1, 6, 12))),
        FlatChunkPlan("b", (0, 0), 0, (FlatPiece(0, 0, 4),)),
    ]


def test_plan_flat_chunks_tie_goes_to_lowest_rank() -> None:
    world = [
        [],
        [st("t", (8,), (8,), (0,), flat=slice(4, 8))],
        [st("t", (8,), (8,), (0,), flat=slice(0, 4))],
    ]  # equal pieces on ranks 1 and 2
    (plan,) = plan_flat_chunks(world)
    assert plan.assembler == 1 and [p.rank for p in plan.pieces] == [2, 1]


def test_plan_flat_chunks_independent_of_order_within_rank() -> None:
    reference = plan_flat_chunks(flat_world())
    rng = random.Random(0)
    for _ in range(5):
        world = flat_world()
        for shards in world:
            rng.shuffle(shards)
        assert plan_flat_chunks(world) == reference


def test_plan_flat_chunks_skips_non_flat_and_misaligned() -> None:
    world = [[st("dense", (4,), (8,), (0,)), st("odd", (4,), (8,), (2,), flat=slice(0, 4))]]
    assert plan_flat_chunks(world) == []
    assert plan_flat_chunks([]) == []


def test_a_sharding_error_travels_to_the_other_ranks_whole() -> None:
    """The coordinator's verdict is pickled to the other ranks: with its violations."""
    error = ShardingValidationError("2 violations", ("overlap at (0, 0)", "gap at (4, 0)"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ShardingValidationError
    assert str(copy) == "2 violations" and copy.violations == error.violations
