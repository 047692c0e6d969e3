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
(:func:`await_works`), watching the peers' heartbeats, so a rank that dies or freezes
there, after it checked in, is named within ``heartbeat_timeout_s`` too, instead of
leaving its peers blocked until the process group's timeout. A backend error there
(gloo: "Connection closed by peer") becomes a :class:`RankLostError` naming the ranks
whose heartbeat stopped.

After a :class:`~cloudckpt.errors.CollectiveError` the process group is unusable (the
ranks no longer agree on the next collective): end the job, as after any collective
timeout.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as torch_dist

from cloudckpt.errors import CollectiveError, CollectiveTimeoutError, ConfigError, RankLostError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

ENV_COLLECTIVE_TIMEOUT = "CLOUDCKPT_COLLECTIVE_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "CLOUDCKPT_HEARTBEAT_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
BEATS_PER_TIMEOUT = 5
MIN_BEAT_S = 0.1
WAIT_SLICE_S = 0.2  # how often a waiting rank looks at its deadline and the heartbeats
_PREFIX = "cloudckpt"
_OK = "ok"


@dataclass(frozen=True)
class Bounds:
    """How long cloudckpt's collectives may wait (see :class:`CheckpointConfig`'s
    ``collective_timeout_s`` and ``heartbeat_timeout_s``); heartbeat 0: off."""

    collective_timeout_s: float
    heartbeat_timeout_s: float

    @classmethod
    def resolve(
        cls,
        collective_timeout_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Bounds:
        """The given values, else the environment's, else the defaults."""
        env = os.environ if environ is None else environ
        collective = collective_timeout_s
        if collective is None:
            collective = _env_seconds(env, ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)
        heartbeat = heartbeat_timeout_s
        if heartbeat is None:
            heartbeat = _env_seconds(env, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S)
        return cls(float(collective), float(heartbeat))

    @property
    def beat_s(self) -> float:
        return max(MIN_BEAT_S, self.heartbeat_timeout_s / BEATS_PER_TIMEOUT)


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0 or (value == 0 and name == ENV_COLLECTIVE_TIMEOUT):
        raise ConfigError(f"${name} must be a number of seconds > 0, got {raw!r}")
    return value


_BOUNDS: ContextVar[Bounds | None] = ContextVar("cloudckpt_collective_bounds", default=None)


def current_bounds() -> Bounds:
    """The bounds of the innermost :func:`bounded` block, else the environment's."""
    return _BOUNDS.get() or Bounds.resolve()


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
    :func:`await_works`, which bounds the wait inside the backend's collective.

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


# -- heartbeats -----------------------------------------------------------------------------


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


# -- waiting inside a backend collective ---------------------------------------------------


def await_works(
    what: str, works: Sequence[Any], group: Any = None, peers: Sequence[int] | None = None
) -> None:
    """Wait for the backend's asynchronous collectives ``works`` (``async_op=True``;
    not point-to-point ones: see :func:`wait_blocking`) while watching the heartbeats
    of ``peers`` (default: the rest of ``group``).

    A peer that dies or freezes *inside* the collective, after it checked in, leaves
    a blocking backend call waiting for the process group's own timeout (gloo's is 30
    minutes, and gloo tells only the ranks wired to the dead one). Polling the works
    instead bounds that wait too: a peer whose heartbeat stops for
    ``heartbeat_timeout_s`` fails the wait with a :class:`RankLostError` naming it, and
    ``collective_timeout_s`` bounds it in any case. The works left pending are
    abandoned with the process group, which cannot be used after a CollectiveError.

    Raises:
        RankLostError: a peer's heartbeat stopped, or the backend failed the
            collective (a peer's connection closed).
        CollectiveTimeoutError: the works did not finish within ``collective_timeout_s``.
    """
    pending = [work for work in works if work is not None]  # None: not in ``group``
    guard = _guard(group)
    bounds = current_bounds()
    others = [r for r in (peers if peers is not None else guard.ranks) if r != guard.rank]
    watcher = _Watcher(guard.store, bounds.heartbeat_timeout_s)
    watch = bounds.heartbeat_timeout_s > 0 and bool(others)
    started = time.monotonic()
    look_at = started + WAIT_SLICE_S
    nap = _FIRST_NAP_S
    while True:
        try:
            if all(work.is_completed() for work in pending):
                for work in pending:
                    work.wait()  # raises the backend's error, if the work failed
                return
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            error = lost_in_collective(what, exc, group, peers)
            waited = round(time.monotonic() - started, 1)
            lost_ranks = error.ranks or others
            verdict = {"kind": "lost", "ranks": lost_ranks, "s": bounds.heartbeat_timeout_s}
            _poison_next(guard, {**verdict, "waited": waited})
            raise error from exc
        time.sleep(nap)
        now = time.monotonic()
        nap = min(2 * nap, _LAST_NAP_S if now - started >= _QUICK_S else _QUICK_NAP_S)
        if now < look_at:
            continue
        look_at = now + WAIT_SLICE_S
        published = _published_failure(guard)
        if published is not None:  # a peer gave up on this collective (it was stopped?)
            raise _verdict_error(published, f"{what} (inside the backend's collective)", guard.rank)
        lost = watcher.stopped(others) if watch else []
        if lost or now - started >= bounds.collective_timeout_s:
            kind = "lost" if lost else "timeout"
            seconds = bounds.heartbeat_timeout_s if lost else bounds.collective_timeout_s
            verdict = {"kind": kind, "ranks": lost or _not_past(guard, others), "s": seconds}
            verdict["waited"] = round(now - started, 1)
            _poison_next(guard, verdict)
            raise _verdict_error(verdict, f"{what} (inside the backend's collective)", guard.rank)


def _not_past(guard: _Guard, others: list[int]) -> list[int]:
    """Of ``others``, the ranks not yet waiting at the next check-in: those that left the
    collective (a gather's senders finish before its root) are alive, so the ones still
    missing are the suspects; all of ``others`` when none has moved on."""
    try:
        ahead = set(guard.arrived(f"{guard.tag}/{guard.seq + 1}/in"))
    except Exception as exc:  # noqa: BLE001 - name every peer then
        logger.debug("could not read the next check-in: %s", exc)
        return others
    return [r for r in others if r not in ahead] or others


def _published_failure(guard: _Guard) -> dict[str, Any] | None:
    """The failure a peer published for the next check-in (see :func:`_poison_next`):
    a rank still waiting in the collective it gave up on (say, one that was frozen and
    resumed) learns it instead of waiting for ranks that left."""
    key = f"{guard.tag}/{guard.seq + 1}/in/verdict"
    try:
        if not guard.store.check([key]):
            return None
        value = _decode(guard.store.get(key))
    except Exception as exc:  # noqa: BLE001 - the bounds still apply
        logger.debug("could not read a published failure: %s", exc)
        return None
    return None if value == _OK else dict(json.loads(value))


def _poison_next(guard: _Guard, verdict: Mapping[str, Any]) -> None:
    """Make ``verdict`` the verdict of this group's next check-in: a rank that already
    left the failed collective (a gather's senders do not wait for its root) and waits
    there learns the failure at once instead of waiting for a rank that will not come."""
    key = f"{guard.tag}/{guard.seq + 1}/in/verdict"
    try:
        guard.store.compare_set(key, "", json.dumps(dict(verdict)))
    except Exception as exc:  # noqa: BLE001 - the others fall back on their own bounds
        logger.debug("could not publish the failure of a collective: %s", exc)


_FIRST_NAP_S = 0.0002  # polling a work: sleeps double from here ...
_QUICK_NAP_S = 0.001  # ... to here for the first _QUICK_S (a small collective of gloo's
_QUICK_S = 0.05  # takes 1-5 ms among 4 ranks: a 5 ms nap overshot it by 1.6 ms on average)
_LAST_NAP_S = 0.005  # ... then to here (a long gather or a slow peer)


# -- errors inside a backend collective ----------------------------------------------------


def wait_blocking(
    what: str, works: Sequence[Any], group: Any = None, peers: Sequence[int] | None = None
) -> None:
    """Wait for point-to-point ``works`` (``isend``/``irecv``) in the backend: gloo
    reports them complete only from ``wait()``, so they cannot be polled. A backend
    error (a peer's connection closed) becomes a :class:`RankLostError` naming the
    ranks of ``peers`` whose heartbeat stopped."""
    try:
        for work in works:
            if work is not None:  # None only for a rank outside ``group``
                work.wait()
    except RuntimeError as exc:
        if isinstance(exc, CollectiveError) or not torch_dist.is_initialized():
            raise
        raise lost_in_collective(what, exc, group, peers) from exc


def lost_in_collective(
    what: str, exc: BaseException, group: Any = None, peers: Sequence[int] | None = None
) -> RankLostError:
    """The error for a backend collective that failed: names the ranks whose heartbeat
    does not advance over a few heartbeat periods (bounded: about a second)."""
    guard = _guard(group)
    candidates = [r for r in (peers if peers is not None else guard.ranks) if r != guard.rank]
    bounds = current_bounds()
    dead: list[int] = []
    if bounds.heartbeat_timeout_s > 0:
        watcher = _Watcher(guard.store, 0.0)
        try:
            watcher.stopped(candidates)
            time.sleep(min(2.5 * _HEARTBEAT.interval, 5.0))
            dead = watcher.stopped(candidates)
        except Exception as store_error:  # noqa: BLE001 - name no rank then
            logger.debug("could not read heartbeats: %s", store_error)
    why = f"its connection closed or it stopped in the collective ({type(exc).__name__}: {exc})"
    named = "; ".join(f"rank {r}: process gone (heartbeat stopped)" for r in dead)
    return RankLostError(
        f"{what} failed on rank {guard.rank}: a peer left the collective"
        f"{': ' + named if named else ' (which one is unknown: no heartbeat stopped)'}; {why}",
        dict.fromkeys(dead, "process gone (heartbeat stopped)"),
    )
