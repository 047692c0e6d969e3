"""The object collectives' two rounds (:mod:`cloudckpt.dist_objects`): pickles that fit
their round-one slot travel in one backend collective, longer ones go on in a second,
and every rank gets whole objects either way (4 real gloo processes)."""

from __future__ import annotations

from typing import Any

from cloudckpt.dist_objects import slot_bytes


def test_the_slot_shrinks_as_the_group_grows() -> None:
    assert slot_bytes(1) == slot_bytes(4) == 64 * 1024
    assert slot_bytes(64) == 4096
    assert slot_bytes(4096) == 64
    assert slot_bytes(1 << 20) == 64
    for world in (1, 4, 16, 1024, 4096):
        assert world * slot_bytes(world) <= max(256 * 1024, 64 * world)


def _payload(rank: int, size: int) -> bytes:
    return bytes([rank]) * size


def _collectives(rank: int, world: int, sizes: list[int]) -> dict[str, Any]:
    """All-gather and gather (on rank 1) objects of ``sizes[rank]`` bytes; count the
    backend collectives each made."""
    import torch.distributed as torch_dist  # noqa: PLC0415

    from cloudckpt import dist  # noqa: PLC0415

    calls: list[str] = []
    original_all_gather, original_gather = torch_dist.all_gather, torch_dist.gather

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    torch_dist.all_gather = counted("all_gather", original_all_gather)
    torch_dist.gather = counted("gather", original_gather)
    try:
        mine = {"rank": rank, "data": _payload(rank, sizes[rank])}
        everyone = dist.all_gather_object(mine)
        after_all_gather = list(calls)
        on_one = dist.gather_object(mine, dst=1)
    finally:
        torch_dist.all_gather, torch_dist.gather = original_all_gather, original_gather
    return {
        "all": everyone,
        "gathered": on_one,
        "all_gather_calls": after_all_gather,
        "gather_calls": calls[len(after_all_gather) :],
    }


def _check(outs: list[dict[str, Any]], sizes: list[int]) -> None:
    expected = [{"rank": r, "data": _payload(r, n)} for r, n in enumerate(sizes)]
    for rank, out in enumerate(outs):
        assert out["all"] == expected
        assert out["gathered"] == (expected if rank == 1 else None)


def test_small_objects_travel_in_one_collective(rank_pool: Any) -> None:
    sizes = [0, 10, 1000, 60_000]  # every pickle fits a 64 KiB slot
    outs = rank_pool.run(_collectives, sizes)
    _check(outs, sizes)
    for out in outs:
        assert out["all_gather_calls"] == ["all_gather"]
        assert out["gather_calls"] == ["all_gather"]


def test_objects_longer_than_their_slot_go_on_in_a_second_round(rank_pool: Any) -> None:
    sizes = [5, 70_000, 300_000, 65_536]  # some pickles overflow the slot, by a little or a lot
    outs = rank_pool.run(_collectives, sizes)
    _check(outs, sizes)
    for out in outs:
        assert out["all_gather_calls"] == ["all_gather", "all_gather"]
        assert out["gather_calls"] == ["all_gather", "gather"]
