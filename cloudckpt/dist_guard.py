"""Bounded collectives: no rank of cloudckpt waits for a rank that is gone or silent.

Before each of cloudckpt's collectives (:mod:`cloudckpt.dist`), every rank checks in
at a barrier kept in the process group's key-value store (the c10d store that every
backend rendezvoused through: a ``TCPStore`` under ``torchrun``, a ``FileStore`` with
``file://``). A rank that checks in writes ``<op>/in/<rank>`` and adds one to
``<op>/in/n``; the rank that completes the count writes the verdict ``ok`` with a
compare-and-set, and every rank waits for the verdict (then a second, short round,
``<op>/out``, catches a rank that froze while it waited). A waiting rank that sees the
collective timeout pass, or the heartbeat of a missing rank stop, proposes a failure
verdict naming the missing ranks instead; the compare-and-set makes the first
proposal the verdict of every rank, so either every rank enters the collective or
none does (none is left alone inside it). Only then does the backend's collective
run, on ranks that are all present.

Why the store and not ``torch.distributed.monitored_barrier``: the latter exists for
gloo only (Megatron-Core trains with NCCL), collects on rank 0 alone (when rank 0 is
the silent one, or sees a dead rank and stops, the others can only name rank 0), and
tells a killed rank from a slow one no better than a timeout. The store works under
every backend, every rank can read which ranks checked in, and its compare-and-set
gives every rank the same verdict.

Heartbeats: a rank still uploading a bigger shard and a killed or frozen rank look
alike at a barrier (neither checked in), so a timeout alone must be long. Each rank
therefore advances a counter ``cloudckpt/hb/<rank>`` in the store from a daemon
thread (started at its first collective, ``heartbeat_timeout_s / 5`` apart; it stops
with the process group). The first rank to check in watches the heartbeats of the
missing ranks; one that stops for ``heartbeat_timeout_s`` (a SIGKILL, a crash, a
SIGSTOP) fails the collective at once with a :class:`RankLostError` naming it.

Inside the backend's collective: cloudckpt runs it asynchronously and polls it
(:func:`~cloudckpt.dist_wait.await_works`), watching the peers' heartbeats, so a rank
that dies or freezes there, after it checked in, is named within
``heartbeat_timeout_s`` too, instead of leaving its peers blocked until the process
group's timeout. A backend error there
(gloo: "Connection closed by peer") becomes a :class:`RankLostError` naming the ranks
whose heartbeat stopped.

After a :class:`~cloudckpt.errors.CollectiveError` the process group is unusable (the
ranks no longer agree on the next collective): end the job, as after any collective
timeout.

The parts: :mod:`cloudckpt.dist_bounds` (the timeouts), :mod:`cloudckpt.dist_group` (a
group's keys in the store, its verdicts), :mod:`cloudckpt.dist_heartbeat` (the
heartbeats), :mod:`cloudckpt.dist_wait` (waiting inside the backend's collective); this
module holds the barrier.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as torch_dist

from cloudckpt.dist_bounds import _BOUNDS, WAIT_SLICE_S, Bounds, current_bounds
from cloudckpt.dist_group import _OK, _decode, _Guard, _guard, _verdict_error
from cloudckpt.dist_heartbeat import _HEARTBEAT, _Watcher
from cloudckpt.errors import CollectiveError

logger = logging.getLogger(__name__)


@contextmanager
def bounded(config: Any) -> Iterator[None]:
    """Within the block, cloudckpt's collectives use the timeouts of ``config`` (a
    :class:`~cloudckpt.config.CheckpointConfig`, :class:`Bounds` - an async request's,
    captured where it was made - or None: the environment's). With a process group,
    this rank's heartbeat runs from here on."""
    bounds = (
        config
        if isinstance(config, Bounds)
        else Bounds.resolve(
            getattr(config, "collective_timeout_s", None),
            getattr(config, "heartbeat_timeout_s", None),
        )
    )
    if torch_dist.is_available() and torch_dist.is_initialized():
        guard = _guard(None)  # beat from the start of a save or load, before its first I/O
        _HEARTBEAT.ensure(guard.store, guard.rank, bounds)
    token = _BOUNDS.set(bounds)
    try:
        yield
    finally:
        _BOUNDS.reset(token)


# -- the barrier ----------------------------------------------------------------------------


_RECORDERS: list[list[str]] = []  # the lists of the recorded_check_ins blocks running


@contextmanager
def recorded_check_ins() -> Iterator[list[str]]:
    """The name of each check-in (one per cloudckpt collective, see :func:`check_in`)
    this process enters while the block runs, in order: to count and list a step's
    collectives (the tests that bound them, ``benchmarks/profile_local.py
    --collectives``)."""
    names: list[str] = []
    _RECORDERS.append(names)
    try:
        yield names
    finally:
        _RECORDERS[:] = [r for r in _RECORDERS if r is not names]


def check_in(what: str, group: Any = None) -> None:
    """Collective: return when every rank of ``group`` checked in here; raise on every
    waiting rank when some did not within the bounds (:func:`current_bounds`).

    Two rounds: arrival (which may wait long, for a slower rank), then departure (all
    ranks are awake and answer at once). A rank frozen while it waited for the others
    to arrive thus fails the departure round instead of leaving the others inside the
    backend's collective. A rank stopped after the departure round is caught by
    :func:`~cloudckpt.dist_wait.await_works`, which bounds the wait inside the backend's collective.

    Raises:
        CollectiveTimeoutError: ranks did not check in within ``collective_timeout_s``.
        RankLostError: a missing rank's heartbeat stopped for ``heartbeat_timeout_s``.
        CollectiveError: the store itself failed.
    """
    for names in _RECORDERS:
        names.append(what)
    guard = _guard(group)
    if len(guard.ranks) < 2:
        return
    bounds = current_bounds()
    _HEARTBEAT.ensure(guard.store, guard.rank, bounds)
    guard.seq += 1
    base = f"{guard.tag}/{guard.seq}"
    try:
        verdict = _round(guard, f"{base}/in", bounds)
        if verdict == _OK:
            verdict = _round(guard, f"{base}/out", bounds)
    except CollectiveError:
        raise
    except Exception as exc:  # the store failed: no verdict can be had
        raise CollectiveError(
            f"{what}: rank {guard.rank} lost the process group's store ({type(exc).__name__}: "
            f"{exc}); the rank hosting it (rank 0 with torchrun's TCPStore) may be gone"
        ) from exc
    if verdict != _OK:
        raise _verdict_error(json.loads(verdict), what, guard.rank)
    _forget(guard, guard.seq)


def _forget(guard: _Guard, seq: int) -> None:
    """Delete the keys no rank reads any more, so the store does not grow with every
    collective: those of this collective's arrival round (every rank has read its
    verdict, having checked in for departure) and of the previous departure round."""
    keys = [f"{guard.tag}/{seq}/in/{guard.rank}", f"{guard.tag}/{seq - 1}/out/{guard.rank}"]
    if guard.rank == guard.ranks[0]:
        for base in (f"{guard.tag}/{seq}/in", f"{guard.tag}/{seq - 1}/out"):
            keys += [f"{base}/n", f"{base}/verdict"]
    _JANITOR.forget(guard.store, keys)


class _Janitor:
    """Deletes the store keys of past check-ins from a daemon thread, off the
    collectives' path: each delete is a round trip to the store, and the coordinator
    made six per check-in before it entered the backend's collective (66 per save,
    0.3 ms each on a loaded machine), where every other rank waited for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, list[str]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def forget(self, store: Any, keys: list[str]) -> None:
        """Delete ``keys`` from ``store`` soon (no rank reads them any more)."""
        self._queue.put((store, keys))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="cloudckpt-store-janitor", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            store, keys = self._queue.get()
            try:
                for key in keys:
                    store.delete_key(key)
            except Exception as exc:  # noqa: BLE001 - a store without deletes only grows
                logger.debug("could not delete cloudckpt's collective keys: %s", exc)


_JANITOR = _Janitor()


def _round(guard: _Guard, base: str, bounds: Bounds) -> str:
    """One round of check-ins at ``base``: its verdict, "ok" or a failure (JSON)."""
    store = guard.store
    store.set(f"{base}/{guard.rank}", "1")
    arrived = int(store.add(f"{base}/n", 1))
    if arrived == len(guard.ranks):
        store.compare_set(f"{base}/verdict", "", _OK)
    return _await_verdict(guard, base, bounds, watch=arrived == 1)


def _await_verdict(guard: _Guard, base: str, bounds: Bounds, *, watch: bool) -> str:
    """Wait for the verdict of the round at ``base``, or propose a failure: the first
    rank to arrive watches the missing ranks' heartbeats; every rank keeps the deadline."""
    store, key = guard.store, f"{base}/verdict"
    started = time.monotonic()
    deadline = started + bounds.collective_timeout_s
    heartbeat_s = bounds.heartbeat_timeout_s
    watcher = _Watcher(store, heartbeat_s) if watch and heartbeat_s > 0 else None
    naps = _naps(len(guard.ranks))
    while not _wait_for(store, key, WAIT_SLICE_S, naps):
        now = time.monotonic()
        proposal: dict[str, Any] | None = None
        if watcher is not None:
            lost = watcher.stopped(guard.missing(base))
            if lost:
                proposal = {"kind": "lost", "ranks": lost, "s": heartbeat_s}
        if proposal is None and now >= deadline:
            missing = guard.missing(base)
            proposal = {"kind": "timeout", "ranks": missing, "s": bounds.collective_timeout_s}
        if proposal is not None:
            proposal["waited"] = round(now - started, 1)
            return _decode(store.compare_set(key, "", json.dumps(proposal)))
    return _decode(store.get(key))


def _wait_for(store: Any, key: str, seconds: float, naps: Iterator[float]) -> bool:
    """True when ``key`` exists within ``seconds``, else False; ``naps`` (from
    :func:`_naps`, one per wait, shared by its slices) spaces the polls.

    Polled with ``check``, not ``store.wait`` with a timeout: a ``TCPStore`` (torchrun's)
    logs a C++ warning at every wait that times out, which a rank waiting at a barrier
    for a slower one did five times a second.
    """
    deadline = time.monotonic() + seconds
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(next(naps), left))
    return True


def _naps(ranks: int) -> Iterator[float]:
    """Pauses between polls of one wait of a group of ``ranks``: from 0.5 ms, doubling,
    up to :func:`longest_nap` (a rank that waits long asks the store that often)."""
    nap, longest = 0.0005, longest_nap(ranks)
    while True:
        yield min(nap, longest)
        nap = 2 * nap


def longest_nap(ranks: int) -> float:
    """The longest pause between two polls of the store by one waiting rank: 25 us per
    rank of the group, from 2 ms to 0.1 s, so that all of a group's waiting ranks
    together ask the store at most about 40,000 times a second, while a small group
    learns a verdict within 2 ms of it (a wait's last pause is up to that much too
    long: with 0.1 s for every group, a 4-rank save's dozen check-ins overshot by a
    tenth of a second or more in all)."""
    return min(max(ranks * 25e-6, 0.002), 0.1)
