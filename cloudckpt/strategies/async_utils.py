"""Background checkpoint saves: :class:`AsyncRequest` and :class:`AsyncCallsQueue`.

An async save has two parts. The *async function* persists data that is already
staged in host memory (it uploads bytes and may take minutes); the *finalize
functions* run afterwards in the training thread, once the async function is done
on **every** rank (for example, to write ``metadata.json`` and commit).

Threads, not processes
    :class:`AsyncCallsQueue` runs each async function in a background thread of the
    training process. Checkpoint writes are network and disk I/O, which releases the
    GIL, so a thread does not stall training; and a thread shares the host-staged
    tensors with the training thread, so nothing is copied or pickled, whereas a
    forked process would duplicate the address space (and any fsspec or CUDA state)
    and a spawned one would need every tensor serialised to it. The threads are not
    daemons: interpreter exit waits for a running save instead of cutting it off.
    ``AsyncCallsQueue()`` starts one thread per request (Megatron-Core's temporal
    worker process); ``AsyncCallsQueue(persistent=True)`` runs the requests one after
    another in one long-lived worker thread (Megatron-Core's persistent worker).

Preloading
    A request's ``preload_fn`` (Megatron-Core's device-to-host staging) runs in the
    caller's thread when the request is scheduled or executed; its result replaces the
    second positional argument of ``async_fn`` (Megatron-Core's convention: the
    staged write buckets of :class:`~cloudckpt.strategies.filesystem_async.FileSystemWriterAsync`).

Bounds
    A request carries the collective bounds in force when it was made
    (:attr:`AsyncRequest.bounds`: inside ``save``, those of the save's config:
    ``collective_timeout_s``, ``heartbeat_timeout_s``), and every collective made for it
    afterwards runs within them: the queue's agreement on it, its finalize functions
    (the commit), :meth:`AsyncRequest.execute_sync`, the callers' checks. A rank lost
    during the upload is then named within the save's ``heartbeat_timeout_s`` (was: the
    default 15 s, since the queue ran outside the save's ``dist.bounded`` block). The
    async function itself runs no collective (see below) and needs none.

Threading contract
    Every method of :class:`AsyncCallsQueue` must be called from one thread, the
    training (main) thread; the queue takes no locks. The async function runs in a
    worker thread, so it must not touch the queue and must not run collectives on a
    process group the training thread uses (two threads in one collective sequence
    corrupt it). :meth:`AsyncCallsQueue.schedule_async_request` and
    :meth:`AsyncCallsQueue.maybe_finalize_async_calls` must be called on all ranks,
    for the same requests and in the same order: finalization is agreed across ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Self

from cloudckpt import dist
from cloudckpt.dist_bounds import Bounds, current_bounds
from cloudckpt.errors import (
    CheckpointingException,
    DistributedCheckpointError,
    UnknownAsyncStrategyError,
)
from cloudckpt.strategies._async_calls import (
    AsyncCaller,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    WorkerQos,
    _disable_gc,
    _ScheduledCall,
    _set_process_qos,
    _start,
    _Worker,
    set_persistent_worker_qos,
)

logger = logging.getLogger(__name__)

ASYNC_STRATEGIES = ("nvrx", "mcore")
"""The ``async_strategy`` values of Megatron-Core 0.19: NVIDIA Resiliency Extension's
async machinery, or Megatron-Core's own. cloudckpt accepts both and runs its own for
either (threads uploading to any store, see above): NVRx's writer forks processes that
write POSIX files, which an object store is not."""


def check_async_strategy(async_strategy: str | None) -> None:
    """Accept Megatron-Core 0.19's ``async_strategy`` values (and None).

    Raises:
        UnknownAsyncStrategyError: any other value (a ``TypeError``, as Megatron-Core's).
    """
    if async_strategy is not None and async_strategy not in ASYNC_STRATEGIES:
        raise UnknownAsyncStrategyError(
            f"unknown async_strategy {async_strategy!r}: expected one of "
            f"{', '.join(ASYNC_STRATEGIES)} (cloudckpt runs its own async save for either)"
        )


FinalizeFn = Callable[[], Any]


@dataclass(frozen=True)
class AsyncRequest:
    """An async save: a function to run in the background and the steps that finish it.

    As in Megatron-Core, :meth:`add_finalize_fn` appends to the request in place and
    returns ``None`` (``req.add_finalize_fn(fn)``). The fields themselves cannot be
    reassigned; ``finalize_fns`` is a list owned by the request (a copy of the one
    given), extended only through :meth:`add_finalize_fn`. :meth:`freeze` returns a
    frozen copy, to which nothing can be added; scheduling freezes the request.

    Args:
        async_fn: persists the data; called as ``async_fn(*async_fn_args,
            **async_fn_kwargs)``. ``None`` means there is nothing to persist, only to
            finalize.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: zero-argument callables run in order, in the caller's thread,
            after ``async_fn`` is done on every rank. Copied into a new list.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: stages the data to persist (Megatron-Core: device to host); its
            result replaces ``async_fn_args[1]`` (see the module docstring).
        is_frozen: once True, no finalize function can be added.
        call_idx: the index the queue gave the request when scheduling it.
        bounds: the bounds of the collectives made for the request after it was
            made (see the module docstring); by default those in force where it is
            made (:func:`~cloudckpt.dist_bounds.current_bounds`: a ``save``'s config).

    The field order is Megatron-Core's (its AsyncRequest is a NamedTuple), and
    ``_replace``, ``_asdict`` and ``_fields`` work as on it (``bounds``, cloudckpt's
    own, comes last and is not among ``_fields``; ``_replace`` keeps it).
    """

    async_fn: Callable[..., Any] | None
    async_fn_args: tuple[Any, ...]
    finalize_fns: list[FinalizeFn] = field(default_factory=list)
    async_fn_kwargs: Mapping[str, Any] = field(default_factory=dict)
    preload_fn: Callable[[], Any] | None = None
    is_frozen: bool = False
    call_idx: int = 0
    bounds: Bounds = field(default_factory=current_bounds)

    _fields: ClassVar[tuple[str, ...]] = (
        "async_fn",
        "async_fn_args",
        "finalize_fns",
        "async_fn_kwargs",
        "preload_fn",
        "is_frozen",
        "call_idx",
    )

    def _replace(self, **changes: Any) -> AsyncRequest:
        """A copy with ``changes`` (NamedTuple's ``_replace``)."""
        return dataclasses.replace(self, **changes)

    def _asdict(self) -> dict[str, Any]:
        """The fields by name (NamedTuple's ``_asdict``; shallow, no copies)."""
        return {name: getattr(self, name) for name in self._fields}

    def resolved_args(self) -> tuple[Any, ...]:
        """``async_fn``'s positional arguments, the second one from ``preload_fn`` if set.

        Raises:
            CheckpointingException: ``preload_fn`` is set but there is no second argument.
        """
        if self.preload_fn is None:
            return self.async_fn_args
        if len(self.async_fn_args) < 2:
            raise CheckpointingException(
                "an AsyncRequest with preload_fn needs at least two async_fn_args (the "
                "second is replaced by what preload_fn returns)"
            )
        return (self.async_fn_args[0], self.preload_fn(), *self.async_fn_args[2:])

    def __post_init__(self) -> None:
        # Normalise what callers give (Megatron passes lists); copy so that the
        # caller's list and the request never alias.
        object.__setattr__(self, "async_fn_args", tuple(self.async_fn_args))
        object.__setattr__(self, "finalize_fns", list(_as_sequence(self.finalize_fns)))
        object.__setattr__(self, "async_fn_kwargs", dict(self.async_fn_kwargs))

    def add_finalize_fn(self, fn: FinalizeFn) -> None:
        """Append ``fn`` to this request's finalize functions (in place, as Megatron-Core).

        Args:
            fn: a zero-argument callable, run after the existing finalize functions.

        Raises:
            CheckpointingException: the request is frozen (it was already scheduled),
                or ``fn`` is not callable.
        """
        if self.is_frozen:
            raise CheckpointingException(
                "cannot add a finalize function to a frozen AsyncRequest "
                "(it has been scheduled already)"
            )
        if not callable(fn):
            raise CheckpointingException(
                f"AsyncRequest.add_finalize_fn needs a callable, got {type(fn).__name__}"
            )
        self.finalize_fns.append(fn)

    def freeze(self) -> AsyncRequest:
        """Return a frozen copy of this request (its own list of finalize functions).

        Adding a finalize function to the copy raises; this request stays unfrozen
        and later additions to it do not reach the copy.
        """
        return dataclasses.replace(self, is_frozen=True)

    def execute_sync(self) -> None:
        """Run the request to completion in the caller's thread.

        Runs ``preload_fn`` and ``async_fn``, then agrees with the other ranks that it succeeded
        everywhere (a collective, so every rank must call this; without a process
        group it is local), then runs every finalize function in order.

        Raises:
            DistributedCheckpointError: ``async_fn`` failed on some rank (more than one
                rank in the group).
            Exception: in a world of one rank, the error ``async_fn`` raised, as is;
                an error raised by a finalize function, as is.
        """
        with dist.bounded(self.bounds):
            with dist.agree("synchronous execution of an async request"):
                if self.async_fn is not None:
                    self.async_fn(*self.resolved_args(), **self.async_fn_kwargs)
            for fn in self.finalize_fns:
                fn()


def _as_sequence(fns: Sequence[FinalizeFn] | FinalizeFn) -> Sequence[FinalizeFn]:
    if callable(fns):
        raise CheckpointingException(
            "AsyncRequest.finalize_fns must be a sequence of callables, not one callable"
        )
    return fns


class AsyncCallsQueue:
    """Runs async save requests in background threads and finalizes them across ranks.

    Typical use in a training loop::

        idx = queue.schedule_async_request(strategy.async_save(sharded_sd, uri))
        ...
        queue.maybe_finalize_async_calls()          # every step: cheap, non-blocking
        ...
        queue.close()                               # at exit: wait and finalize all

    Calls are finalized in scheduling order, and a call is finalized only when it and
    every call scheduled before it are done on every rank. Creating a queue starts
    no thread and touches no process group. See the module docstring for the
    threading contract (all methods from the training thread; scheduling and
    finalization on all ranks).
    """

    def __init__(self, persistent: bool = False) -> None:
        """
        Args:
            persistent: run the async functions one after another in one long-lived
                worker thread (ended by :meth:`close`) instead of a thread per request.
        """
        self._calls: deque[_ScheduledCall] = deque()
        self._next_idx = 0
        self.persistent = persistent
        self._worker = _Worker() if persistent else None

    @classmethod
    def warmup_persistent_caller(
        cls,
        rank: int,
        mp_mode: str = "spawn",
        cpu_priority: int | None = 10,
        io_priority: int | None = None,
    ) -> None:
        """Megatron-Core 0.19's: prepare the persistent worker of every queue.

        Megatron-Core starts its worker process here; cloudckpt's worker is a thread,
        started at the first request, so there is nothing to start ahead. The
        priorities are those the persistent worker threads give themselves when they
        start (see :func:`_set_process_qos`): the uploads then yield the CPU to
        training. ``rank`` and ``mp_mode`` (the process start method) are checked
        and otherwise unused: no process is started.

        Raises:
            ValueError: ``mp_mode`` is not a multiprocessing start method.
        """
        if mp_mode not in ("spawn", "fork", "forkserver"):
            raise ValueError(
                f"rank {rank}: mp_mode {mp_mode!r} is not a start method (spawn, fork, forkserver)"
            )
        set_persistent_worker_qos(WorkerQos(cpu_priority, io_priority))

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Freeze ``async_request``, run its ``preload_fn`` and start its async function
        in a background thread (the persistent worker with ``persistent=True``).

        Args:
            async_request: the request; a request without ``async_fn`` starts no thread
                and is finalized at the next check.

        Returns:
            The call index (0, 1, 2, ... in scheduling order), used in logs, errors
            and the return value of :meth:`maybe_finalize_async_calls`.
        """
        request = async_request._replace(is_frozen=True, call_idx=self._next_idx)
        call = _ScheduledCall(self._next_idx, request)
        _start(call, self._worker)
        self._next_idx += 1
        self._calls.append(call)
        logger.debug("scheduled async checkpoint call %s", call.idx)
        return call.idx

    def maybe_finalize_async_calls(
        self, blocking: bool = False, no_dist: bool = False
    ) -> list[int]:
        """Finalize, in scheduling order, the calls whose async function is done on every rank.

        With a process group and ``no_dist=False`` this is a collective (two integer
        all-reduces; none when nothing is scheduled): every rank must call it, and
        all ranks finalize the same calls.

        Args:
            blocking: wait for every scheduled call to finish (on every rank) and
                finalize them all; otherwise return at once with what is done.
            no_dist: decide on this rank's calls alone, without collectives.

        Returns:
            The indices of the calls finalized by this call, in order.

        Raises:
            CheckpointingException: the async function of the next call failed (on
                this rank; chained to its error) or a finalize function raised; the
                message names the call index (cloudckpt's own errors, such as a
                ``StorageError`` of the upload, are raised as they are). The failed call is dropped;
                calls scheduled after it stay queued. With a process group (and
                ``no_dist=False``) the error is a :class:`DistributedCheckpointError`
                raised on every rank, naming the ranks that failed.
            CollectiveError: a rank was lost or stayed away, named within the
                request's bounds (``RankLostError`` / ``CollectiveTimeoutError``).
        """
        if not self._calls:
            return []
        if blocking:
            for call in self._calls:
                call.wait()
        agree = dist.is_distributed() and not no_dist
        with dist.bounded(self._calls[0].request.bounds):  # the next call's, on every rank
            n_done = self._agree(self._count_done(), agree)
            n_ok = self._agree(self._count_succeeded(n_done), agree)
        finalized: list[int] = []
        for _ in range(n_ok):
            call = self._calls.popleft()
            with dist.bounded(call.request.bounds):
                self._finalize(call)
            finalized.append(call.idx)
        if n_ok < n_done:
            call = self._calls.popleft()
            with dist.bounded(call.request.bounds):
                self._raise_failure(call, agree)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet (running or done)."""
        return len(self._calls)

    def close(self, abort: bool = False) -> None:
        """Wait for every scheduled call and finalize it (a collective, like a blocking check).

        Args:
            abort: wait for the running async functions but finalize nothing and run
                no collective: the calls are dropped. For a rank that is failing.

        With ``persistent=True`` the worker thread ends too.
        """
        if abort:
            for call in self._calls:
                call.wait()
            if self._calls:
                logger.warning(
                    "dropping %s async checkpoint call(s) without finalizing them: %s",
                    len(self._calls),
                    [call.idx for call in self._calls],
                )
            self._calls.clear()
            self._stop_worker()
            return
        try:
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            self._stop_worker()

    def _stop_worker(self) -> None:
        """End the persistent worker thread (a later request starts a new one)."""
        if self._worker is not None:
            self._worker.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Finalize everything on a clean exit; on an exception only wait and drop."""
        self.close(abort=exc_type is not None)

    def _count_done(self) -> int:
        """Length of the leading run of calls whose async function finished here."""
        count = 0
        for call in self._calls:
            if not call.is_done():
                break
            count += 1
        return count

    def _count_succeeded(self, n_done: int) -> int:
        """Position of the first failed call among the first ``n_done`` (or ``n_done``)."""
        for pos, call in enumerate(list(self._calls)[:n_done]):
            if call.error is not None:
                return pos
        return n_done

    @staticmethod
    def _agree(value: int, agree: bool) -> int:
        return dist.all_reduce_int(value, op="min") if agree else value

    @staticmethod
    def _finalize(call: _ScheduledCall) -> None:
        """Run the call's finalize functions. cloudckpt's own errors propagate as they
        are (a ``RankLostError`` or ``CommitConflictError`` of the commit keeps its kind
        and already names the checkpoint and the ranks); any other error becomes a
        ``CheckpointingException`` naming the call."""
        for fn in call.request.finalize_fns:
            try:
                fn()
            except CheckpointingException:
                raise
            except Exception as exc:
                raise CheckpointingException(
                    f"finalization of async checkpoint call {call.idx} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        logger.debug(
            "finalized async checkpoint call %s (%.2f s after scheduling)",
            call.idx,
            time.monotonic() - call.started,
        )

    @staticmethod
    def _raise_failure(call: _ScheduledCall, agree: bool) -> None:
        what = f"async checkpoint call {call.idx}"
        if agree and dist.get_world_size() > 1:
            # Every rank reaches this point for the same call: exchange the errors.
            dist.raise_if_any_rank_failed(call.error, what)
            raise DistributedCheckpointError(f"{what} failed on another rank")
        error = call.error
        if isinstance(error, CheckpointingException):  # its kind kept: a StorageError
            raise error  # (ENOSPC) stays one; it names the checkpoint and the rank
        raise CheckpointingException(f"{what} failed: {type(error).__name__}: {error}") from error


__all__ = [
    "ASYNC_STRATEGIES",
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncRequest",
    "FinalizeFn",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
    "_disable_gc",
    "_set_process_qos",
    "check_async_strategy",
]
