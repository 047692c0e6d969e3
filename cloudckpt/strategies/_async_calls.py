"""The machinery behind :class:`~cloudckpt.strategies.async_utils.AsyncCallsQueue`:
scheduled calls, the persistent worker thread, and Megatron-Core's ``AsyncCaller``
classes built on them (all re-exported by :mod:`cloudckpt.strategies.async_utils`,
whose docstring describes the threading model).
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from cloudckpt import dist
from cloudckpt.dist_bounds import Bounds
from cloudckpt.errors import CheckpointingException

logger = logging.getLogger(__name__)


class ScheduledRequest(Protocol):
    """What a scheduled call needs of its request
    (:class:`~cloudckpt.strategies.async_utils.AsyncRequest`)."""

    @property
    def async_fn(self) -> Callable[..., Any] | None: ...
    @property
    def async_fn_kwargs(self) -> Mapping[str, Any]: ...
    @property
    def finalize_fns(self) -> Sequence[Callable[[], Any]]: ...
    @property
    def call_idx(self) -> int: ...
    @property
    def bounds(self) -> Bounds: ...
    def resolved_args(self) -> tuple[Any, ...]: ...


@contextmanager
def _disable_gc() -> Iterator[None]:
    """Disable Python's garbage collector for the block (or decorated call), if enabled.

    Megatron-Core wraps the start of a background save in it; usable as a context
    manager or, being a ``contextlib`` manager, as a decorator (``@_disable_gc()``).
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _set_process_qos(cpu_priority: int | None, io_priority: int | None) -> None:
    """Lower the CPU and I/O priority of the calling thread (Megatron-Core's name).

    On Linux the nice value and the I/O priority belong to a thread, so called in a
    background save's worker thread this deprioritizes that thread only, and in a
    single-threaded helper process the whole process, as Megatron-Core's does in its
    writer processes. Failures are logged, never raised (lowering a priority again
    needs privileges).

    Args:
        cpu_priority: the target nice value (0-19, higher is lower priority); only
            raised, never lowered. None or out of range: unchanged.
        io_priority: the I/O scheduling class for ``ionice -c`` (1 realtime,
            2 best-effort, 3 idle). None: unchanged.
    """
    tid = threading.get_native_id()
    if cpu_priority is not None and 0 <= cpu_priority <= 19:
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            if cpu_priority > current:
                os.setpriority(os.PRIO_PROCESS, tid, cpu_priority)
                logger.debug("thread %d: nice %d -> %d", tid, current, cpu_priority)
            else:
                logger.debug("thread %d: nice %d already >= %d", tid, current, cpu_priority)
        except OSError as exc:
            logger.warning("thread %d: could not set the CPU priority: %s", tid, exc)
    if io_priority is not None:
        try:
            subprocess.run(
                ["ionice", "-c", str(io_priority), "-p", str(tid)], check=True, capture_output=True
            )
            logger.debug("thread %d: I/O scheduling class %d", tid, io_priority)
        except (OSError, subprocess.CalledProcessError) as exc:
            logger.warning("thread %d: could not set the I/O priority: %s", tid, exc)


@dataclass(frozen=True)
class WorkerQos:
    """The priorities a persistent worker thread sets for itself when it starts."""

    cpu_priority: int | None = None
    io_priority: int | None = None


_persistent_qos = WorkerQos()


def set_persistent_worker_qos(qos: WorkerQos) -> None:
    """The priorities of every persistent worker thread started from now on."""
    global _persistent_qos  # noqa: PLW0603 - process-wide, as Megatron-Core's worker
    _persistent_qos = qos


@dataclass
class _ScheduledCall:
    """One scheduled request: its resolved arguments, outcome and completion flag."""

    idx: int
    request: ScheduledRequest
    args: tuple[Any, ...] = ()
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)
    finished: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        """Run the async function; record its error instead of raising; mark finished."""
        fn = self.request.async_fn
        try:
            if fn is not None:
                fn(*self.args, **self.request.async_fn_kwargs)
        except BaseException as exc:  # noqa: BLE001 - re-raised at finalization
            self.error = exc
        finally:
            self.finished.set()

    def is_done(self) -> bool:
        return self.finished.is_set()

    def wait(self) -> None:
        self.finished.wait()


class _Worker:
    """One long-lived thread running calls in submission order (``persistent=True``)."""

    def __init__(self, name: str = "cloudckpt-async-worker") -> None:
        self.name = name
        self._inbox: queue.SimpleQueue[_ScheduledCall | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, call: _ScheduledCall) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=False)
            self._thread.start()
        self._inbox.put(call)

    def _loop(self) -> None:
        qos = _persistent_qos
        if qos != WorkerQos():
            _set_process_qos(qos.cpu_priority, qos.io_priority)
        while (call := self._inbox.get()) is not None:
            call.run()

    def stop(self) -> None:
        """Let the calls submitted so far finish, then end the thread."""
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
            self._thread = None


def _start(call: _ScheduledCall, worker: _Worker | None) -> None:
    """Stage the request's data (``preload_fn``, in this thread) and start its async function."""
    request = call.request
    if request.async_fn is None:
        call.finished.set()
        return
    with _disable_gc():
        call.args = request.resolved_args()
    if worker is not None:
        worker.submit(call)
        return
    thread = threading.Thread(
        target=call.run, name=f"cloudckpt-async-save-{call.idx}", daemon=False
    )
    thread.start()


class AsyncCaller(ABC):
    """Runs one async request at a time in the background (Megatron-Core's interface).

    :class:`AsyncCallsQueue` is what training code uses; callers are its building
    blocks, kept for code written against Megatron-Core. All methods are called from
    the training thread, on all ranks.
    """

    @abstractmethod
    def schedule_async_call(self, async_req: ScheduledRequest) -> None:
        """Start ``async_req`` in the background (after its ``preload_fn``)."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """True when the current call is done on every rank (on this one with ``no_dist``).

        A collective unless ``no_dist``. With ``blocking``, waits for it.

        Raises:
            CheckpointingException: the call's async function failed on this rank.
        """

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank reports a call still running (an integer all-reduce)."""
        return dist.all_reduce_int(int(is_alive), op="sum") == 0

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Wait for the calls started (threads cannot be killed, even with ``abort``)."""


class _SingleCallCaller(AsyncCaller):
    """The shared logic of the two callers: one current call, checked and reported."""

    def __init__(self) -> None:
        self._current: deque[_ScheduledCall] = deque()

    def _worker(self) -> _Worker | None:
        return None

    def schedule_async_call(self, async_req: ScheduledRequest) -> None:
        """Start ``async_req`` (must be called on all ranks, as in Megatron-Core)."""
        if async_req.async_fn is None:
            return
        call = _ScheduledCall(async_req.call_idx, async_req)
        _start(call, self._worker())
        self._current.append(call)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """See :meth:`AsyncCaller.is_current_async_call_done`."""
        call = self._current[0] if self._current else None
        if call is not None and blocking:
            call.wait()
        alive = int(call is not None and not call.is_done())
        if no_dist:
            done = not alive
        else:  # within the call's bounds (see async_utils' docstring), else the defaults
            with dist.bounded(call.request.bounds if call is not None else None):
                done = self.sync_all_async_calls(alive)
        if done and call is not None:
            self._current.popleft()
            if call.error is not None:
                raise CheckpointingException(
                    f"async checkpoint call {call.idx} failed: {type(call.error).__name__}: "
                    f"{call.error}"
                ) from call.error
        return done

    def close(self, abort: bool = False) -> None:
        """Wait for every call started; report none of their errors."""
        for call in self._current:
            call.wait()
        self._current.clear()


class TemporalAsyncCaller(_SingleCallCaller):
    """A new background thread per call (Megatron-Core forks a process per call)."""


class PersistentAsyncCaller(_SingleCallCaller):
    """One long-lived background thread running the calls in order (Megatron-Core: a
    spawned worker process)."""

    def __init__(self) -> None:
        super().__init__()
        self._persistent = _Worker()

    def _worker(self) -> _Worker | None:
        return self._persistent

    def close(self, abort: bool = False) -> None:
        """Wait for the calls started, then end the worker thread."""
        super().close(abort)
        self._persistent.stop()
