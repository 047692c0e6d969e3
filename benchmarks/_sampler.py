"""A sampling profiler for every thread of this process (py-spy and yappi are not
installed here; cProfile sees only the thread that started it): a daemon thread takes
``sys._current_frames()`` every ``interval_s`` and counts, per sample of a thread that
is not waiting, the innermost frame of the thread's stack ("self") and every frame on
it ("total"). Waiting threads (a lock, a queue, ``select``/``epoll``) are counted
apart, so the table shows where CPU-bound Python time goes.

    with Sampler() as sampler:
        work()
    print(sampler.report())
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType, TracebackType

# innermost frames that mean "this thread is blocked, not computing"
IDLE = frozenset(
    {
        "wait",
        "_wait_for_tstate_lock",
        "select",
        "poll",
        "_worker",
        "get",
        "sleep",
        "run_forever",
        "_run_once",
        "acquire",
        "result",
    }
)


def _where(frame: FrameType) -> str:
    code = frame.f_code
    name = code.co_filename.rsplit("site-packages/", 1)[-1].rsplit("/cloudckpt/", 1)[-1]
    return f"{name}:{code.co_name}"


class Sampler:
    """Samples every thread but its own, every ``interval_s`` seconds."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.self_counts: collections.Counter[str] = collections.Counter()
        self.total_counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.busy = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                self.samples += 1
                if frame.f_code.co_name in IDLE:
                    continue
                self.busy += 1
                self.self_counts[_where(frame)] += 1
                seen = set()
                f: FrameType | None = frame
                while f is not None:
                    where = _where(f)
                    if where not in seen:
                        self.total_counts[where] += 1
                        seen.add(where)
                    f = f.f_back

    def report(self, top: int = 25) -> str:
        """The busiest frames by self and by total samples (share of busy samples)."""
        busy = max(self.busy, 1)
        lines = [f"{self.busy} busy thread samples of {self.samples} (interval {self.interval_s}s)"]
        for title, counts in (("self", self.self_counts), ("total", self.total_counts)):
            lines.append(f"-- top {top} by {title} --")
            lines += [f"{100 * n / busy:6.1f}%  {where}" for where, n in counts.most_common(top)]
        return "\n".join(lines)


def timed_profile(fn: object, interval_s: float = 0.005) -> tuple[float, Sampler]:
    """Run ``fn()`` under a sampler; seconds taken and the sampler."""
    with Sampler(interval_s) as sampler:
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        return time.perf_counter() - start, sampler
