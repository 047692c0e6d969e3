"""Run a function on N local CPU ranks joined in a gloo process group.

Used by ``cloudckpt demo`` and by the multi-rank tests. Ranks are real processes
(``spawn`` start method), rendezvous goes through a ``TCPStore`` that the parent
process hosts (as torchrun's agent does: no rank hosts it, and the parent binds a free
port itself, so there is no port race), and a failure on any rank is reported with that
rank's traceback. A ``FileStore`` would also do, but it polls its file every 10 ms:
cloudckpt's check-in barrier (:mod:`cloudckpt.dist_guard`) cost 28 ms per collective of
4 ranks on one, against 10 ms on a ``TCPStore`` (9 ms without the check-in).

Two entry points:

* :func:`run_on_ranks` starts a group, runs one function on every rank, stops it.
* :class:`RankPool` keeps a group alive and runs many functions on it, which saves
  the start-up cost (importing torch, rendezvous) when many scenarios run in a row.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from cloudckpt.errors import DistributedCheckpointError

logger = logging.getLogger(__name__)

_STOP = "__stop__"
_STORE_HOST = "127.0.0.1"
_AFTER_DEAD_RANK_S = 10.0  # how long the others may still report after a rank died


def _init_group(rank: int, world_size: int, store_port: int) -> None:
    import torch.distributed as torch_dist  # noqa: PLC0415 - imported in the rank process only

    store = torch_dist.TCPStore(_STORE_HOST, store_port, is_master=False)  # type: ignore[attr-defined]
    torch_dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _worker(rank: int, world_size: int, store_port: int, tasks: Any, results: Any) -> None:
    """Rank main loop: take (fn, args) tasks until told to stop; report each outcome."""
    import torch.distributed as torch_dist  # noqa: PLC0415 - imported in the rank process only

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _init_group(rank, world_size, store_port)
    try:
        while True:
            task = tasks.get()
            if task == _STOP:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - every failure is reported to the parent
                results.put((rank, False, traceback.format_exc()))
    finally:
        torch_dist.destroy_process_group()


def _host_store() -> Any:
    """A TCPStore served by this process on a free loopback port (port 0: the kernel's
    choice, read back from the store)."""
    import torch.distributed as torch_dist  # noqa: PLC0415 - only where ranks are started

    # public in torch.distributed, which does not declare it exported
    return torch_dist.TCPStore(_STORE_HOST, 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]


class RankPool:
    """A persistent group of ``world_size`` gloo ranks that runs functions on demand.

    Args:
        world_size: number of rank processes.
        timeout_s: seconds to wait for all ranks to finish one function.

    Functions passed to :meth:`run` must be picklable (module-level) and take
    ``(rank, world_size, *args)``. A pool whose ranks time out is unusable; close it.
    """

    def __init__(self, world_size: int, timeout_s: float = 300.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self._store = _host_store()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, self._store.port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        self._broken = False
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; return results by rank.

        Raises:
            DistributedCheckpointError: a rank raised or did not finish within
                ``timeout_s``; the message and ``failures`` hold every traceback
                received and name the ranks that did not answer.
        """
        outcomes = self.run_each(fn, *args)
        failures = {r: out for r, (ok, out) in enumerate(outcomes) if not ok}
        if failures:
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            raise DistributedCheckpointError(
                f"{getattr(fn, '__name__', fn)} failed on ranks {sorted(failures)}:\n{detail}",
                failures,
            )
        return [value for _, value in outcomes]

    def run_each(self, fn: Callable[..., Any], *args: Any) -> list[tuple[bool, Any]]:
        """Like :meth:`run`, but return every rank's outcome instead of raising:
        ``(True, value)``, or ``(False, why)`` for a rank that raised (its traceback),
        died (``rank process ... died``) or did not finish within ``timeout_s``."""
        for q in self._tasks:
            q.put((fn, args))
        outcomes, missing = self._collect()
        for rank in missing:
            outcomes[rank] = (False, f"did not finish within {self.timeout_s:.0f} s")
        return [outcomes[r] for r in range(self.world_size)]

    @property
    def pids(self) -> list[int | None]:
        """The rank processes' ids, by rank."""
        return [p.pid for p in self._procs]

    def _collect(self) -> tuple[dict[int, tuple[bool, Any]], list[int]]:
        """Outcomes received by rank, and the ranks that sent none within ``timeout_s``."""
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        dead_since: dict[int, float] = {}
        while len(outcomes) < self.world_size:
            left = deadline - time.monotonic()
            try:
                rank, ok, payload = self._results.get(timeout=max(min(left, 1.0), 0))
            except queue.Empty:
                if left <= 0:
                    return outcomes, sorted(set(range(self.world_size)) - set(outcomes))
                if self._note_dead_ranks(outcomes, dead_since):
                    # the group is broken: the others' collectives cannot complete
                    deadline = min(deadline, time.monotonic() + _AFTER_DEAD_RANK_S)
                continue
            outcomes[rank] = (ok, payload)
        return outcomes, []

    def _note_dead_ranks(
        self, outcomes: dict[int, tuple[bool, Any]], dead_since: dict[int, float]
    ) -> bool:
        """A rank process that exited without reporting (killed, crashed) fails at once
        instead of after ``timeout_s``: a second later (its last report may be in flight).
        Returns whether one did; the pool is then unusable (``close`` kills the rest)."""
        now = time.monotonic()
        found = False
        for rank, proc in enumerate(self._procs):
            if rank in outcomes or proc.exitcode is None:
                continue
            if now - dead_since.setdefault(rank, now) >= 1.0:
                code = proc.exitcode
                how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                outcomes[rank] = (False, f"rank process {proc.pid} died ({how})")
                self._broken = found = True
        return found

    def close(self) -> None:
        """Stop the ranks (forcefully if they do not stop within a few seconds)."""
        for q in self._tasks:
            q.put(_STOP)
        for p in self._procs:
            p.join(timeout=0 if self._broken else 10)
            if p.is_alive():
                p.kill()
                p.join()
        del self._store  # stops serving

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout_s: float = 600.0
) -> list[Any]:
    """Start ``world_size`` gloo ranks, run ``fn(rank, world_size, *args)`` on each, stop them.

    Returns:
        The return values, indexed by rank.
    """
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args)
