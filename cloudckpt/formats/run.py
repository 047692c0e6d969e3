"""A format's save run on its own, without a commit: a strategy's ``save(sharded_state_dict,
checkpoint_dir)`` (Megatron-Core's signature) for callers that use a strategy directly.

:func:`save_uncommitted` plans, writes, and lets the coordinator finish from every rank's
payload, in the format's collectives and two of its own (the payloads gathered with every
rank's failure, the coordinator's verdict broadcast), so that a failure on any rank is
raised on every rank. The checkpoint has no manifest and no ``metadata.json``: those are
:func:`cloudckpt.save`'s (:mod:`cloudckpt.session`), which drives the same steps and
carries the payloads with its commit records instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudckpt import dist
from cloudckpt.formats.protocol import PlannedWrite, SaveFormat, Written

if TYPE_CHECKING:
    from cloudckpt.config import CheckpointConfig
    from cloudckpt.dist import Report
    from cloudckpt.mapping import ShardedStateDict
    from cloudckpt.storage import CheckpointStorage, WriteResult

COORDINATOR = 0


def save_uncommitted(
    fmt: SaveFormat,
    storage: CheckpointStorage,
    sharded_state_dict: ShardedStateDict,
    config: CheckpointConfig | None = None,
) -> list[WriteResult]:
    """Plan, write and finish this rank's part of a save in ``fmt`` (collective).

    Returns:
        This rank's write results (the coordinator's include the finish's).
    """
    planned = fmt.plan(storage, sharded_state_dict, config)
    return write_and_finish(planned, storage.uri)


def write_and_finish(planned: PlannedWrite, shown: str) -> list[WriteResult]:
    """Write this rank's part, then :func:`finish_written` (collective)."""
    error: BaseException | None = None
    written = Written()
    try:
        written = planned.write()
    except Exception as exc:  # noqa: BLE001 - every rank learns of it in the gather
        error = exc
    return finish_written(planned, written, error, shown)


def finish_written(
    planned: PlannedWrite, written: Written, error: BaseException | None, shown: str
) -> list[WriteResult]:
    """The coordinator's finish from every rank's payload (collective: a gather and a
    broadcast), after every rank's write (``written``, or this rank's ``error``). Raises
    on every rank when any rank's write, or the finish, failed. Returns this rank's
    write results (the coordinator's include the finish's)."""
    what = f"saving checkpoint {shown!r}"
    gathered = dist.gather_reported(error, written.payload, what, COORDINATOR)
    results = list(written.results)
    verdict: list[Report | None] | None = None
    own = error
    if gathered is not None:  # the coordinator
        reports = [report for report, _ in gathered]
        if any(report is not None for report in reports):
            verdict = reports
        else:
            try:
                results += planned.finish([payload for _, payload in gathered])
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                own = exc
                verdict = [dist.failure_report(exc)] + [None] * (len(reports) - 1)
        del gathered
    verdict = dist.broadcast_object(verdict, COORDINATOR, what=f"agreeing on finishing {shown!r}")
    if verdict is not None:
        dist.raise_reported(verdict, own, what)
    return results


__all__ = ["finish_written", "save_uncommitted", "write_and_finish"]
