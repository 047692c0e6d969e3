"""Heartbeats: each rank advances a counter ``cloudckpt/hb/<rank>`` in the process
group's store from a daemon thread (:data:`_HEARTBEAT`), and a :class:`_Watcher` names
the ranks whose counter stopped advancing for the heartbeat timeout (a SIGKILL, a crash,
a SIGSTOP). The barrier (:mod:`cloudckpt.dist_guard`) and the waits inside a backend
collective (:mod:`cloudckpt.dist_wait`) watch them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as torch_dist

from cloudckpt.dist_group import _PREFIX

if TYPE_CHECKING:
    from cloudckpt.dist_bounds import Bounds

logger = logging.getLogger(__name__)


def _beat_key(rank: int) -> str:
    return f"{_PREFIX}/hb/{rank}"


class _Heartbeat:
    """This process's heartbeat thread (one per process group)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._world: Any = None
        self._wake = threading.Event()  # a shorter interval takes effect at once
        self.interval = 1.0

    def ensure(self, store: Any, rank: int, bounds: Bounds) -> None:
        if bounds.heartbeat_timeout_s <= 0:
            return
        world = torch_dist.distributed_c10d._get_default_group()
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()
            interval = min(self.interval, bounds.beat_s) if alive else bounds.beat_s
            if interval < self.interval:
                self._wake.set()
            self.interval = interval
            if alive and self._world is world:
                return
            self._world = world
            store.set(_beat_key(rank), "0")
            self._thread = threading.Thread(
                target=self._run,
                args=(store, _beat_key(rank), world),
                name="cloudckpt-heartbeat",
                daemon=True,
            )
            self._thread.start()

    def _run(self, store: Any, key: str, world: Any) -> None:
        beat = 0
        while _same_group(world):
            beat += 1
            try:
                store.set(key, str(beat))
            except Exception as exc:  # noqa: BLE001 - the group is going away
                logger.debug("heartbeat stopped: %s", exc)
                return
            self._wake.wait(self.interval)
            self._wake.clear()


def _same_group(world: Any) -> bool:
    try:
        return bool(
            torch_dist.is_initialized()
            and torch_dist.distributed_c10d._get_default_group() is world
        )
    except Exception:  # noqa: BLE001 - destroyed meanwhile
        return False


_HEARTBEAT = _Heartbeat()


class _Watcher:
    """Which ranks' heartbeats stopped advancing for ``timeout_s`` while watched."""

    def __init__(self, store: Any, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.seen: dict[int, tuple[bytes, float]] = {}

    def stopped(self, ranks: Sequence[int]) -> list[int]:
        now = time.monotonic()
        lost = []
        for rank in ranks:
            key = _beat_key(rank)
            if not self.store.check([key]):
                continue  # it never beat (before its first collective): unknown
            value = self.store.get(key)
            last = self.seen.get(rank)
            if last is None or last[0] != value:
                self.seen[rank] = (value, now)
            elif now - last[1] >= self.timeout_s:
                lost.append(rank)
        return lost
