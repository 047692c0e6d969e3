"""Save sessions: one checkpoint opened once, its format driven through the format
protocol (:mod:`cloudckpt.formats.protocol`), the phases run in order.

A :class:`SaveSession` resolves the format and the common saver, opens the storage and
checks the destination. A save then runs, on every rank:

1. prepare (:meth:`SaveSession._prepare`, two collectives): apply factories, split the
   state dict, serialize the common state, gather every rank's keys on the coordinator,
   which checks them and claims the URI (:func:`~cloudckpt.save_checks.agree_before_claim`);
2. plan (the format's collectives); the common state (coordinator) and, for formats that
   do not write them, the ShardedObjects;
3. write (no collective);
4. commit (two collectives, :meth:`PendingSave.commit`): every rank's commit record and
   the format's payload gathered on the coordinator, which finishes the format
   (torch_dist: ``.metadata``) and commits (:func:`~cloudckpt.commit.commit_gathered`)
   only when no rank failed; its :class:`CommitVerdict` is broadcast and raised on every
   rank.

A sync save (:meth:`SaveSession.save`) runs the steps inline; an async save
(:meth:`SaveSession.save_async`) runs 1 and 2 in the call (a format that stages itself
copies the tensors to host memory in its plan; the other writes go to host memory,
:class:`~cloudckpt.storage.staging.StagingStorage`) and returns 3 as its request's
function and 4 as its finalization. A failure on one rank before the commit travels to
the commit's gather; every rank raises it there, and nothing is committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from cloudckpt import dist
from cloudckpt.commit import commit_gathered, require_empty, tensor_piece, write_claim
from cloudckpt.config import CheckpointConfig
from cloudckpt.core import CheckpointingConfig
from cloudckpt.dict_utils import extract_matching_values, nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.foreign import common_saver_of, save_format_of
from cloudckpt.formats.protocol import (
    CommonSaver,
    PlannedWrite,
    SaveFormat,
    SerializingCommonSaver,
    Written,
)
from cloudckpt.keys import KeyLayout
from cloudckpt.manifest import (
    CommitRecord,
    Manifest,
    TensorEntry,
    common_key_paths,
    tensors_digest,
    tensors_text,
)
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factories,
)
from cloudckpt.redact import redact_uri
from cloudckpt.save_checks import (
    PreparePhase,
    agree_before_claim,
    pickled_reference,
    serialize_common,
    warn_if_common_differs,
)
from cloudckpt.session_support import log_rate, logged_failure, logger, open_storage
from cloudckpt.shard_table import ShardTable, check_metadata
from cloudckpt.storage import CheckpointStorage, WriteResult
from cloudckpt.storage.limits import path_limits
from cloudckpt.storage.staging import StagingStorage
from cloudckpt.strategies.async_utils import AsyncRequest
from cloudckpt.strategies.base import SaveCommonStrategy, SaveShardedStrategy, StorageBackedMixin
from cloudckpt.table_validation import check_gathered_tables

COORDINATOR = 0

PreprocessCommon = Callable[[StateDict], StateDict]
"""``save``'s ``preprocess_common_before_consistancy_check``: common state -> what is
compared across ranks (it must not modify its argument)."""


@dataclass(frozen=True)
class StateParts:
    """A state dict (factories applied) split for a save; nonpersistent values dropped.

    Attributes:
        objects: the ShardedObjects.
        tensors: the ShardedTensors.
        common: everything else (saved by the coordinator).
        sharded: objects and tensors together.
    """

    objects: ShardedStateDict
    tensors: ShardedStateDict
    common: StateDict
    sharded: ShardedStateDict

    @classmethod
    def of(cls, sharded_state_dict: ShardedStateDict) -> StateParts:
        """Split ``sharded_state_dict``."""
        _, persistent = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
        )
        sharded, common = extract_matching_values(persistent, lambda v: isinstance(v, ShardedBase))
        objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
        return cls(objects, tensors, common, sharded)


@dataclass(frozen=True)
class Prepared:
    """A save prepared and agreed on (:meth:`SaveSession._prepare`).

    Attributes:
        parts: the state dict's parts.
        common_bytes: the serialized common state (coordinator; None: the common
            saver serializes it when it writes).
        claimed: the claim's write result (coordinator; None elsewhere).
        entries: this rank's tensor entries for the manifest.
        digests: every rank's digest of its tensor entries, by rank (replicas send
            their entries to the commit once, a piece each).
    """

    parts: StateParts
    common_bytes: bytes | None
    claimed: WriteResult | None
    entries: list[TensorEntry]
    digests: list[bytes]


class CommitPhase(IntEnum):
    """Where a save failed, as its commit's verdict says."""

    WRITE = 0
    """a rank failed before the commit (plan, write; the coordinator: the format's
    finish)."""
    COMMIT = 1
    """the coordinator failed to commit."""


@dataclass(frozen=True)
class CommitVerdict:
    """The coordinator's verdict on a save, broadcast to every rank.

    Attributes:
        phase: where it failed.
        reports: every rank's failure report, by rank.
    """

    phase: CommitPhase
    reports: list[Any]


@dataclass(frozen=True)
class SaveSession:
    """A save into one checkpoint URI (collective: every rank opens one).

    Attributes:
        uri: the checkpoint URI as given (for strategies that do their own I/O).
        storage: the storage every write of this save goes through.
        format: the sharded strategy's format.
        common: the common saver.
        backends: what ``metadata.json`` will record.
        config: the save's config (chunk sizes), if any.
    """

    uri: str
    storage: CheckpointStorage
    format: SaveFormat
    common: CommonSaver
    backends: CheckpointingConfig
    config: CheckpointConfig | None

    @classmethod
    def open(
        cls,
        uri: str,
        sharded_strategy: SaveShardedStrategy,
        common_strategy: SaveCommonStrategy,
        *,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
    ) -> SaveSession:
        """Open ``uri`` for a save; the coordinator checks that nothing is there.
        Collective: a failure on any rank is raised on every rank."""
        with dist.agree(f"opening checkpoint {redact_uri(uri)!r}"):
            storage = open_storage(uri, sharded_strategy, storage_options, config)
            if dist.get_rank() == COORDINATOR:
                require_empty(storage)
        return cls._of(uri, storage, sharded_strategy, common_strategy, config)

    @classmethod
    def open_unagreed(
        cls,
        uri: str,
        sharded_strategy: SaveShardedStrategy,
        common_strategy: SaveCommonStrategy,
        *,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
    ) -> SaveSession | UnopenedSave:
        """:meth:`open` without its agreement: a failure to open (on the coordinator:
        a destination that is not empty) is this rank's, and travels with the gather
        of every rank's keys in :meth:`save` or :meth:`save_async` (an
        :class:`UnopenedSave` takes part in it, then raises), which raises it on every
        rank before anything is written. Saves the collective that the agreement costs."""
        try:
            storage = open_storage(uri, sharded_strategy, storage_options, config)
            if dist.get_rank() == COORDINATOR:
                require_empty(storage)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the save
            fmt = save_format_of(sharded_strategy, uri)
            return UnopenedSave(uri, fmt, common_saver_of(common_strategy, uri), exc)
        return cls._of(uri, storage, sharded_strategy, common_strategy, config)

    @classmethod
    def _of(
        cls,
        uri: str,
        storage: CheckpointStorage,
        sharded_strategy: SaveShardedStrategy,
        common_strategy: SaveCommonStrategy,
        config: CheckpointConfig | None,
    ) -> SaveSession:
        """The session of an opened ``storage``."""
        fmt = save_format_of(sharded_strategy, uri)
        backends = CheckpointingConfig(
            fmt.traits.name, fmt.traits.version, common_strategy.backend, common_strategy.version
        )
        common = common_saver_of(common_strategy, uri)
        return cls(uri, storage, fmt, common, backends, config)

    def save(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> Manifest | None:
        """Prepare, plan, write and commit, inline. Collective. Returns the manifest on
        the coordinator."""
        pending = self.start(sharded_state_dict, validate, preprocess_common, staged=False)
        pending.write()
        return pending.commit()

    def save_async(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> AsyncRequest:
        """Prepare and plan now, staging this rank's data in host memory; return the
        request whose ``async_fn`` uploads it and whose finalize function commits.
        Collective (and so is finalizing)."""
        _refuse_unstageable(self.format, self.common, self.storage.uri)
        pending = self.start(sharded_state_dict, validate, preprocess_common, staged=True)
        return AsyncRequest(pending.upload, (), [pending.finalize])

    def start(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool,
        preprocess_common: PreprocessCommon | None,
        *,
        staged: bool,
    ) -> PendingSave:
        """Steps 1 and 2 of a save (see the module docstring)."""
        started = time.perf_counter()
        prepared = self._prepare(sharded_state_dict, validate, preprocess_common)
        pending = PendingSave(self, prepared, started, staged)
        pending.plan()
        return pending

    def tensor_entries(self, parts: StateParts) -> list[TensorEntry]:
        """This rank's stored tensors, as the manifest records them."""
        shards = [v for v in nested_values(parts.tensors) if isinstance(v, ShardedTensor)]
        return self.format.tensor_entries(shards, self.config)

    def _prepare(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool,
        preprocess_common: PreprocessCommon | None = None,
    ) -> Prepared:
        """Apply factories, split, serialize the common state (coordinator), then check
        every rank's keys and (``validate``) the sharding and common state, and claim the
        URI, before anything is written (see :func:`agree_before_claim`: this rank's
        failure to prepare travels with its keys). Returns what the save needs next."""
        shown = self.storage.uri
        common_bytes = None
        compared: StateDict | None = None  # this rank's common state, as compared
        payload: tuple[ShardTable, bytes] | None = None
        error: BaseException | None = None
        parts: StateParts | None = None
        entries: list[TensorEntry] = []
        try:
            apply_factories(sharded_state_dict)
            parts = StateParts.of(sharded_state_dict)
            shards = [
                v
                for part in (parts.objects, parts.tensors)
                for v in nested_values(part)
                if isinstance(v, ShardedBase)
            ]
            if validate:
                check_metadata(shards)
                if dist.get_world_size() > 1:
                    compared = (
                        preprocess_common(parts.common) if preprocess_common else parts.common
                    )
            entries = self.tensor_entries(parts)  # the commit's, known before any write
            # the shards' metadata in columns, and the digest of the tensor entries
            payload = (ShardTable.of(shards), tensors_digest(tensors_text(entries)))
            if dist.get_rank() == COORDINATOR:
                common_bytes = serialize_common(self.common, parts.common, shown)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the gather
            error = exc
        whats = (f"opening checkpoint {redact_uri(self.uri)!r}", f"preparing checkpoint {shown!r}")
        with dist.paused_gc():  # every rank's metadata, unpickled and checked
            claimed, reference, digests = agree_before_claim(
                whats,
                PreparePhase.PREPARING,
                error,
                payload,
                lambda tables: self._check_every_rank(tables, validate, compared),
            )
        assert parts is not None  # else agree_before_claim raised
        if compared is not None and reference is not None:
            warn_if_common_differs(reference, compared, shown)
        return Prepared(parts, common_bytes, claimed, entries, digests)

    def _check_every_rank(
        self, gathered: list[ShardTable] | Any, validate: bool, compared: StateDict | None
    ) -> tuple[WriteResult, bytes | None]:
        """The coordinator's checks of every rank's keys and sharding metadata
        (:class:`ShardTable`; ``validate``: and the sharding), then the claim of the URI
        if they pass. Only the coordinator receives the tables: with an all-gather
        every rank held every rank's (at 4,096 ranks x 2,000 tensors, 8 million shard
        records in each process). Returns the claim's write result and the
        coordinator's common state as compared (``compared``), pickled before the
        claim (a state that cannot travel fails the checks, not the broadcast after the
        claim), which the other ranks compare theirs with."""
        traits = self.format.traits
        check_gathered_tables(
            gathered,
            KeyLayout(
                traits.tensor_dirs, not traits.writes_objects, path_limits(self.storage.location)
            ),
            self.storage.uri,
            dist.get_rank(),
            sharding=validate,
            regular_grid_for=traits.name if traits.regular_grid else None,
        )
        reference = None
        if compared is not None:
            reference = pickled_reference(compared, self.storage.uri)
        return write_claim(self.storage), reference

    def write_common(
        self, parts: StateParts, common_bytes: bytes | None, storage: CheckpointStorage
    ) -> list[WriteResult]:
        """The common state on the coordinator, and the ShardedObjects when the format
        does not write them."""
        results: list[WriteResult] = []
        if dist.get_rank() == COORDINATOR:
            if common_bytes is not None and isinstance(self.common, SerializingCommonSaver):
                results += self.common.write_serialized_common(storage, common_bytes)
            else:
                results += self.common.save_common_to(storage, parts.common)
        if not self.format.traits.writes_objects:
            results += self.common.save_objects_to(storage, parts.objects)
        return results

    def commit_agreed(
        self,
        prepared: Prepared,
        results: list[WriteResult],
        error: BaseException | None,
        planned: PlannedWrite | None,
        payload: Any,
    ) -> Manifest | None:
        """The agreement on the writes and the commit, in two collectives: every rank
        sends the coordinator its commit record and the format's payload, or its
        failure; the coordinator finishes the format (``.metadata``) and commits only
        when no rank failed, and broadcasts its :class:`CommitVerdict` (a rank's
        failure, or its own to finish or to commit), raised on every rank."""
        shown = self.storage.uri
        whats = {
            CommitPhase.WRITE: f"saving checkpoint {shown!r}",
            CommitPhase.COMMIT: f"committing checkpoint {shown!r}",
        }
        rank = dist.get_rank()
        sent = None
        if error is None:
            try:  # a failure here too travels in the gather (no rank skips it)
                sent = (self._record(prepared, results, rank), payload)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                error = exc
        gathered = dist.gather_reported(error, sent, whats[CommitPhase.WRITE], COORDINATOR)
        manifest: Manifest | None = None
        verdict: CommitVerdict | None = None
        own = error
        if gathered is not None:  # the coordinator
            reports = [report for report, _ in gathered]
            if any(report is not None for report in reports):
                verdict = CommitVerdict(CommitPhase.WRITE, reports)
            else:
                records = [rec for _, (rec, _) in gathered]
                phase = CommitPhase.WRITE  # the format's finish is the coordinator's write
                try:
                    assert planned is not None  # no rank failed: every rank planned
                    finished = planned.finish([p for _, (_, p) in gathered])
                    if finished:  # .metadata: a write of the coordinator's
                        results.extend(finished)
                        records[rank] = self._record(prepared, results, rank)
                    phase = CommitPhase.COMMIT
                    manifest = commit_gathered(
                        self.storage, records, self.backends, prepared.claimed
                    )
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                    own = exc
                    failed = [dist.failure_report(exc)] + [None] * (len(reports) - 1)
                    verdict = CommitVerdict(phase, failed)
                del records
            del gathered  # before the collector runs again
        verdict = dist.broadcast_object(
            verdict, COORDINATOR, what=f"agreeing on {whats[CommitPhase.COMMIT]}"
        )
        if verdict is not None:
            mine = own if verdict.phase == CommitPhase.WRITE or rank == COORDINATOR else None
            dist.raise_reported(verdict.reports, mine, whats[verdict.phase])
        return manifest

    def _record(self, prepared: Prepared, results: list[WriteResult], rank: int) -> CommitRecord:
        """This rank's commit record: its piece of the tensor entries it shares with its
        replicas (see :func:`~cloudckpt.commit.tensor_piece`)."""
        common = common_key_paths(prepared.parts.common) if rank == COORDINATOR else []
        record = CommitRecord.of(results, prepared.entries, common)
        return record.piece(*tensor_piece(prepared.digests, rank))


class PendingSave:
    """One rank's save between its prepare and its commit (see the module docstring)."""

    def __init__(
        self, session: SaveSession, prepared: Prepared, started: float, staged: bool
    ) -> None:
        self.session = session
        self.prepared = prepared
        self.started = started
        self.staged = staged
        self.results: list[WriteResult] = [] if prepared.claimed is None else [prepared.claimed]
        self.error: BaseException | None = None
        self.planned: PlannedWrite | None = None
        self.written: Written | None = None
        self.staging = StagingStorage.over(session.storage) if staged else None

    def plan(self) -> None:
        """Step 2: the format's plan (collective), and the common writes; staged, the
        data goes to host memory. This rank's failure is kept for the commit."""
        session, parts = self.session, self.prepared.parts
        traits = session.format.traits
        target = self.staging or session.storage
        shown = session.storage.uri
        try:
            with logged_failure("stage" if self.staged else "save", shown):
                state = parts.sharded if traits.writes_objects else parts.tensors
                self_staged = self.staged and traits.stages_itself
                into = session.storage if self_staged else target
                self.planned = session.format.plan(into, state, session.config, staged=self_staged)
                if self.staged and not traits.stages_itself:  # into host memory now
                    self._keep(self.planned.write())
                self.results += session.write_common(parts, self.prepared.common_bytes, target)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the commit
            self.error = exc
        if self.staging is not None:
            logger.debug(
                "rank %d staged %d bytes for %s",
                dist.get_rank(),
                self.staging.staged_bytes,
                shown,
            )

    def write(self) -> None:
        """Step 3: write (no collective); this rank's failure is kept for the commit."""
        if self.error is not None:
            return
        try:
            with logged_failure("upload" if self.staged else "save", self.session.storage.uri):
                if self.planned is not None and self.written is None:
                    self._keep(self.planned.write())
                if self.staging is not None:
                    self.staging.upload()
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the commit
            self.error = exc

    def upload(self) -> None:
        """An async save's function: :meth:`write`, raising this rank's failure (the
        request's queue agrees on it across ranks and runs no finalization)."""
        self.write()
        if self.error is not None:
            raise self.error

    def commit(self) -> Manifest | None:
        """Step 4 (collective): the manifest on the coordinator."""
        payload = self.written.payload if self.written is not None else None
        manifest = self.session.commit_agreed(
            self.prepared, self.results, self.error, self.planned, payload
        )
        shown = self.session.storage.uri
        log_rate("saved", shown, sum(r.size for r in self.results), len(self.results), self.started)
        return manifest

    def finalize(self) -> None:
        """An async save's finalization: :meth:`commit`, in the scope the save itself
        ran in on the coordinator (:func:`~cloudckpt.dist.coordinating`)."""
        with dist.coordinating():
            self.commit()

    def _keep(self, written: Written) -> None:
        self.written = written
        self.results += written.results


@dataclass(frozen=True)
class UnopenedSave:
    """A save whose :meth:`SaveSession.open_unagreed` failed on this rank: it takes
    part in the save's first collectives with its failure, which every rank then
    raises (none writes anything)."""

    uri: str
    format: SaveFormat
    common: CommonSaver
    error: BaseException

    def save(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> Manifest | None:
        """Raise this rank's failure to open on every rank (collective)."""
        shown = redact_uri(self.uri)
        whats = (f"opening checkpoint {shown!r}", f"preparing checkpoint {shown!r}")
        agree_before_claim(whats, PreparePhase.OPENING, self.error, None, None)
        raise self.error  # not reached: the agreement raised

    def save_async(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> AsyncRequest:
        """As :meth:`save`, after the checks every rank makes before it prepares."""
        _refuse_unstageable(self.format, self.common, redact_uri(self.uri))
        self.save(sharded_state_dict, validate, preprocess_common)
        raise self.error  # not reached


def _refuse_unstageable(fmt: SaveFormat, common: CommonSaver, shown: str) -> None:
    """Refuse an async save with strategies whose writes cannot be staged."""
    if not fmt.traits.async_capable or not isinstance(common, StorageBackedMixin):
        raise CheckpointingException(
            f"Cannot apply async_save to non-async strategy {fmt}: it writes "
            f"{shown!r} itself, so its writes cannot be staged (rank {dist.get_rank()})"
        )


__all__ = [
    "CommitPhase",
    "CommitVerdict",
    "PendingSave",
    "Prepared",
    "PreprocessCommon",
    "SaveSession",
    "StateParts",
    "UnopenedSave",
    "open_storage",
]
