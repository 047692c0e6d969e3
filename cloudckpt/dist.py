"""The seam between cloudckpt and ``torch.distributed``.

Every collective cloudckpt needs goes through this module, and each one also works
when no process group is initialised: then the world is one rank (rank 0) and the
collectives are identities. Object collectives use the default group unless one
is passed.

Every collective is bounded (:mod:`cloudckpt.dist_guard`): the ranks first check in
at a barrier in the process group's store, so a rank that is gone or silent makes
the others raise a :class:`~cloudckpt.errors.CollectiveError` naming it (within
``heartbeat_timeout_s`` for a killed or frozen rank, ``collective_timeout_s`` at
most) instead of waiting for the backend's own timeout (gloo's is 30 minutes).
"""

from __future__ import annotations

import gc
import logging
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as torch_dist

from cloudckpt import dist_guard, dist_objects
from cloudckpt.dist_guard import bounded
from cloudckpt.dist_wait import await_works, wait_blocking
from cloudckpt.errors import (
    CheckpointingException,
    CollectiveError,
    DistributedCheckpointError,
    distributed_variant,
)
from cloudckpt.huge_pages import without_huge_page_advice

__all__ = [
    "agree",
    "all_gather_object",
    "all_reduce_int",
    "barrier",
    "bounded",
    "await_collective",
    "broadcast_object",
    "check_in",
    "coordinating",
    "exchange_tensors",
    "gather_object",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "failure_report",
    "gather_reported",
    "paused_gc",
    "raise_if_any_rank_failed",
    "raise_reported",
    "run_on_coordinator",
    "scatter_object",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
ReduceOp = Literal["min", "max", "sum"]
_REDUCE_OPS = {
    "min": torch_dist.ReduceOp.MIN,
    "max": torch_dist.ReduceOp.MAX,
    "sum": torch_dist.ReduceOp.SUM,
}


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    return torch_dist.is_available() and torch_dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return torch_dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return torch_dist.get_world_size(group) if is_distributed() else 1


def barrier(group: Any = None, what: str = "barrier") -> None:
    """Wait for every rank of ``group``; a no-op in a world of one."""
    if is_distributed():
        dist_guard.check_in(what, group)
        await_works(what, [torch_dist.barrier(group, async_op=True)], group)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector in the block (re-entrant).

    Unpickling every rank's metadata makes millions of objects at once, and each
    collection the allocations trigger walks all of them again: with thousands of
    ranks that is most of the time a gather and its checks take (5x for the unpickling
    alone, measured with ``benchmarks/bench_simulate.py``). Objects are still freed by
    reference counting; cycles made in the block are collected after it. Let the
    gathered objects go before the block ends, so that no collection walks them later.

    ``cloudckpt.save`` and ``cloudckpt.load`` run whole in it: a training process holds
    millions of objects, and every collection a checkpoint's allocations trigger walks
    them (a scattered DCP plan took 0.22 s to unpickle with the collector on, 7 ms
    paused). A process that turned the collector off (Megatron-Core's ``--manual-gc``)
    keeps it off.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def coordinating() -> AbstractContextManager[None]:
    """The scope of a save's or load's work: on the coordinator (rank 0), numpy gives
    new arrays no transparent huge page advice in it (see
    :func:`~cloudckpt.huge_pages.without_huge_page_advice`); elsewhere nothing changes.

    The coordinator's steps over every rank's metadata (the checks, the format's global
    plan and finish, the manifest) make many short-lived arrays of tens of MB, whose
    advised page faults may wait for the kernel to compact memory. Entered where the
    work begins: ``cloudckpt.save`` and ``cloudckpt.load`` run whole in it, and an async
    save's commit (its finalize function, run later by the queue)."""
    return without_huge_page_advice() if get_rank() == 0 else nullcontext()


def of_group(per_rank: list[_T], group: Any = None) -> list[_T]:
    """The entries of ``per_rank`` (one per rank of the world, by global rank) that
    belong to ``group``'s ranks, in group rank order; all of them for the default group."""
    if group is None or not is_distributed() or group is torch_dist.group.WORLD:
        return per_rank
    return [per_rank[rank] for rank in torch_dist.get_process_group_ranks(group)]


def all_gather_object(obj: Any, group: Any = None, what: str = "all_gather_object") -> list[Any]:
    """Gather one picklable object from every rank, indexed by rank (unpickled with the
    garbage collector paused, see :func:`paused_gc`). ``what`` names the collective in
    a :class:`~cloudckpt.errors.CollectiveError`."""
    if not is_distributed():
        return [obj]
    dist_guard.check_in(what, group)
    with paused_gc():
        return dist_objects.all_gather_objects(what, obj, group)


def gather_object(
    obj: Any, dst: int = 0, group: Any = None, what: str = "gather_object"
) -> list[Any] | None:
    """Gather one picklable object from every rank on global rank ``dst``, indexed by
    group rank; None on the other ranks."""
    if not is_distributed():
        return [obj]
    dist_guard.check_in(what, group)
    with paused_gc():
        return dist_objects.gather_objects(what, obj, dst, group)


def scatter_object(
    objs: list[Any] | None, src: int = 0, group: Any = None, what: str = "scatter_object"
) -> Any:
    """Element ``i`` of global rank ``src``'s ``objs`` (one per rank of ``group``) on
    group rank ``i``; ``objs`` is ignored on the other ranks."""
    if not is_distributed():
        assert objs is not None and len(objs) == 1, objs
        return objs[0]
    dist_guard.check_in(what, group)
    with paused_gc():
        return dist_objects.scatter_objects(what, objs, src, group)


def broadcast_object(
    obj: Any, src: int = 0, group: Any = None, what: str = "broadcast_object"
) -> Any:
    """Return ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    dist_guard.check_in(what, group)
    with paused_gc():
        return dist_objects.broadcast_object(what, obj, src, group)


def all_reduce_int(
    value: int, op: ReduceOp = "sum", group: Any = None, what: str = "all_reduce_int"
) -> int:
    """Reduce one integer across ranks with ``op`` ("min", "max" or "sum")."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=dist_objects.device_of(group))
    dist_guard.check_in(what, group)
    await_works(
        what, [torch_dist.all_reduce(t, op=_REDUCE_OPS[op], group=group, async_op=True)], group
    )
    return int(t.item())


def check_in(what: str, group: Any = None) -> None:
    """Wait until every rank of ``group`` arrived here (bounded: see
    :func:`cloudckpt.dist_guard.check_in`), before a series of tensor collectives run
    with :func:`await_collective`; a no-op in a world of one."""
    if is_distributed():
        dist_guard.check_in(what, group)


def await_collective(what: str, work: Any, group: Any = None) -> None:
    """Wait for an asynchronous tensor collective (``async_op=True``) of ``group``,
    bounded as cloudckpt's own collectives are (:func:`cloudckpt.dist_wait.await_works`)."""
    if is_distributed():
        await_works(what, [work], group)


def raise_if_any_rank_failed(error: BaseException | None, what: str, group: Any = None) -> None:
    """Collective: every rank learns whether any rank failed ``what``, and raises if so.

    Each rank passes the exception it caught (or None). If any rank failed, every rank
    raises a :class:`DistributedCheckpointError` naming the failed ranks and their
    errors, so no rank is left waiting in a later collective. When every failed rank
    raised the same kind of :class:`CheckpointingException` (say a
    ``CommitConflictError``), the error raised on every rank is also of that kind, so
    ``except CommitConflictError`` works on the ranks that did not see it themselves.
    In a world of one the local exception is raised unchanged.
    """
    _gather_reports(error, None, what, group)


def all_gather_agreed(what: str, compute: Callable[[], Any], group: Any = None) -> list[Any]:
    """Collective: run ``compute`` on every rank and gather its results, indexed by rank,
    in the collective that also lets every rank learn whether any rank failed in it
    (one collective where :func:`agree` followed by :func:`all_gather_object` makes
    two). If a rank failed, every rank raises as :func:`raise_if_any_rank_failed` does.
    ``compute`` must not itself call a collective (see :func:`agree`)."""
    error: BaseException | None = None
    value: Any = None
    try:
        value = compute()
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    return _gather_reports(error, value, what, group)


def _gather_reports(
    error: BaseException | None, value: Any, what: str, group: Any = None
) -> list[Any]:
    """All-gather ``(this rank's failure report, value)``; raise on every rank if any
    rank failed (see :func:`raise_if_any_rank_failed`), else return the values."""
    report = Report.of(error)
    with _own_failure_named(error, report, group):
        gathered = all_gather_object((report, value), group, what=f"agreeing on {what}")
    raise_reported([rep for rep, _ in gathered], error, what, group)
    return [v for _, v in gathered]


@contextmanager
def _own_failure_named(
    error: BaseException | None, report: Report | None, group: Any = None
) -> Iterator[None]:
    """A :class:`CollectiveError` in the block also names this rank's own ``error``."""
    try:
        yield
    except CollectiveError as lost:
        if error is not None:  # this rank's own failure goes with the lost ranks
            summary = report.summary if report is not None else ""
            lost.args = (f"{lost}; rank {get_rank(group)} itself failed: {summary}",)
            lost.errors[get_rank(group)] = error
        raise lost from error


def failure_report(error: BaseException | None) -> Report | None:
    """``error`` as it travels to the other ranks in an agreement (None: no failure)."""
    return Report.of(error)


def gather_reported(
    error: BaseException | None, value: Any, what: str, dst: int = 0, group: Any = None
) -> list[tuple[Report | None, Any]] | None:
    """Collective, the first half of an agreement carried by a gather: gather
    ``(this rank's failure report, value)`` on rank ``dst`` (None elsewhere), which
    decides and sends its verdict in a collective of its own (a broadcast); every rank
    then calls :func:`raise_reported` with the reports of the verdict. Every rank
    learns of any rank's failure as with :func:`agree`, in the collectives the phase
    needed anyway."""
    report = Report.of(error)
    with _own_failure_named(error, report, group):
        return gather_object((report, value), dst, group, what=f"agreeing on {what}")


def raise_reported(
    reports: list[Report | None], error: BaseException | None, what: str, group: Any = None
) -> None:
    """Raise on every rank if any rank failed ``what`` (``reports``: every rank's
    failure report, by rank; ``error``: this rank's own failure), as
    :func:`raise_if_any_rank_failed` does; return when none did."""
    failed = {r: rep for r, rep in enumerate(reports) if rep is not None}
    if not failed:
        return
    if error is not None and (get_world_size(group) == 1 or _already_agreed(reports)):
        raise error
    lines = "; ".join(f"rank {r}: {rep.summary}" for r, rep in sorted(failed.items()))
    message = f"{what} failed on {len(failed)} of {len(reports)} rank(s): {lines}"
    kind = _common_kind([rep.error for rep in failed.values()])
    raised = kind(message, {r: rep.summary for r, rep in failed.items()})
    raised.errors = {r: rep.error for r, rep in failed.items() if rep.error is not None}
    _keep_errno(raised, [rep.error for rep in failed.values()])
    raise raised from error


@contextmanager
def agree(what: str, group: Any = None) -> Iterator[None]:
    """Collective: run the block on every rank, then let every rank learn whether any
    rank failed in it; if one did, every rank raises (see :func:`raise_if_any_rank_failed`).

    The block must not itself call a collective that a failing rank would skip: a rank
    that raises goes straight to the agreement while its peers would still wait in the
    skipped collective. Only :class:`Exception` is caught; ``KeyboardInterrupt`` and
    ``SystemExit`` propagate at once.

    Example::

        with dist.agree(f"opening checkpoint {uri!r}"):
            storage = open_checkpoint(uri)      # may fail on one rank only
        gathered = dist.all_gather_object(...)  # every rank gets here, or none does
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it
        error = exc
    raise_if_any_rank_failed(error, what, group)


def run_on_coordinator(fn: Callable[[], _T], what: str, src: int = 0, group: Any = None) -> _T:
    """Collective: run ``fn`` on rank ``src`` only and return its result on every rank.

    One rank does the I/O (one listing instead of one per rank); when it fails, every
    rank raises, naming ``src``. The result must be picklable.
    """
    if not is_distributed():
        return fn()
    outcome: tuple[bool, Any] = (True, None)
    error: BaseException | None = None
    if get_rank(group) == src:
        try:
            outcome = (True, fn())
            pickle.dumps(outcome)  # fails here, not inside the broadcast the others wait in
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
            outcome = (False, Report.of(exc))
    ok, payload = broadcast_object(outcome, src=src, group=group, what=what)
    if ok:
        result: _T = payload
        return result
    kind = _common_kind([payload.error])
    raised = kind(f"{what} failed on rank {src}: {payload.summary}", {src: payload.summary})
    raised.errors = {src: payload.error} if payload.error is not None else {}
    _keep_errno(raised, [payload.error])
    raise raised from error


@dataclass(frozen=True)
class Report:
    """One rank's failure as it travels to the others: a summary line, and the
    exception itself when it survives pickling (else None)."""

    summary: str
    error: BaseException | None
    agreed: bool  # already raised on every rank by an inner agreement

    @classmethod
    def of(cls, error: BaseException | None) -> Report | None:
        if error is None:
            return None
        agreed = isinstance(error, DistributedCheckpointError)
        portable = None if agreed else _portable(error)
        return cls(f"{type(error).__name__}: {error}", portable, agreed)


def _portable(error: BaseException) -> BaseException | None:
    """``error`` if it pickles and unpickles (so a peer can rebuild it), else None."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - an exception that does not travel is summarised
        return None
    return error


def _already_agreed(reports: list[Report | None]) -> bool:
    """True when every rank failed with an error an inner agreement already raised on
    every rank (re-raise it instead of wrapping it again)."""
    return all(rep is not None and rep.agreed for rep in reports)


def _common_kind(errors: list[BaseException | None]) -> type[DistributedCheckpointError]:
    """The error class to raise on every rank: the failed ranks' common
    CheckpointingException class mixed into DistributedCheckpointError, else the latter."""
    kinds = {type(e) for e in errors}
    if len(kinds) != 1:
        return DistributedCheckpointError
    kind = kinds.pop()
    if not issubclass(kind, CheckpointingException) or issubclass(kind, DistributedCheckpointError):
        return DistributedCheckpointError
    return distributed_variant(kind)


def _keep_errno(raised: DistributedCheckpointError, errors: list[BaseException | None]) -> None:
    """An ``OSError`` kind raised on every rank (a ``StorageError``) gets the errno its
    failed ranks' errors share (``ENOSPC`` on each rank that filled its disk)."""
    numbers = {getattr(e, "errno", None) for e in errors}
    number = numbers.pop() if len(numbers) == 1 else None
    if isinstance(raised, OSError) and isinstance(number, int):
        raised.errno = number


Transfer = tuple[int, int, torch.Tensor]  # (peer rank, tag, tensor)


def exchange_tensors(sends: list[Transfer], recvs: list[Transfer], group: Any = None) -> None:
    """Send and receive tensors point-to-point; returns when all transfers are done.

    Each transfer is ``(peer, tag, tensor)``; a send to rank B with tag t matches B's
    receive from this rank with tag t. Received data lands in the given tensors (CPU
    tensors are staged through the GPU when the group uses NCCL). Tensors travel as
    raw bytes, so every dtype (bfloat16, bool) works on every backend.
    """
    if not sends and not recvs:
        return
    device = dist_objects.device_of(group)
    pending: list[Any] = []
    for peer, tag, tensor in sends:
        payload = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        pending.append(torch_dist.isend(payload, peer, group=group, tag=tag))
    staged = []
    for peer, tag, tensor in recvs:
        buffer = torch.empty(
            tensor.numel() * tensor.element_size(), dtype=torch.uint8, device=device
        )
        staged.append((buffer, tensor))
        pending.append(torch_dist.irecv(buffer, peer, group=group, tag=tag))
    peers = sorted({peer for peer, _, _ in sends} | {peer for peer, _, _ in recvs})

    wait_blocking("exchanging tensors", pending, group, peers)
    for buffer, tensor in staged:
        tensor.reshape(-1).view(torch.uint8).copy_(buffer)
