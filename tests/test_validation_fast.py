"""The vectorized fast path of cloudckpt.validation (``even_tensor_is_valid``): it proves
valid even layouts of many ranks, and on every kind of violation it declines, so that
the exact checks run and report exactly what they report without it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from cloudckpt import validation
from cloudckpt.errors import ShardingValidationError
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor
from cloudckpt.validation import (
    even_tensor_is_valid,
    group_by_key,
    validate_sharding_integrity,
)
from tests.test_validation import st

TP, DP = 4, 6  # 24 shards per key: above the fast path's threshold
World = list[list[ShardedBase]]


def layout() -> World:
    """A TP x DP world: a row-split weight replicated over DP, a replicated bias, flat
    optimizer state (a DP slice of each TP chunk), stacked layers, RNG objects."""
    world: World = []
    for rank in range(TP * DP):
        t, d = rank % TP, rank // TP
        per_dp = 12 // DP
        world.append(
            [
                st("w", (2, 6), (2 * TP, 6), (2 * t, 0), replica=d),
                st("bias", (6,), (6,), (0,), replica=rank),
                st("exp_avg", (2, 6), (2 * TP, 6), (2 * t, 0), flat=slice(d * 2, d * 2 + per_dp)),
                *[
                    st("layers", (3,), (2, 3 * TP), (layer, 3 * t), replica=(0, d), prepend=1)
                    for layer in range(2)
                ],
                ShardedObject("rng", None, (TP * DP,), (rank,), rank * 0),
            ]
        )
    return world


def edited(world: World, rank: int, key: str, edit: Callable[[ShardedTensor], object]) -> World:
    """``world`` with ``rank``'s first shard of ``key`` replaced by ``edit(shard)``
    (dropped when it returns None)."""
    out = [list(shards) for shards in world]
    pos = next(i for i, sh in enumerate(out[rank]) if sh.key == key)
    new = edit(out[rank][pos])  # type: ignore[arg-type]
    if new is None:
        del out[rank][pos]
    else:
        out[rank][pos] = new  # type: ignore[call-overload]
    return out


def _errors(world: World) -> tuple[str, ...] | None:
    try:
        validate_sharding_integrity(world, "s3://b/ckpt")
    except ShardingValidationError as exc:
        return (str(exc), *exc.violations)
    return None


def test_valid_layout_is_proven_for_every_tensor_key() -> None:
    world = layout()
    by_key = group_by_key(world)
    proven = {key for key, entries in by_key.items() if even_tensor_is_valid(entries)}
    assert proven == {"w", "bias", "exp_avg", "layers"}
    assert not even_tensor_is_valid(by_key["rng"])  # objects: the exact checks
    validate_sharding_integrity(world)


def _moved(sh: ShardedTensor, offset: tuple[int, ...]) -> ShardedTensor:
    moved = copy.copy(sh)
    moved.global_offset = offset
    return moved


def _flat(sh: ShardedTensor, rng: slice) -> ShardedTensor:
    return st(sh.key, sh.local_shape, sh.global_shape, sh.global_offset, flat=rng)


VIOLATIONS: dict[str, tuple[int, str, Callable[[ShardedTensor], object]]] = {
    # rank 1 holds TP chunk 1 of "w" as its main replica, rank 0 chunk 0
    "dtype": (1, "w", lambda sh: st("w", (2, 6), (2 * TP, 6), (2, 0), 0, torch.bfloat16)),
    "global shape": (1, "w", lambda sh: st("w", (2, 6), (2 * TP, 7), (2, 0))),
    "uneven": (1, "w", lambda sh: st("w", (1, 6), (2 * TP, 6), (2, 0))),
    "misaligned": (1, "w", lambda sh: st("w", (2, 6), (2 * TP, 6), (3, 0))),
    # the constructor refuses these: as a corrupted gathered shard would be
    "off the grid": (1, "w", lambda sh: _moved(sh, (2 * TP, 0))),
    "negative": (1, "w", lambda sh: _moved(sh, (-2, 0))),
    "missing main": (0, "w", lambda sh: st("w", (2, 6), (2 * TP, 6), (0, 0), 7)),
    "two mains": (1, "w", lambda sh: st("w", (2, 6), (2 * TP, 6), (0, 0))),
    "dropped": (0, "bias", lambda sh: None),
    "mixed flattening": (1, "w", lambda sh: _flat(sh, slice(0, 12))),
    "flat gap": (1, "exp_avg", lambda sh: _flat(sh, slice(0, 1))),
    "flat overlap": (1, "exp_avg", lambda sh: _flat(sh, slice(0, 3))),
    "flat empty": (1, "exp_avg", lambda sh: _flat(sh, slice(0, 0))),
    "tensor and object": (1, "w", lambda sh: ShardedObject("w", None, (1,), (0,), 0)),
}


@pytest.mark.parametrize("kind", sorted(VIOLATIONS))
def test_fast_path_declines_and_errors_are_the_exact_ones(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank, key, edit = VIOLATIONS[kind]
    world = edited(layout(), rank, key, edit)
    assert not even_tensor_is_valid(group_by_key(world)[key])
    with_fast = _errors(world)
    assert with_fast is not None
    monkeypatch.setattr(validation, "_FAST_MIN_SHARDS", 10**9)  # the exact checks only
    assert with_fast == _errors(world)


def test_threshold_leaves_small_keys_to_the_exact_checks() -> None:
    world: World = [[st("x", (2,), (4,), (2 * r,))] for r in range(2)]
    validate_sharding_integrity(world)  # two shards: below the threshold, still valid
    assert validation._FAST_MIN_SHARDS > 2
