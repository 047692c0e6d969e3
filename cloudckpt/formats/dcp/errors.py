"""PyTorch DCP's failures as cloudckpt's errors.

``torch.distributed.checkpoint`` gathers every rank's exception of a save into one
``CheckpointException``, raised on every rank. That class derives from
``BaseException``, so a training loop's ``except Exception`` (and cloudckpt's own
handlers) would let it through. :class:`TorchDistSaveError` is both a
:class:`~cloudckpt.errors.DistributedCheckpointError` (so a ``CheckpointingException``
and an ``Exception``) and PyTorch's ``CheckpointException``, so code written for
either catches it.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from cloudckpt.errors import DistributedCheckpointError


class TorchDistSaveError(DistributedCheckpointError, CheckpointException):
    """A torch_dist save failed on some ranks; raised on every rank.

    ``failures`` maps each failed rank to a one-line summary and ``errors`` to the
    exception it raised (as :class:`~cloudckpt.errors.DistributedCheckpointError`);
    ``dcp_failures`` keeps PyTorch's ``{rank: (exception, stack)}``.
    """

    @property
    def failures(self) -> dict[int, Any]:
        """Rank -> what failed there."""
        return self._failures

    @failures.setter
    def failures(self, value: dict[int, Any]) -> None:
        self._failures = value

    def __str__(self) -> str:  # cloudckpt's message, not CheckpointException's dump
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> Any:
        return (type(self), (str(self), dict(self.failures)))


def save_failure(exc: CheckpointException, uri: str) -> TorchDistSaveError:
    """The :class:`TorchDistSaveError` for DCP's ``exc`` of a save to ``uri``
    (redacted already): it names each failed rank and its error."""
    pairs: Mapping[int, Any] = exc.failures
    errors = {rank: _error_of(pair) for rank, pair in sorted(pairs.items())}
    summaries = {rank: f"{type(e).__name__}: {e}" for rank, e in errors.items()}
    listing = "; ".join(f"rank {rank}: {text}" for rank, text in summaries.items())
    error = TorchDistSaveError(
        f"saving checkpoint {uri!r} (torch_dist) failed on {len(errors)} rank(s) "
        f"{sorted(errors)}: {listing}",
        summaries,
    )
    error.errors = dict(errors)
    error.dcp_failures = dict(pairs)  # type: ignore[attr-defined]
    return error


def _error_of(pair: Any) -> BaseException:
    """The exception of one of DCP's ``(exception, stack)`` pairs."""
    if isinstance(pair, tuple) and pair and isinstance(pair[0], BaseException):
        return pair[0]
    return RuntimeError(str(pair) if not isinstance(pair, traceback.StackSummary) else "")
