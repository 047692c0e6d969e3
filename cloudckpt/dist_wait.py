"""Waiting inside a backend collective, bounded: :func:`await_works` polls the backend's
asynchronous collectives while it watches the peers' heartbeats, :func:`wait_blocking`
waits for point-to-point ones, and :func:`lost_in_collective` names the peers lost
when the backend fails one. A peer that dies or freezes after it checked in at the
barrier (:mod:`cloudckpt.dist_guard`) is thus named within ``heartbeat_timeout_s``
instead of leaving the others blocked until the process group's timeout.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as torch_dist

from cloudckpt.dist_bounds import WAIT_SLICE_S, current_bounds
from cloudckpt.dist_group import _OK, _decode, _Guard, _guard, _verdict_error
from cloudckpt.dist_heartbeat import _HEARTBEAT, _Watcher
from cloudckpt.errors import CollectiveError, RankLostError

logger = logging.getLogger(__name__)


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
