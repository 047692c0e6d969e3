"""Requests in flight: one pool per process, so ``max_in_flight`` bounds every request
the process makes (saves, loads, verify, gc, from any thread), and the helpers that run
many requests at once and stop early on the first failure."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Cancelled(Exception):
    """A queued request skipped because another request of the same call failed."""


class RequestPool:
    """Slots for requests in flight: every request (a whole-object PUT, one part, one
    ranged GET) holds one while it runs. Use :meth:`for_process` to get the process's
    pool for a given ``max_in_flight``.
    """

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.slots = threading.BoundedSemaphore(max_in_flight)

    @classmethod
    def for_process(cls, max_in_flight: int) -> RequestPool:
        """This process's pool of ``max_in_flight`` slots (a new one after a fork)."""
        key = (os.getpid(), max_in_flight)
        with _LOCK:
            pool = _POOLS.get(key)
            if pool is None:
                pool = _POOLS[key] = cls(max_in_flight)
            return pool

    def executor(self, tasks: int) -> ThreadPoolExecutor:
        """Threads for ``tasks`` requests of one call (never more than the slots)."""
        workers = max(1, min(self.max_in_flight, tasks))
        return ThreadPoolExecutor(workers, thread_name_prefix="cloudckpt-io")

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
    errors: list[BaseException] = field(default_factory=list)

    def settle_errors(self) -> None:
        """Collect the errors of its finished requests (skipped ones are not errors)."""
        self.errors.extend(
            exc
            for future in self.futures
            if (exc := future.exception()) is not None and not isinstance(exc, Cancelled)
        )
