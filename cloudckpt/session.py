"""Save and load sessions: one checkpoint opened once, its strategies bound once, the
phases run in order.

A :class:`SaveSession` resolves the save strategies, opens the storage and checks the
destination; :meth:`SaveSession.save` then prepares the state dict, claims the URI,
writes every rank's part and commits. A :class:`LoadSession` opens the storage, reads
the commit records once (:func:`cloudckpt.commit.open_committed`), binds the strategies
that ``metadata.json`` names, and checks every read against the manifest;
:meth:`LoadSession.load` then validates the request, applies strict handling and reads.

Each phase that can fail on one rank only ends in an agreement
(:func:`cloudckpt.dist.agree`), so a failure reaches every rank before the next
collective. :mod:`cloudckpt.serialization` keeps Megatron-Core's functions and
delegates here.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cloudckpt import dist
from cloudckpt.commit import commit, commit_gathered, require_empty, tensor_piece, write_claim
from cloudckpt.config import CheckpointConfig
from cloudckpt.core import CheckpointingConfig
from cloudckpt.dict_utils import (
    diff,
    extract_matching_values,
    nested_values,
)
from cloudckpt.errors import (
    CheckpointingException,
    CommonStateError,
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
from cloudckpt.shard_table import ShardTable, check_metadata
from cloudckpt.storage import CheckpointStorage, WriteResult, open_checkpoint, validate_relpath
from cloudckpt.storage.limits import path_limits
from cloudckpt.storage.staging import StagingStorage
from cloudckpt.strategies.async_utils import AsyncRequest
from cloudckpt.strategies.base import (
    SaveCommonStrategy,
    SaveShardedStrategy,
)
from cloudckpt.strategies.bound import (
    CommonSaver,
    SerializingCommonSaver,
    ShardedSaver,
    StagedSave,
    StagingSaver,
    StorageBackedMixin,
    bind_common_saver,
    bind_sharded_saver,
)
from cloudckpt.table_validation import check_gathered_tables

logger = logging.getLogger(__name__)

COORDINATOR = 0

REGULAR_GRID_BACKENDS = frozenset({"zarr"})
"""Backends that store each tensor on a regular grid of equal chunks (no uneven shards)."""

PreprocessCommon = Callable[[StateDict], StateDict]
"""``save``'s ``preprocess_common_before_consistancy_check``: common state -> what is
compared across ranks (it must not modify its argument)."""

StateParts = tuple[ShardedStateDict, ShardedStateDict, StateDict, ShardedStateDict]
"""(sharded objects, sharded tensors, common state, objects and tensors)."""


def open_storage(
    uri: str,
    strategy: Any,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None,
) -> CheckpointStorage:
    """The checkpoint's storage, from the call's options and config, else the
    strategy's own (``fs``, ``storage_options``, ``config``); refuses a store the other
    ranks cannot see."""
    storage = open_checkpoint(
        uri,
        getattr(strategy, "fs", None),
        storage_options or getattr(strategy, "storage_options", None),
        config=config or getattr(strategy, "config", None),
    )
    world = dist.get_world_size()
    if storage.process_local and world > 1:
        raise CheckpointingException(
            f"checkpoint {storage.uri!r} is in this process's memory (memory://), which "
            f"the other {world - 1} rank(s) cannot see: use a local directory or an object "
            f"store URI with {world} ranks (rank {dist.get_rank()})"
        )
    return storage


def local_metadata(
    sharded: ShardedStateDict, uri: str, check_keys: bool = True
) -> list[ShardedBase]:
    """This rank's shards without data, keys checked as object paths (unless
    ``check_keys`` is False: a save checks every rank's keys at once)."""
    metadata = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedBase):
            if check_keys:
                validate_relpath(value.key, uri)
            metadata.append(without_data(value))
    return metadata


def without_data(sh: ShardedBase) -> ShardedBase:
    """``sh.without_data()``; for cloudckpt's own ShardedTensor and ShardedObject (every
    field an ``__init__`` field) a copy of its attributes whose ``__post_init__`` runs
    again, which is what ``dataclasses.replace`` does, at a fraction of its cost."""
    if type(sh) not in _PLAIN_SHARDS:
        return sh.without_data()
    copied = object.__new__(type(sh))
    copied.__dict__.update(sh.__dict__)
    copied.__dict__["data"] = None
    copied.__post_init__()  # type: ignore[attr-defined]
    return copied


_PLAIN_SHARDS = (ShardedTensor, ShardedObject)


@contextlib.contextmanager
def logged_failure(verb: str, shown: str) -> Iterator[None]:
    """Log this rank's own failure (an agreement then raises it on every rank)."""
    try:
        yield
    except Exception as exc:
        logger.error("rank %d failed to %s %s: %s", dist.get_rank(), verb, shown, exc)
        raise


def log_rate(verb: str, uri: str, nbytes: int, count: int, started: float) -> None:
    """Log one rank's throughput of a save or load at INFO."""
    elapsed = max(time.perf_counter() - started, 1e-9)
    logger.info(
        "rank %d %s %s: %d objects, %.1f MB in %.2f s (%.1f MB/s)",
        dist.get_rank(),
        verb,
        uri,
        count,
        nbytes / 1e6,
        elapsed,
        nbytes / 1e6 / elapsed,
    )


# -- save ----------------------------------------------------------------------------------


def split_state_dict(sharded_state_dict: ShardedStateDict) -> StateParts:
    """Split a state dict (factories applied) into its parts; nonpersistent values dropped."""
    _, persistent = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    sharded, common = extract_matching_values(persistent, lambda v: isinstance(v, ShardedBase))
    objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
    return objects, tensors, common, sharded


@dataclass(frozen=True)
class SaveSession:
    """A save into one checkpoint URI (collective: every rank opens one).

    Attributes:
        uri: the checkpoint URI as given (for strategies that do their own I/O).
        storage: the storage every write of this save goes through.
        sharded / common: the bound strategies.
        backends: what ``metadata.json`` will record.
        objects_with_tensors: the sharded strategy writes ShardedObjects too.
        config: the save's config (chunk sizes), if any.
    """

    uri: str
    storage: CheckpointStorage
    sharded: ShardedSaver
    common: CommonSaver
    backends: CheckpointingConfig
    objects_with_tensors: bool
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
        sharded = bind_sharded_saver(sharded_strategy, uri)
        common = bind_common_saver(common_strategy, uri)
        return cls._of(uri, storage, sharded, common, sharded_strategy, common_strategy, config)

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
        sharded = bind_sharded_saver(sharded_strategy, uri)
        common = bind_common_saver(common_strategy, uri)
        try:
            storage = open_storage(uri, sharded_strategy, storage_options, config)
            if dist.get_rank() == COORDINATOR:
                require_empty(storage)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the save
            return UnopenedSave(uri, sharded, common, exc)
        return cls._of(uri, storage, sharded, common, sharded_strategy, common_strategy, config)

    @classmethod
    def _of(
        cls,
        uri: str,
        storage: CheckpointStorage,
        sharded: ShardedSaver,
        common: CommonSaver,
        sharded_strategy: SaveShardedStrategy,
        common_strategy: SaveCommonStrategy,
        config: CheckpointConfig | None,
    ) -> SaveSession:
        """The session of an opened ``storage`` (the backends from the strategies)."""
        backends = CheckpointingConfig(
            sharded_strategy.backend,
            sharded_strategy.version,
            common_strategy.backend,
            common_strategy.version,
        )
        with_objects = sharded_strategy.can_handle_sharded_objects
        return cls(uri, storage, sharded, common, backends, with_objects, config)

    def save(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> Manifest | None:
        """Prepare, validate, claim, write and commit. Collective. Returns the manifest
        on the coordinator."""
        started = time.perf_counter()
        shown = self.storage.uri
        prepared = self._prepare(sharded_state_dict, validate, preprocess_common)
        claimed = prepared.claimed
        results: list[WriteResult] = [claimed] if claimed is not None else []
        error: BaseException | None = None
        finish: DeferredFinish | None = None
        try:
            with logged_failure("save", shown):
                written, finish = self._write_deferring(prepared.parts, prepared.common_bytes)
                results.extend(written)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the commit
            error = exc
        manifest = self._commit_agreed(prepared, results, error, finish)
        log_rate("saved", shown, sum(r.size for r in results), len(results), started)
        return manifest

    def _write_deferring(
        self, parts: StateParts, common_bytes: bytes | None
    ) -> tuple[list[WriteResult], DeferredFinish | None]:
        """:meth:`_write`, with the sharded strategy's last collective step (torch_dist:
        ``.metadata``) deferred to the commit where the strategy offers it."""
        deferring = getattr(self.sharded, "save_deferring_finish", None)
        if deferring is None or not getattr(self.sharded, "finish_deferrable", False):
            return self._write(parts, common_bytes), None
        _, tensors, _, sharded = parts
        state = sharded if self.objects_with_tensors else tensors
        results, finish = deferring(self.storage, state, self.config)
        return results + self._write_common(parts, common_bytes, self.storage), finish

    def _commit_agreed(
        self,
        prepared: Prepared,
        results: list[WriteResult],
        error: BaseException | None,
        finish: DeferredFinish | None = None,
    ) -> Manifest | None:
        """The agreement on the writes and the commit, in two collectives (where an
        agreement, a gather of the commit records and an agreement on the commit made
        three, and torch_dist's finish two more): every rank sends the coordinator its
        commit record (and ``finish``'s payload), or its failure; the coordinator
        finishes (``.metadata``) and commits only when no rank failed, and broadcasts
        its verdict (a rank's failure to write, its own to finish or to commit), raised
        on every rank."""
        shown = self.storage.uri
        whats = (f"saving checkpoint {shown!r}", f"committing checkpoint {shown!r}")
        rank = dist.get_rank()
        sent = None
        if error is None:
            try:  # a failure here too travels in the gather (no rank skips it)
                payload = finish.payload if finish is not None else None
                sent = (self._record(prepared, results, rank), payload)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                error = exc
        gathered = dist.gather_reported(error, sent, whats[0], COORDINATOR)
        manifest: Manifest | None = None
        verdict: tuple[int, list[Any]] | None = None
        own = error
        if gathered is not None:  # the coordinator
            reports = [report for report, _ in gathered]
            if any(report is not None for report in reports):
                verdict = (0, reports)
            else:
                records = [rec for _, (rec, _) in gathered]
                phase = 0
                try:
                    if finish is not None:  # .metadata: a write of the coordinator's
                        results.extend(finish.finish_on_coordinator([p for _, (_, p) in gathered]))
                        records[rank] = self._record(prepared, results, rank)
                    phase = 1
                    claimed = prepared.claimed
                    manifest = commit_gathered(self.storage, records, self.backends, claimed)
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                    own = exc
                    failed = [dist.failure_report(exc)] + [None] * (len(reports) - 1)
                    verdict = (phase, failed)
                del records
            del gathered  # before the collector runs again
        verdict = dist.broadcast_object(verdict, COORDINATOR, what=f"agreeing on {whats[1]}")
        if verdict is not None:
            phase, reports = verdict
            dist.raise_reported(
                reports, own if phase == 0 or rank == COORDINATOR else None, whats[phase]
            )
        return manifest

    def _record(self, prepared: Prepared, results: list[WriteResult], rank: int) -> CommitRecord:
        """This rank's commit record: its piece of the tensor entries it shares with its
        replicas (see :func:`~cloudckpt.commit.tensor_piece`)."""
        common = common_key_paths(prepared.parts[2]) if rank == COORDINATOR else []
        record = CommitRecord.of(results, prepared.entries, common)
        return record.piece(*tensor_piece(prepared.digests, rank))

    def save_async(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> AsyncRequest:
        """Prepare, validate, claim and run the strategies now, staging every object in
        host memory; return the request whose ``async_fn`` uploads this rank's objects
        and whose finalize function commits. Collective (and so is finalizing).

        A sharded strategy with ``stage_to`` (:class:`~cloudckpt.strategies.bound.
        StagingSaver`: torch_dist) only copies its tensors to host memory and plans
        here; it serializes and uploads them in ``async_fn`` and finishes (``.metadata``)
        in the finalize function, before the commit."""
        started = time.perf_counter()
        shown = self.storage.uri
        _refuse_unstageable(self.sharded, self.common, shown)
        prepared = self._prepare(sharded_state_dict, validate, preprocess_common)
        parts, common_bytes, claimed = prepared.parts, prepared.common_bytes, prepared.claimed
        staging = StagingStorage.over(self.storage)
        results: list[WriteResult] = [claimed] if claimed is not None else []
        staged: StagedSave | None = None
        with dist.agree(f"staging checkpoint {shown!r}"), logged_failure("stage", shown):
            if isinstance(self.sharded, StagingSaver) and self.objects_with_tensors:
                staged = self.sharded.stage_to(self.storage, parts[3], self.config)
                results += self._write_common(parts, common_bytes, staging)
            else:
                results += self._write(parts, common_bytes, staging)
        logger.debug("rank %d staged %d bytes for %s", dist.get_rank(), staging.staged_bytes, shown)

        def upload() -> None:
            with logged_failure("upload", shown):
                staging.upload()
                if staged is not None:
                    staged.upload()

        def finalize() -> None:
            if staged is not None:
                results.extend(staged.finish())
            self._commit(parts, results, claimed, prepared.entries, prepared.digests)
            log_rate("saved", shown, sum(r.size for r in results), len(results), started)

        return AsyncRequest(upload, (), [finalize])

    def _tensor_entries(self, parts: StateParts) -> list[TensorEntry]:
        """This rank's stored tensors, as the manifest records them."""
        shards = [v for v in nested_values(parts[1]) if isinstance(v, ShardedTensor)]
        return self.sharded.tensor_entries(shards, self.config)

    def _commit(
        self,
        parts: StateParts,
        results: list[WriteResult],
        claimed: WriteResult | None,
        entries: list[TensorEntry] | None = None,
        digests: list[bytes] | None = None,
    ) -> Manifest | None:
        common = parts[2]
        return commit(
            self.storage,
            results,
            self.backends,
            self._tensor_entries(parts) if entries is None else entries,
            common_key_paths(common) if dist.get_rank() == COORDINATOR else [],
            claimed=claimed,
            digests=digests,
        )

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
            parts = split_state_dict(sharded_state_dict)
            shards = [
                v for part in parts[:2] for v in nested_values(part) if isinstance(v, ShardedBase)
            ]
            if validate:
                check_metadata(shards)
                if dist.get_world_size() > 1:
                    compared = preprocess_common(parts[2]) if preprocess_common else parts[2]
            entries = self._tensor_entries(parts)  # the commit's, known before any write
            # the shards' metadata in columns, and the digest of the tensor entries
            payload = (ShardTable.of(shards), tensors_digest(tensors_text(entries)))
            if dist.get_rank() == COORDINATOR:
                common_bytes = serialize_common(self.common, parts[2], shown)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it in the gather
            error = exc
        whats = (f"opening checkpoint {redact_uri(self.uri)!r}", f"preparing checkpoint {shown!r}")
        with dist.paused_gc():  # every rank's metadata, unpickled and checked
            claimed, reference, digests = agree_before_claim(
                whats,
                _PREPARING,
                error,
                payload,
                lambda tables: self._check_every_rank(tables, validate, compared),
            )
        assert parts is not None  # else agree_before_claim raised
        if compared is not None and reference is not None:
            warn_if_common_differs(reference, compared, shown)
        return Prepared(parts, common_bytes, claimed, entries, digests)

    def _check_every_rank(
        self, gathered: Sequence[ShardTable], validate: bool, compared: StateDict | None
    ) -> tuple[WriteResult, bytes | None]:
        """The coordinator's checks of every rank's keys and sharding metadata
        (:class:`ShardTable`; ``validate``: and the sharding), then the claim of the URI
        if they pass. Only the coordinator receives the tables: with an all-gather
        every rank held every rank's (at 4,096 ranks x 2,000 tensors, 8 million shard
        records in each process). Returns the claim's write result and the
        coordinator's common state as compared (``compared``), pickled before the
        claim (a state that cannot travel fails the checks, not the broadcast after the
        claim), which the other ranks compare theirs with."""
        self._check_gathered(gathered, validate)
        reference = None
        if compared is not None:
            reference = _pickled_reference(compared, self.storage.uri)
        return write_claim(self.storage), reference

    def _check_gathered(self, gathered: Sequence[ShardTable], validate: bool) -> None:
        """The coordinator's checks of every rank's keys (and sharding)."""
        backend = self.backends.sharded_backend
        check_gathered_tables(
            gathered,
            KeyLayout.of(backend, self.objects_with_tensors, path_limits(self.storage.location)),
            self.storage.uri,
            dist.get_rank(),
            sharding=validate,
            regular_grid_for=regular_grid_for(backend),
        )

    def _write(
        self,
        parts: StateParts,
        common_bytes: bytes | None,
        storage: CheckpointStorage | None = None,
    ) -> list[WriteResult]:
        """This rank's objects: tensors (and objects, when the sharded strategy handles
        them), the common state on the coordinator, else objects by the common strategy;
        through ``storage`` (default: the session's)."""
        storage = storage or self.storage
        _, tensors, _, sharded = parts
        with_objects = self.objects_with_tensors
        results = self.sharded.save_to(storage, sharded if with_objects else tensors, self.config)
        return results + self._write_common(parts, common_bytes, storage)

    def _write_common(
        self, parts: StateParts, common_bytes: bytes | None, storage: CheckpointStorage
    ) -> list[WriteResult]:
        """The common state on the coordinator, and the ShardedObjects when the sharded
        strategy does not write them."""
        objects, _, common, _ = parts
        results: list[WriteResult] = []
        if dist.get_rank() == COORDINATOR:
            if common_bytes is not None and isinstance(self.common, SerializingCommonSaver):
                results += self.common.write_serialized_common(storage, common_bytes)
            else:
                results += self.common.save_common_to(storage, common)
        if not self.objects_with_tensors:
            results += self.common.save_objects_to(storage, objects)
        return results


class DeferredFinish(Protocol):
    """A sharded strategy's last collective step, deferred to the commit (see
    :meth:`SaveSession._commit_agreed`): :attr:`payload` travels to the coordinator
    with the commit record; the coordinator's :meth:`finish_on_coordinator` writes
    from every rank's (by rank) and returns its write results."""

    payload: Any

    def finish_on_coordinator(self, payloads: list[Any]) -> list[WriteResult]: ...


@dataclass(frozen=True)
class Prepared:
    """A save prepared and agreed on (:meth:`SaveSession._prepare`).

    Attributes:
        parts: the state dict's parts (:func:`split_state_dict`).
        common_bytes: the serialized common state (coordinator; None: the common
            strategy serializes it when it writes).
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


_OPENING, _PREPARING = 0, 1
"""The phases whose agreement travels with the gather of every rank's keys."""

CoordinatorChecks = Callable[[Sequence[ShardTable]], tuple[WriteResult, bytes | None]]


def agree_before_claim(
    whats: tuple[str, str],
    phase: int,
    error: BaseException | None,
    payload: tuple[ShardTable, bytes] | None,
    checks: CoordinatorChecks | None,
) -> tuple[WriteResult | None, Any, list[bytes]]:
    """Collective, two collectives for what took four (an agreement on opening, one on
    preparing, the gather of the keys and the verdict's broadcast): every rank sends
    the coordinator its ``payload`` (its :class:`ShardTable` and tensor digest), or its
    failure in ``phase`` (``_OPENING`` or ``_PREPARING``, named by ``whats``); the
    coordinator runs ``checks`` (which claim the URI) only when no rank failed, and
    broadcasts its verdict: the failures of the first phase that failed (raised on
    every rank as :func:`cloudckpt.dist.agree` raises them), or the checks' error (the
    same on every rank), or the coordinator's common state as compared and every
    rank's digest. Returns the claim (coordinator), that common state unpickled (the
    other ranks) and the digests."""
    gathered = dist.gather_reported(error, (phase, payload), whats[phase], COORDINATOR)
    verdict: tuple[int | None, Any, BaseException | None, bytes | None, list[bytes]] = (
        None,
        None,
        None,
        None,
        [],
    )
    failure: BaseException | None = None
    claimed = None
    if gathered is not None:  # the coordinator
        failed = [ph for report, (ph, _) in gathered if report is not None]
        if failed:
            first = min(failed)
            reports = [rep if ph == first else None for rep, (ph, _) in gathered]
            verdict = (first, reports, None, None, [])
        else:
            assert checks is not None  # a rank without checks failed to open
            tables = [pl[0] for _, (_, pl) in gathered]
            digests = [pl[1] for _, (_, pl) in gathered]
            reference = None
            try:
                claimed, reference = checks(tables)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                failure, reference = exc, None
            verdict = (None, None, _travelling(failure), reference, digests)
        del gathered  # before the collector runs again
    failed_phase, reports, checked, reference, digests = dist.broadcast_object(
        verdict, src=COORDINATOR, what="the checks of every rank's keys and the claim"
    )
    if failed_phase is not None:
        dist.raise_reported(reports, error if failed_phase == phase else None, whats[failed_phase])
    if failure is not None:
        raise failure
    if checked is not None:
        raise checked
    if dist.get_rank() == COORDINATOR or reference is None:
        return claimed, None, digests
    return claimed, pickle.loads(reference), digests  # the coordinator's, of this job


@dataclass(frozen=True)
class UnopenedSave:
    """A save whose :meth:`SaveSession.open_unagreed` failed on this rank: it takes
    part in the save's first collectives with its failure, which every rank then
    raises (none writes anything)."""

    uri: str
    sharded: ShardedSaver
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
        agree_before_claim(whats, _OPENING, self.error, None, None)
        raise self.error  # not reached: the agreement raised

    def save_async(
        self,
        sharded_state_dict: ShardedStateDict,
        validate: bool = True,
        preprocess_common: PreprocessCommon | None = None,
    ) -> AsyncRequest:
        """As :meth:`save`, after the checks every rank makes before it prepares."""
        _refuse_unstageable(self.sharded, self.common, redact_uri(self.uri))
        self.save(sharded_state_dict, validate, preprocess_common)
        raise self.error  # not reached


def _refuse_unstageable(sharded: ShardedSaver, common: CommonSaver, shown: str) -> None:
    """Refuse an async save with strategies whose writes cannot be staged."""
    if not _writes_through_storage(sharded) or not isinstance(common, StorageBackedMixin):
        raise CheckpointingException(
            f"Cannot apply async_save to non-async strategy {sharded}: it writes "
            f"{shown!r} itself, so its writes cannot be staged (rank {dist.get_rank()})"
        )


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


def _writes_through_storage(strategy: Any) -> bool:
    """Whether ``strategy`` writes only through the storage it is handed (so its writes
    can be staged): a storage-backed strategy, or a wrapper (Megatron-Core's
    ``base_strategy``, e.g. the fully parallel one) around one."""
    if isinstance(strategy, StorageBackedMixin):
        return True
    base = getattr(strategy, "base_strategy", None)
    return base is not None and _writes_through_storage(base)


def regular_grid_for(sharded_backend: str) -> str | None:
    """``sharded_backend`` when it needs every tensor on a regular grid, else None."""
    return sharded_backend if sharded_backend in REGULAR_GRID_BACKENDS else None


def warn_if_common_differs(reference: StateDict, mine: StateDict, shown: str) -> None:
    """Log at WARNING where this rank's common state (after the caller's preprocessing,
    which must not modify it) differs from rank 0's, as Megatron-Core does (only rank
    0's is saved)."""
    rank = dist.get_rank()
    only_rank0, only_here, mismatch = diff(reference, mine)
    if only_rank0 or only_here or mismatch:
        logger.warning(
            "Rank %d common state dict differs from rank 0 common state dict. "
            "Keys only on rank 0: %s, Keys only on %d: %s, Mismatched keys: %s "
            "(checkpoint %s; only rank 0's common state is saved)",
            rank,
            only_rank0,
            rank,
            only_here,
            [m[0] for m in mismatch],
            shown,
        )


# -- the common state, serialized before the claim ---------------------------------------


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


def _pickled_reference(compared: StateDict, uri: str) -> bytes:
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
