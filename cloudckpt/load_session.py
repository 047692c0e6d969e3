"""Loading a committed checkpoint: a :class:`LoadSession` opens it once, and
:func:`load_checkpoint` runs a collective load phase by phase.

The session reads the commit records once (:func:`cloudckpt.commit_state.open_committed`),
binds the strategies that ``metadata.json`` names (or the caller's, checked against
it) and checks every read against the manifest. Each phase of a load that can fail on
one rank only ends in an agreement (:func:`cloudckpt.dist.agree`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.commit_state import CommittedCheckpoint, open_committed
from cloudckpt.config import CheckpointConfig
from cloudckpt.dict_utils import (
    dict_list_map_outplace,
    extract_matching_values,
    merge,
    nested_values,
)
from cloudckpt.errors import IncompatibleCheckpointError, StrategyNotFoundError
from cloudckpt.formats.foreign import common_loader_of, sharded_loader_of
from cloudckpt.formats.protocol import CommonLoader, ShardedLoader
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from cloudckpt.redact import redact_uri
from cloudckpt.session_support import local_metadata, log_rate, logged_failure, open_storage
from cloudckpt.shard_table import ShardTable
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    StrategyAction,
    check_compatibility,
    get_default_strategy,
)
from cloudckpt.table_validation import check_gathered_sharding
from cloudckpt.validation import (
    ALL_MODES,
    StrictHandling,
    parse_strict_flag,
    report_mismatch,
)


@dataclass(frozen=True)
class LoadSession:
    """A committed checkpoint opened for reading.

    Attributes:
        uri: the checkpoint URI as given.
        storage: every read goes through it, checked against the manifest.
        checkpoint: the commit records, read once.
        sharded / common: the bound strategies, checked against ``metadata.json``.
        objects_with_tensors: the sharded strategy reads ShardedObjects too.
    """

    uri: str
    storage: CheckpointStorage
    checkpoint: CommittedCheckpoint
    sharded: ShardedLoader
    common: CommonLoader
    objects_with_tensors: bool

    @classmethod
    def open(
        cls,
        uri: str,
        sharded_strategy: LoadShardedStrategy | None = None,
        common_strategy: LoadCommonStrategy | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
        verify_checksums: bool = False,
    ) -> LoadSession:
        """Open a committed checkpoint (this rank alone; callers agree if collective).

        Raises:
            CheckpointNotFoundError: no checkpoint at ``uri``.
            UncommittedCheckpointError: it was never committed (names what is missing).
            IncompatibleCheckpointError: a strategy cannot read its backend or version.
        """
        storage = open_storage(uri, sharded_strategy, storage_options, config)
        return cls.bind(
            uri,
            storage,
            open_committed(storage),
            sharded_strategy,
            common_strategy,
            verify_checksums=verify_checksums,
        )

    @classmethod
    def bind(
        cls,
        uri: str,
        storage: CheckpointStorage,
        checkpoint: CommittedCheckpoint,
        sharded_strategy: LoadShardedStrategy | None = None,
        common_strategy: LoadCommonStrategy | None = None,
        *,
        verify_checksums: bool = False,
    ) -> LoadSession:
        """A session over an open storage whose commit records were read: the
        strategies ``metadata.json`` names (or the given ones, checked against it).

        Raises:
            IncompatibleCheckpointError: a strategy cannot read its backend or version.
        """
        backends = checkpoint.backends
        sharded_strategy = sharded_strategy or _registered_loader(
            storage,
            StrategyAction.LOAD_SHARDED,
            backends.sharded_backend,
            backends.sharded_backend_version,
        )
        common_strategy = common_strategy or _registered_loader(
            storage,
            StrategyAction.LOAD_COMMON,
            backends.common_backend,
            backends.common_backend_version,
        )
        check_compatibility(
            sharded_strategy,
            backends.sharded_backend,
            backends.sharded_backend_version,
            storage.uri,
        )
        check_compatibility(
            common_strategy,
            backends.common_backend,
            backends.common_backend_version,
            storage.uri,
        )
        return cls(
            uri,
            storage.with_expected(checkpoint.expected_objects(), verify_checksums),
            checkpoint,
            sharded_loader_of(sharded_strategy, uri),
            common_loader_of(common_strategy, uri),
            sharded_strategy.can_handle_sharded_objects,
        )

    def common_state(self) -> StateDict:
        """The checkpoint's common state dict."""
        return self.common.load_common_from(self.storage)

    def tensors_metadata(self) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (no data) for every stored tensor."""
        return self.sharded.tensors_metadata_from(self.storage)

    def sharded_metadata(self) -> ShardedStateDict:
        """Every stored tensor (by key) and ShardedObject (by unique key), without data."""
        metadata = dict(self.sharded.sharded_metadata_from(self.storage))
        if not self.objects_with_tensors:
            metadata.update(self.common.sharded_metadata_from(self.storage))
        return metadata

    def stored_keys(self) -> set[str]:
        """The keys of every stored tensor and object (what strict handling compares)."""
        return {sh.key for sh in self.sharded_metadata().values()}

    def read(self, sharded: ShardedStateDict) -> StateDict:
        """Load tensors and objects; objects by the sharded strategy when it reads them."""
        if self.objects_with_tensors:  # e.g. torch_dist: objects in DCP
            return self.sharded.load_from(self.storage, sharded)
        objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
        loaded = self.sharded.load_from(self.storage, tensors)
        if objects:
            merge(loaded, self.common.load_objects_from(self.storage, objects))
        return loaded

    def remove_sharded_tensors(self, key_prefix: str) -> None:
        """Delete every stored tensor whose key starts with ``key_prefix``."""
        self.sharded.remove_tensors_from(self.storage, key_prefix)


def _registered_loader(
    storage: CheckpointStorage, action: StrategyAction, backend: str, version: int
) -> Any:
    try:
        return get_default_strategy(action, backend, version)
    except StrategyNotFoundError as exc:
        raise IncompatibleCheckpointError(
            f"checkpoint {storage.uri!r} was written with backend {backend!r} version {version}, "
            f"which this cloudckpt cannot read: {exc}"
        ) from exc


# -- a collective load, phase by phase ---------------------------------------------------


@dataclass(frozen=True)
class LoadRequest:
    """What one rank asked to load, split up (factories applied).

    Attributes:
        sharded: the ShardedTensors and ShardedObjects to read.
        local: their metadata without data (keys checked).
        factories: the factories to merge back after reading.
        nonpersistent: LocalNonpersistentObjects, returned unwrapped.
    """

    sharded: ShardedStateDict
    local: list[ShardedBase]
    factories: ShardedStateDict
    nonpersistent: StateDict

    @classmethod
    def of(cls, sharded_state_dict: ShardedStateDict, uri: str) -> LoadRequest:
        """Split ``sharded_state_dict``; ``uri`` (redacted) names bad keys."""
        nonpersistent, requested = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
        )
        factories, _ = extract_matching_values(
            requested, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
        )
        apply_factories(requested)
        sharded, _ = extract_matching_values(requested, lambda v: isinstance(v, ShardedBase))
        unwrapped = dict_list_map_outplace(lambda v: v.unwrap(), nonpersistent)
        return cls(sharded, local_metadata(sharded, uri), factories, unwrapped)


def load_checkpoint(
    uri: str,
    sharded_state_dict: ShardedStateDict,
    strict: str | StrictHandling,
    validate: bool,
    open_session: Callable[[], LoadSession],
    group: Any = None,
) -> tuple[StateDict, set[str], set[str]]:
    """Load collectively: open and read the common state and split the request (agreed,
    in the collective that also gathers every rank's shards' metadata when validation or
    ``strict`` needs it), validate the request across ranks and apply ``strict``
    (agreed where it can fail on one rank), read (agreed). Two collectives for a
    default load. Returns the state dict and the missing and unexpected keys.
    ``group``: the ranks whose requests make one complete state dict (validation and
    missing keys consider theirs; default: every rank's)."""
    started = time.perf_counter()
    shown = redact_uri(uri)
    opened: list[tuple[StrictHandling, LoadSession, StateDict, LoadRequest]] = []

    def open_and_split() -> ShardTable | None:
        """Open the checkpoint and split the request; what the other ranks need of it
        (its shards' metadata as a table, for validation and strict handling) or None."""
        handling = parse_strict_flag(strict)
        session = open_session()
        opened.append(
            (handling, session, session.common_state(), LoadRequest.of(sharded_state_dict, shown))
        )
        local = opened[0][3].local
        return ShardTable.of(local) if _needs_global(handling, validate) else None

    # one collective: the agreement on opening carries every rank's shards' metadata
    gathered = dist.all_gather_agreed(f"opening checkpoint {shown!r}", open_and_split)
    handling, session, common_state, request = opened[0]
    tables = dist.of_group(gathered, group) if gathered[0] is not None else None
    sharded, missing, unexpected = _apply_strictness(session, request, handling, validate, tables)
    with dist.agree(f"loading checkpoint {shown!r}"), logged_failure("load", shown):
        loaded = session.read(sharded)
        apply_factory_merges(loaded, request.factories)
    merge(common_state, loaded)
    merge(common_state, request.nonpersistent)
    tensors = [t for t in nested_values(loaded) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    log_rate("loaded", session.storage.uri, nbytes, len(tensors), started)
    return common_state, missing, unexpected


def _needs_global(strict: StrictHandling, validate: bool) -> bool:
    """Whether a load needs every rank's shards' metadata."""
    return validate or StrictHandling.requires_global_app_metadata(strict)


def _apply_strictness(
    session: LoadSession,
    request: LoadRequest,
    strict: StrictHandling,
    validate: bool,
    gathered: list[ShardTable] | None = None,
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Validate the requested sharding and handle missing keys (stored, requested by no
    rank; ``*_ALL`` modes only) and unexpected keys (requested here, not stored) per
    ``strict``; unexpected keys are dropped from the request. Collective; a rank that
    raises (unexpected keys there only) makes every rank raise. ``gathered``: every
    rank's shards' metadata (:class:`ShardTable`, columnar: a fraction of the shards'
    pickles, checked with arrays) when already gathered (else gathered here if needed)."""
    shown = session.storage.uri
    local = request.local
    if gathered is not None:
        global_metadata = gathered
    elif _needs_global(strict, validate):
        global_metadata = dist.all_gather_object(ShardTable.of(local))
    else:
        global_metadata = [ShardTable.of(local)] if validate else []
    if validate:
        check_gathered_sharding(global_metadata, shown)
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return request.sharded, set(), set()
    with dist.agree(f"checking the keys of checkpoint {shown!r}"):
        stored = session.stored_keys()
        unexpected = {sh.key for sh in local} - stored
        missing: set[str] = set()
        if strict in ALL_MODES:
            missing = stored - {key for table in global_metadata for key in table.key_names()}
        where = f"checkpoint {shown!r}, rank {dist.get_rank()}"
        report_mismatch(where, strict, missing, unexpected)
    sharded = request.sharded
    if unexpected:
        _, sharded = extract_matching_values(
            sharded, lambda v: isinstance(v, ShardedBase) and v.key in unexpected
        )
    if strict == StrictHandling.IGNORE_ALL:
        return sharded, set(), set()
    return sharded, missing, unexpected
