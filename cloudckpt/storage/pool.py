"""Requests in flight: one pool per process, so ``max_in_flight`` bounds every request
the process makes (saves, loads, verify, gc, from any thread), and the helpers that run
many requests at once and stop early on the first failure.

The bound adapts (:class:`AdaptiveLimit`): while the store throttles (503 SlowDown,
429) the number of requests in flight is halved, at most once per round of requests,
and it grows back by one per round of successes up to ``max_in_flight`` (AIMD, as TCP
does with its window), so a throttled save slows down instead of spending its retries.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloudckpt.storage.blocks import BlockCrcs, PartChecksum, join_parts
from cloudckpt.storage.retry import RequestCounters, RequestStats
from cloudckpt.storage.types import WriteResult

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Cancelled(Exception):
    """A queued request skipped because another request of the same call failed."""


class AdaptiveLimit:
    """At most :attr:`limit` requests in flight, between 1 and ``maximum``: a context
    manager holding one slot (``with limit as ticket:``).

    :meth:`throttled` halves the limit, once per round: a throttling answer to a
    request that started before the last decrease (an older ``ticket``) does not lower
    it again. :meth:`succeeded` raises it by one after ``limit`` successes.
    """

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.limit = maximum
        self._in_flight = 0
        self._round = 0  # bumped by every decrease
        self._credit = 0  # successes since the last change
        self._changed = threading.Condition()

    def __enter__(self) -> int:
        with self._changed:
            while self._in_flight >= self.limit:
                self._changed.wait()
            self._in_flight += 1
            return self._round

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._in_flight -= 1
            self._changed.notify()

    def throttled(self, ticket: int) -> None:
        """The store throttled a request that held ``ticket``: halve the limit."""
        with self._changed:
            if ticket != self._round or self.limit == 1:
                return
            before, self.limit = self.limit, max(1, self.limit // 2)
            self._round += 1
            self._credit = 0
        logger.info(
            "the store is throttling requests: at most %d in flight now (was %d, of %d)",
            self.limit,
            before,
            self.maximum,
        )

    def succeeded(self) -> None:
        """A request succeeded: after ``limit`` of them, one more may be in flight."""
        with self._changed:
            if self.limit >= self.maximum:
                return
            self._credit += 1
            if self._credit < self.limit:
                return
            self._credit = 0
            self.limit += 1
            limit = self.limit
            self._changed.notify()
        if limit == self.maximum:
            logger.info("requests in flight back at %d: the store no longer throttles", limit)
        else:
            logger.debug("requests in flight raised to %d of %d", limit, self.maximum)


class RequestPool:
    """Slots for requests in flight: every request (a whole-object PUT, one part, one
    ranged GET) holds one of :attr:`slots` while it runs, and lowers the limit while
    the store throttles. :attr:`counters` counts the process's retried requests. Use
    :meth:`for_process` to get the process's pool for a given ``max_in_flight``.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.slots = AdaptiveLimit(max_in_flight)
        self.counters = RequestCounters()
        self._executors = _Executors(max_in_flight)

    @classmethod
    def for_process(cls, max_in_flight: int) -> RequestPool:
        """This process's pool of ``max_in_flight`` slots (a new one after a fork)."""
        key = (os.getpid(), max_in_flight)
        with _LOCK:
            pool = _POOLS.get(key)
            if pool is None:
                pool = _POOLS[key] = cls(max_in_flight)
            return pool

    def executor(self, tasks: int) -> AbstractContextManager[ThreadPoolExecutor]:
        """Threads for ``tasks`` requests of one call (never more than the slots), as
        a context manager: leaving it waits for every task submitted meanwhile.

        The threads are kept for the next call (starting 16 threads per call cost
        0.4 s of a 4-rank local load, 2 loaded cores); a call made while another holds
        the kept threads (a request that itself runs requests) gets threads of its
        own, so nested calls cannot wait on each other's queue.
        """
        return self._executors.lease()

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """Apply ``fn`` to ``items``, at most ``max_in_flight`` at once.

        After the first failure, calls not yet started are skipped; the first error is
        raised once the running ones have finished.
        """
        if len(items) <= 1 or self.max_in_flight == 1:
            return [fn(item) for item in items]
        cancel = threading.Event()
        with self.executor(len(items)) as pool:
            futures = [pool.submit(guarded, cancel, fn, item) for item in items]
            wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, Cancelled):
                raise error
        return [f.result() for f in futures]


class _LeasedExecutor(ThreadPoolExecutor):
    """A thread pool lent to one call at a time: it remembers the tasks of the
    current lease, so that the lease can end by waiting for them (not by a shutdown,
    which would end the threads)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, thread_name_prefix="cloudckpt-io")
        self.leased: list[Future[Any]] = []

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        future = super().submit(fn, *args, **kwargs)
        self.leased.append(future)
        return future


class _Executors:
    """Idle :class:`_LeasedExecutor` s of one pool, lent one per call."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._idle: list[_LeasedExecutor] = []
        self._lock = threading.Lock()

    @contextmanager
    def lease(self) -> Iterator[ThreadPoolExecutor]:
        with self._lock:
            executor = self._idle.pop() if self._idle else _LeasedExecutor(self.workers)
        try:
            yield executor
        finally:
            wait(executor.leased)
            executor.leased = []
            with self._lock:
                self._idle.append(executor)


def process_stats() -> RequestStats:
    """Requests, retries and failures by kind of every pool of this process so far."""
    with _LOCK:
        pools = [pool for (pid, _), pool in _POOLS.items() if pid == os.getpid()]
    return sum((pool.counters.snapshot() for pool in pools), RequestStats())


# The process's pools, by (pid, max_in_flight): the one piece of shared state of the
# storage layer, since the bound it enforces is per process by definition.
_POOLS: dict[tuple[int, int], RequestPool] = {}
_LOCK = threading.Lock()


def guarded(cancel: threading.Event, fn: Callable[..., R], *args: Any) -> R:
    """Run ``fn`` unless ``cancel`` is set; set it when ``fn`` fails."""
    if cancel.is_set():
        raise Cancelled
    try:
        return fn(*args)
    except BaseException:
        cancel.set()
        raise


@dataclass
class PendingWrite:
    """One object of a ``write_many`` call while its requests are in flight."""

    relpath: str
    view: memoryview
    futures: list[Future[Any]]
    upload_id: str | None = None  # S3 multipart uploads only
    crc: int | None = None
    blocks: BlockCrcs | None = None
    block_size: int = 0  # multipart uploads: a divisor of the part size
    parts: dict[int, PartChecksum] = field(default_factory=dict)  # by part number
    errors: list[BaseException] = field(default_factory=list)

    def result(self) -> WriteResult:
        """What was written: size, CRC-32C and block CRCs (of a multipart upload:
        combined from its parts', with no second pass over the bytes)."""
        if self.parts:
            ordered = [self.parts[number] for number in sorted(self.parts)]
            self.crc, self.blocks = join_parts(ordered, self.block_size)
        return WriteResult(self.relpath, self.view.nbytes, self.crc or 0, self.blocks)

    def settle_errors(self) -> None:
        """Collect the errors of its finished requests (skipped ones are not errors)."""
        self.errors.extend(
            exc
            for future in self.futures
            if (exc := future.exception()) is not None and not isinstance(exc, Cancelled)
        )
