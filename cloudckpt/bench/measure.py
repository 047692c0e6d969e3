"""What one rank of ``cloudckpt bench`` records (:class:`RankFigures`: the best round of
each phase, its CPU times, peak memory and requests) and how it measures a phase of
cloudckpt's: between barriers (:mod:`.clock`), with the process's peak resident memory
(Linux: ``VmHWM`` reset through ``/proc/self/clear_refs``; else ``ru_maxrss``, the peak
so far) and the storage requests it issued (cloudckpt's own counters)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cloudckpt.bench.clock import Clock, Span
from cloudckpt.storage.pool import process_stats


@dataclass
class RankFigures:
    """What one rank measured: seconds by phase (best round), the CPU seconds of the
    rank process and of the store's process in that round, peak RSS in bytes by phase,
    requests by phase, and objects written by phase (rank 0 only)."""

    server_pid: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    server_cpu: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    rss_growth: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    reads: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    share_bytes: int = 0
    rss_reset: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    def record(self, phase: str, seconds: float) -> None:
        """Keep the best time of a phase."""
        self.seconds[phase] = min(seconds, self.seconds.get(phase, float("inf")))

    def record_span(self, phase: str, span: Span) -> None:
        """Keep the best time of a phase, with the CPU times of that round."""
        if span.seconds < self.seconds.get(phase, float("inf")):
            self.cpu[phase] = span.cpu_s
            self.server_cpu.pop(phase, None)
            if span.server_cpu_s is not None:
                self.server_cpu[phase] = span.server_cpu_s
        self.record(phase, span.seconds)

    def timed(self, phase: str, fn: Callable[[], object]) -> float:
        """Run ``fn`` between barriers, record it as ``phase``; its seconds."""
        span = Clock(self.server_pid).span(fn)
        self.record_span(phase, span)
        return span.seconds


# -- memory ----------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``); False where it cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """This process's resident memory in bytes now (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """This process's peak resident memory in bytes since the last reset (or start)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _measured(figures: RankFigures, phase: str, fn: Callable[[], object]) -> None:
    """Time a cloudckpt phase, with its peak RSS and requests."""
    figures.rss_reset = reset_peak_rss()
    start = current_rss()
    before = process_stats()
    figures.timed(phase, fn)
    figures.peak_rss[phase] = max(peak_rss(), figures.peak_rss.get(phase, 0))
    growth = peak_rss() - start
    figures.rss_growth[phase] = max(growth, figures.rss_growth.get(phase, 0))
    counted = process_stats() - before
    figures.requests[phase] = counted.requests
    figures.reads[phase] = counted.reads
    figures.bytes_read[phase] = counted.bytes_read
