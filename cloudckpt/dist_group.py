"""One process group's place in the c10d store, as cloudckpt's collectives use it.

A :class:`_Guard` per group (its ranks) holds the store, the group's key prefix and the
sequence number of its check-ins, and reads which ranks checked in at a round;
:func:`_verdict_error` turns a failure verdict read from the store into the
:class:`~cloudckpt.errors.CollectiveError` every rank raises. Used by the barrier
(:mod:`cloudckpt.dist_guard`) and by the waits inside a backend collective
(:mod:`cloudckpt.dist_wait`).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch.distributed as torch_dist

from cloudckpt.errors import CollectiveError, CollectiveTimeoutError, RankLostError

_PREFIX = "cloudckpt"
_OK = "ok"


class _Guard:
    """cloudckpt's collectives on one process group: the store and the sequence number."""

    def __init__(self, store: Any, ranks: tuple[int, ...], rank: int) -> None:
        self.store = store
        self.ranks = ranks  # global ranks of the group
        self.rank = rank  # this process's global rank
        self.tag = f"{_PREFIX}/g{zlib.crc32(repr(ranks).encode()):08x}"
        self.seq = 0

    def missing(self, base: str) -> list[int]:
        """Ranks that have not checked in at the round ``base``."""
        return [r for r in self.ranks if not self.store.check([f"{base}/{r}"])]

    def arrived(self, base: str) -> list[int]:
        """Ranks that have checked in at the round ``base``."""
        return [r for r in self.ranks if self.store.check([f"{base}/{r}"])]


class _State:
    def __init__(self) -> None:
        self.world: Any = None
        self.guards: dict[tuple[int, ...], _Guard] = {}


_STATE = _State()


def _guard(group: Any) -> _Guard:
    world = torch_dist.distributed_c10d._get_default_group()
    if _STATE.world is not world:  # a new process group: start counting again
        _STATE.world, _STATE.guards = world, {}
    ranks = tuple(torch_dist.get_process_group_ranks(group if group is not None else world))
    if ranks not in _STATE.guards:
        store = torch_dist.distributed_c10d._get_default_store()
        _STATE.guards[ranks] = _Guard(store, ranks, torch_dist.get_rank())
    return _STATE.guards[ranks]


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _verdict_error(verdict: Mapping[str, Any], what: str, rank: int) -> CollectiveError:
    ranks = [int(r) for r in verdict.get("ranks", [])]
    seconds = float(verdict.get("s", 0))
    waited = verdict.get("waited")
    if verdict.get("kind") == "lost":
        why = f"no heartbeat for {seconds:g} s (killed, crashed or frozen)"
        kind: type[CollectiveError] = RankLostError
        hint = "heartbeat_timeout_s / $CLOUDCKPT_HEARTBEAT_TIMEOUT_S"
    else:
        why = f"did not arrive within collective_timeout_s={seconds:g}"
        kind = CollectiveTimeoutError
        hint = "collective_timeout_s / $CLOUDCKPT_COLLECTIVE_TIMEOUT_S"
    named = "; ".join(f"rank {r}: {why}" for r in ranks)
    return kind(
        f"{what}: {len(ranks)} rank(s) silent, seen from rank {rank} after {waited} s: {named} "
        f"(setting: {hint}); the process group cannot be used any more",
        dict.fromkeys(ranks, why),
    )
