"""A save's agreement before its claim, and its common state's checks.

:func:`agree_before_claim` carries, in one gather and one broadcast, the agreements on
opening and preparing, every rank's keys and sharding metadata for the coordinator's
checks, and the claim: nothing is written before every rank's keys passed. The common
state is serialized (:func:`serialize_common`) and compared across ranks
(:func:`warn_if_common_differs`) before the claim too, so that a value that cannot be
saved fails the save before anything is written.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from cloudckpt import dist
from cloudckpt.dict_utils import diff
from cloudckpt.errors import CheckpointingException, CommonStateError
from cloudckpt.formats.protocol import CommonSaver, SerializingCommonSaver
from cloudckpt.mapping import StateDict
from cloudckpt.shard_table import ShardTable
from cloudckpt.storage import WriteResult

logger = logging.getLogger(__name__)

COORDINATOR = 0


class PreparePhase(IntEnum):
    """The phases whose agreement travels with the gather of every rank's keys."""

    OPENING = 0
    PREPARING = 1


@dataclass(frozen=True)
class ClaimVerdict:
    """The coordinator's verdict on every rank's keys, broadcast to every rank.

    Attributes:
        failed_phase: the first phase some rank failed (None: none did).
        reports: every rank's failure report in that phase, by rank.
        checked: the coordinator's checks' error (the same on every rank).
        reference: the coordinator's common state as compared, pickled.
        digests: every rank's digest of its tensor entries, by rank.
    """

    failed_phase: PreparePhase | None = None
    reports: list[Any] = field(default_factory=list)
    checked: BaseException | None = None
    reference: bytes | None = None
    digests: list[bytes] = field(default_factory=list)


CoordinatorChecks = Callable[[Sequence[ShardTable]], tuple[WriteResult, bytes | None]]


def agree_before_claim(
    whats: tuple[str, str],
    phase: PreparePhase,
    error: BaseException | None,
    payload: tuple[ShardTable, bytes] | None,
    checks: CoordinatorChecks | None,
) -> tuple[WriteResult | None, Any, list[bytes]]:
    """Collective, two collectives for what took four (an agreement on opening, one on
    preparing, the gather of the keys and the verdict's broadcast): every rank sends
    the coordinator its ``payload`` (its :class:`ShardTable` and tensor digest), or its
    failure in ``phase`` (named by ``whats``, by phase); the coordinator runs ``checks``
    (which claim the URI) only when no rank failed, and broadcasts its
    :class:`ClaimVerdict`: the failures of the first phase that failed (raised on every
    rank as :func:`cloudckpt.dist.agree` raises them), or the checks' error (the same on
    every rank), or the coordinator's common state as compared and every rank's digest.
    Returns the claim (coordinator), that common state unpickled (the other ranks) and
    the digests."""
    gathered = dist.gather_reported(error, (phase, payload), whats[phase], COORDINATOR)
    verdict = ClaimVerdict()
    failure: BaseException | None = None
    claimed = None
    if gathered is not None:  # the coordinator
        failed = [ph for report, (ph, _) in gathered if report is not None]
        if failed:
            first = min(failed)
            reports = [rep if ph == first else None for rep, (ph, _) in gathered]
            verdict = ClaimVerdict(PreparePhase(first), reports)
        else:
            assert checks is not None  # a rank without checks failed to open
            tables = [pl[0] for _, (_, pl) in gathered]
            digests = [pl[1] for _, (_, pl) in gathered]
            reference = None
            try:
                claimed, reference = checks(tables)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                failure, reference = exc, None
            verdict = ClaimVerdict(None, [], _travelling(failure), reference, digests)
        del gathered  # before the collector runs again
    verdict = dist.broadcast_object(
        verdict, src=COORDINATOR, what="the checks of every rank's keys and the claim"
    )
    if verdict.failed_phase is not None:
        own = error if verdict.failed_phase == phase else None
        dist.raise_reported(verdict.reports, own, whats[verdict.failed_phase])
    if failure is not None:
        raise failure
    if verdict.checked is not None:
        raise verdict.checked
    if dist.get_rank() == COORDINATOR or verdict.reference is None:
        return claimed, None, verdict.digests
    return claimed, pickle.loads(verdict.reference), verdict.digests  # the coordinator's


def _travelling(error: BaseException | None) -> BaseException | None:
    """``error`` as it can travel to the other ranks: itself when it survives pickling,
    else a :class:`CheckpointingException` with its message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable error is sent as its message
        return CheckpointingException(f"{type(error).__name__}: {error}")


def warn_if_common_differs(reference: StateDict, mine: StateDict, shown: str) -> None:
    """Log at WARNING where this rank's common state (after the caller's preprocessing,
    which must not modify it) differs from rank 0's, in Megatron-Core's words (each
    mismatch as ``(key path, rank 0's type, this rank's type)``), then which checkpoint
    keeps rank 0's."""
    rank = dist.get_rank()
    only_rank0, only_here, mismatch = diff(reference, mine)
    if only_rank0 or only_here or mismatch:
        logger.warning(
            "Rank %d common state dict differs from rank 0 common state dict. "
            "Keys only on rank 0: %s, Keys only on %d: %s, Mismatched keys: %s",
            rank,
            only_rank0,
            rank,
            only_here,
            mismatch,
        )
        logger.warning("Only rank 0's common state is saved in %s", shown)


def serialize_common(saver: CommonSaver, common: StateDict, uri: str) -> bytes | None:
    """The common state's bytes, made before the claim so that a value that cannot be
    serialized fails before anything is written. A strategy without
    ``serialize_common`` (one written for Megatron-Core) serializes when it writes;
    the state is then pickled once here as a check, and None returned.

    Raises:
        CommonStateError: naming the key path of the value at fault, the rank and URI.
    """
    try:
        if isinstance(saver, SerializingCommonSaver):
            return saver.serialize_common(common)
        pickle.dumps(common)
        return None
    except Exception as exc:  # whatever the pickler raised, named
        raise common_state_error(common, exc, uri) from exc


def pickled_reference(compared: StateDict, uri: str) -> bytes:
    """The coordinator's common state as compared (after the caller's preprocessing),
    pickled for the other ranks' comparison.

    Raises:
        CommonStateError: naming the value that cannot be pickled."""
    try:
        return pickle.dumps(compared, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # whatever the pickler raised, named
        raise common_state_error(compared, exc, uri) from exc


def common_state_error(common: StateDict, exc: BaseException, uri: str) -> CommonStateError:
    """The error for a common state that failed to serialize with ``exc``: it names the
    first value found (depth first) that cannot be pickled alone."""
    path, value = _unpicklable_value(common, "")
    shown = f"the value at {path!r} (a {type(value).__name__})" if path else "it"
    return CommonStateError(
        f"rank {dist.get_rank()}: the common state of checkpoint {uri!r} cannot be "
        f"serialized: {shown} fails with {type(exc).__name__}: {exc}. Nothing was written; "
        "wrap such values in a LocalNonpersistentObject or leave them out",
        path,
    )


def _unpicklable_value(value: Any, path: str) -> tuple[str, Any]:
    """(dotted key path, value) of the first leaf below ``value`` that does not pickle;
    ("", None) when every leaf does."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - this is the value looked for
            return path, value
        return "", None
    for key, item in items:
        found = _unpicklable_value(item, f"{path}.{key}" if path else str(key))
        if found[0]:
            return found
    return "", None
