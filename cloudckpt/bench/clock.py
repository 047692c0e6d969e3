"""Where a phase's time goes: wall time between barriers, and the CPU time spent in it
by the rank process (every thread) and by the store's process when it runs on this host.

On a host whose cores are all busy, a phase is bound by CPU, not by the store or the
network: the sum of every process's CPU seconds is close to wall x cores, and one
client's CPU seconds per GB moved is what decides its speed. That is the figure which
tells a Python-bound client from a store-bound one ("profile, not a guess").
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Span:
    """One timed phase on one rank.

    Attributes:
        seconds: wall time from a barrier before the phase to the barrier after it.
        cpu_s: the rank process's CPU time (user + system, all threads) in that time.
        server_cpu_s: the store process's CPU time in that time (None: not measured).
    """

    seconds: float
    cpu_s: float
    server_cpu_s: float | None = None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux
    ``/proc/PID/stat``); None where it cannot be read (no /proc, the process gone)."""
    try:
        return cpu_of_stat(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def cpu_of_stat(stat: str) -> float | None:
    """User + system CPU seconds of a ``/proc/PID/stat`` line (None: not one)."""
    # the command name (field 2) is parenthesised and may hold spaces and parentheses:
    # the fields after it start past the last ")"
    fields = stat.rpartition(")")[2].split()
    try:
        ticks = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    except (IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def busy(cpu_s: float, server_cpu_s: float | None, seconds: float, cores: int) -> float:
    """How busy a phase kept the host: its CPU seconds (clients' and, where measured, the
    store's) over its wall time x the host's cores (near 1.0: bound by this host's CPUs)."""
    return (cpu_s + (server_cpu_s or 0.0)) / (seconds * cores)


@dataclass(frozen=True)
class Clock:
    """Times phases between barriers of the default process group.

    Attributes:
        server_pid: the store's process on this host, whose CPU is measured too
            (None: a remote store or local files).
    """

    server_pid: int | None = None

    def span(self, fn: Callable[[], object]) -> Span:
        """Run ``fn`` between two barriers; its wall and CPU times."""
        torch.distributed.barrier()
        server = self._server_cpu()
        cpu = time.process_time()
        start = time.perf_counter()
        fn()
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
        cpu_s = time.process_time() - cpu
        after = self._server_cpu()
        server_s = None if server is None or after is None else after - server
        return Span(seconds, cpu_s, server_s)

    def _server_cpu(self) -> float | None:
        if self.server_pid is None:
            return None
        found = process_cpu_seconds(self.server_pid)
        if found is None:
            logger.warning("cloudckpt bench: no CPU time for server pid %d", self.server_pid)
        return found
