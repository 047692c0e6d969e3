"""The coordinator's large temporary arrays without numpy's transparent huge page
advice (:func:`without_huge_page_advice`, entered by :func:`cloudckpt.dist.coordinating`
where a save or load begins). numpy is imported only when the switch is used: the
commands that handle no arrays import no numpy."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any


class _HugePageAdvice:
    """numpy's huge page advice, turned off while at least one user is inside."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = True

    def enter(self, setter: Callable[[bool], Any]) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = bool(setter(False))
            self._users += 1

    def leave(self, setter: Callable[[bool], Any]) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                setter(self._saved)


_ADVICE = _HugePageAdvice()


@contextlib.contextmanager
def without_huge_page_advice() -> Iterator[None]:
    """Within: numpy does not advise transparent huge pages for new arrays (usable as a
    decorator too).

    numpy advises huge pages (``madvise(MADV_HUGEPAGE)``) for every array of 4 MiB and
    more. Where the kernel's ``transparent_hugepage/defrag`` is ``madvise`` (a common
    default), faulting such an array in may wait for the kernel to reclaim and compact
    memory (numpy/numpy#31590). The coordinator's steps at scale make many short-lived
    arrays of tens of MB: at 4,096 simulated ranks x 2,000 tensors, running them without
    it took 7.59 s to 5.56-6.02 (5.57 with the advice off for the whole process;
    ``benchmarks/bench_simulate.py``). So the coordinator's save or load runs without
    it (:func:`cloudckpt.dist.coordinating`): the pages the kernel gives without advice.
    Left as it is where the process sets ``NUMPY_MADVISE_HUGEPAGE`` (its own choice) or
    numpy has no such switch. The switch
    is numpy's, for the whole process: arrays other threads make meanwhile (the training
    loop's, during an async save's finish) get no advice either, only the kernel's
    default pages. Nested and concurrent uses share it: the first in turns the advice
    off, the last out restores it."""
    setter = _advice_setter()
    if setter is None:
        yield
        return
    _ADVICE.enter(setter)
    try:
        yield
    finally:
        _ADVICE.leave(setter)


def _advice_setter() -> Callable[[bool], Any] | None:
    """numpy's (private) switch of its huge page advice; None where the process chose
    it (``NUMPY_MADVISE_HUGEPAGE``) or numpy has none."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return None
    setter: Callable[[bool], Any] | None = getattr(_multiarray(), "_set_madvise_hugepage", None)
    return setter


def numpy_advises_huge_pages() -> bool | None:
    """Whether numpy advises huge pages for new large arrays now; None where numpy
    cannot say (no such query)."""
    getter = getattr(_multiarray(), "_get_madvise_hugepage", None)
    return None if getter is None else bool(getter())


def _multiarray() -> Any:
    """numpy's ``multiarray`` module, imported on first use (commands that handle no
    arrays import no numpy)."""
    try:
        return importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        return importlib.import_module("numpy.core.multiarray")


__all__ = ["numpy_advises_huge_pages", "without_huge_page_advice"]
