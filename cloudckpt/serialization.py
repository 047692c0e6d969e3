"""Entry points: save and load sharded state dicts (Megatron-Core's top-level API).

``save`` runs on every rank with that rank's sharded state dict: factories are
applied, LocalNonpersistentObjects dropped, the sharding validated across ranks,
then every rank writes its main-replica shards, rank 0 the common state, and, after
all ranks succeeded, rank 0 writes ``metadata.json``. ``load`` does the reverse,
resharding to whatever layout the requested state dict describes.

These functions keep Megatron-Core's signatures and delegate to
:mod:`cloudckpt.session`, which opens the checkpoint once and runs the phases.
Without an initialised process group, both work in one process (a world of one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from cloudckpt import dist
from cloudckpt.checker import check_integrity
from cloudckpt.commit_state import open_committed, read_commit_state
from cloudckpt.config import CheckpointConfig
from cloudckpt.integrity_record import integrity_sources, sha256_digests, write_integrity_record
from cloudckpt.load_session import LoadSession, load_checkpoint
from cloudckpt.manifest import INTEGRITY_FNAME
from cloudckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from cloudckpt.redact import redact_uri
from cloudckpt.safe_pickle import weights_only_scope
from cloudckpt.session import PreprocessCommon, SaveSession, open_storage
from cloudckpt.storage import CheckpointStorage
from cloudckpt.storage.location import CheckpointDir, checkpoint_uri
from cloudckpt.strategies.async_utils import AsyncRequest, check_async_strategy
from cloudckpt.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from cloudckpt.validation import StrictHandling, parse_strict_flag

_T = TypeVar("_T")

DEFAULT_SHARDED_BACKEND = ("torch_dist", 1)
CONTENT_METADATA_KEY = "content_metadata"
logger = logging.getLogger(__name__)

_CONTENT_METADATA_KEY = CONTENT_METADATA_KEY  # Megatron-Core's name

#: What :func:`load_sharded_metadata` returns (Megatron-Core's alias).
CkptShardedMetadata = dict[str, ShardedTensor | ShardedObject]
DEFAULT_COMMON_BACKEND = ("torch", 1)

SaveShardedArg = SaveShardedStrategy | tuple[str, int] | None
SaveCommonArg = SaveCommonStrategy | tuple[str, int] | None
LoadResult = StateDict | tuple[StateDict, set[str], set[str]]


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CheckpointDir,
    sharded_strategy: SaveShardedArg = None,
    common_strategy: SaveCommonArg = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: PreprocessCommon | None = None,
    content_metadata: dict[str, Any] | None = None,
    async_strategy: str | None = "nvrx",
    verify_integrity: bool = False,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> AsyncRequest | None:
    """Save a sharded state dict to ``checkpoint_dir`` (a URI or local path). Collective.

    Args:
        sharded_state_dict: this rank's state: ShardedTensors, ShardedObjects,
            ShardedTensorFactories, LocalNonpersistentObjects and plain values
            (the plain values of rank 0 become the common state). Factories are
            applied in place, as in Megatron-Core.
        checkpoint_dir: destination (a ``str`` URI or path, or a local
            ``os.PathLike``); it must hold no objects yet.
        sharded_strategy: a save strategy or a (backend, version) pair; default: the
            config's backend, else torch_dist at version 1 (as Megatron-Core).
        common_strategy: a common-state strategy or pair; default torch v1.
        validate_access_integrity: check, across ranks, that every tensor is covered
            exactly once by main replicas and that shard metadata agrees, and compare
            every rank's common state with rank 0's (differences logged at WARNING).
        async_sharded_save: stage every object in host memory now and return an
            :class:`~cloudckpt.strategies.async_utils.AsyncRequest` whose ``async_fn``
            uploads them and whose finalize function commits (``metadata.json`` is
            written then); schedule it on every rank (e.g. on an
            :class:`~cloudckpt.strategies.async_utils.AsyncCallsQueue`).
        preprocess_common_before_consistancy_check: applied to the common state before
            the cross-rank comparison (e.g. to drop keys expected to differ); it must
            not modify its argument. Megatron-Core's spelling.
        content_metadata: stored in the common state under ``"content_metadata"``
            (:func:`load_content_metadata` returns it), as Megatron-Core does.
        async_strategy: Megatron-Core 0.19's choice of async machinery, "nvrx" (its
            default) or "mcore"; cloudckpt runs its own async save for either (see
            :data:`~cloudckpt.strategies.async_utils.ASYNC_STRATEGIES`).
        verify_integrity: Megatron-Core 0.19's: after the commit (for an async save, in
            a finalize function after the commit's), the ranks read every object back,
            a share each, and the coordinator writes ``integrity.json`` with their
            SHA-256, as Megatron-Core
            does, so that its ``load(..., verify_integrity=True)`` can check the
            checkpoint too. cloudckpt's own check needs none of it: the manifest of
            every save records every object's size and CRC-32C.
        storage_options: fsspec options for the URI's filesystem (credentials, endpoint);
            they override the config's and the environment's.
        config: a training-config section (:func:`cloudckpt.config.from_dict`): storage
            options, backend, part size, in-flight requests, chunk size.

    Returns:
        None, or with ``async_sharded_save`` the request to schedule.

    Raises:
        ShardingValidationError: the sharding is inconsistent (every problem listed).
        CheckpointingException: the destination is not empty, or a rank failed to write
            (then every rank raises, naming the failed ranks).
        UnknownAsyncStrategyError: ``async_strategy`` is not "nvrx", "mcore" or None.
        CollectiveError: a rank died, froze or stayed away from a collective
            (``RankLostError`` / ``CollectiveTimeoutError``, naming it).
    """
    check_async_strategy(async_strategy)
    default_sharded = (config.backend, 1) if config is not None else DEFAULT_SHARDED_BACKEND
    with dist.bounded(config), dist.paused_gc(), dist.coordinating():
        session = SaveSession.open_unagreed(  # its agreement travels with the save's first
            checkpoint_uri(checkpoint_dir),
            _save_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, default_sharded),
            _save_strategy(StrategyAction.SAVE_COMMON, common_strategy, DEFAULT_COMMON_BACKEND),
            storage_options=storage_options,
            config=config,
        )
        if content_metadata is not None:
            sharded_state_dict[CONTENT_METADATA_KEY] = content_metadata
        preprocess = preprocess_common_before_consistancy_check
        if async_sharded_save:
            request = session.save_async(sharded_state_dict, validate_access_integrity, preprocess)
            if verify_integrity and isinstance(session, SaveSession):  # (an unopened one raised)
                storage = session.storage  # after the commit's finalize, as Megatron-Core's
                request.add_finalize_fn(lambda: _write_integrity_record(storage))
            return request
        session.save(sharded_state_dict, validate_access_integrity, preprocess)
        if verify_integrity and isinstance(session, SaveSession):  # (an unopened one raised)
            _write_integrity_record(session.storage)
        return None


def _write_integrity_record(storage: CheckpointStorage) -> None:
    """Megatron-Core 0.19's ``integrity.json`` of the committed checkpoint. Collective:
    the coordinator lists the objects, every rank reads back and hashes its share (so no
    rank waits for one rank to read them all), the coordinator writes the record; a
    failure anywhere is raised on every rank."""
    what = f"writing {INTEGRITY_FNAME} of checkpoint {redact_uri(storage.uri)!r}"
    items = dist.run_on_coordinator(lambda: integrity_sources(storage), what)
    share = items[dist.get_rank() :: dist.get_world_size()]
    shares = dist.all_gather_agreed(what, lambda: sha256_digests(storage, share))
    digests = {path: digest for part in shares for path, digest in part.items()}
    dist.run_on_coordinator(lambda: write_integrity_record(storage, digests), what)


def get_default_save_sharded_strategy(
    backend: str = "torch_dist", version: int = 1
) -> SaveShardedStrategy:
    """The registered save strategy for ``(backend, version)`` (default torch_dist v1)."""
    strategy: SaveShardedStrategy = get_default_strategy(
        StrategyAction.SAVE_SHARDED, backend, version
    )
    return strategy


def get_default_save_common_strategy(
    backend: str = "torch", version: int = 1
) -> SaveCommonStrategy:
    """The registered common-state save strategy for ``(backend, version)`` (torch v1)."""
    strategy: SaveCommonStrategy = get_default_strategy(
        StrategyAction.SAVE_COMMON, backend, version
    )
    return strategy


def get_default_load_sharded_strategy(
    checkpoint_dir: CheckpointDir,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> LoadShardedStrategy:
    """The registered load strategy for the backend and version ``metadata.json`` of
    the checkpoint at ``checkpoint_dir`` records.

    Raises:
        CheckpointNotFoundError / UncommittedCheckpointError: as :func:`load`.
    """
    uri = checkpoint_uri(checkpoint_dir)
    backends = open_committed(open_storage(uri, None, storage_options, config)).backends
    strategy: LoadShardedStrategy = get_default_strategy(
        StrategyAction.LOAD_SHARDED, backends.sharded_backend, backends.sharded_backend_version
    )
    return strategy


def _save_strategy(action: StrategyAction, strategy: Any, default: tuple[str, int]) -> Any:
    if strategy is None:
        strategy = default
    if isinstance(strategy, tuple):
        return get_default_strategy(action, *strategy)
    return strategy


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: CheckpointDir,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    verify_integrity: bool = False,
    process_group: Any = None,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    verify_checksums: bool = False,
    weights_only: bool | None = None,
) -> LoadResult:
    """Load a checkpoint into the layout ``sharded_state_dict`` describes. Collective.

    Args:
        sharded_state_dict: what to load: ShardedTensors (any sharding; data, if
            given, only sets the device), ShardedObjects, ShardedTensorFactories,
            LocalNonpersistentObjects (returned unwrapped, not read).
        checkpoint_dir: the checkpoint URI or local path (``str`` or ``os.PathLike``).
        sharded_strategy / common_strategy: override the strategies chosen from the
            checkpoint's metadata.json (they must be compatible with it).
        validate_access_integrity: validate the requested sharding across ranks.
        strict: a StrictHandling mode, or its value as a string: what to do with
            *missing* keys (stored, requested by no rank; ``*_ALL`` modes only) and
            *unexpected* keys (requested here, not stored; dropped by every mode but
            ``ASSUME_OK_UNEXPECTED``), as in Megatron-Core.
        verify_integrity: before loading, read every object of the checkpoint and check
            its size and CRC-32C against the manifest (as ``cloudckpt verify --deep``;
            every rank reads a share, every rank gets the verdict), as Megatron-Core 0.19 checks its
            ``integrity.json``. A checkpoint without a manifest (Megatron-Core's own) is
            checked against that ``integrity.json`` (SHA-256 of every file it lists);
            without either it cannot be checked and raises.
        process_group: the ranks whose requests together describe one complete
            sharded state dict: the access-integrity validation and the ``*_ALL``
            strict modes consider this group's requests (default: every rank's), as in
            Megatron-Core 0.19. The load itself is still a collective of every rank.
        storage_options: fsspec options for the URI's filesystem.
        config: a training-config section (storage options, in-flight requests, part
            size for ranged reads).
        verify_checksums: check the CRC-32C of every object a read touches, reading
            partly needed objects whole. Without it, objects read whole are still checked
            against the manifest's CRC-32C, and every read against its size.
        weights_only: unpickle ``common.pt``, ShardedObjects and DCP ``.metadata``
            restricted to the allow-list (True), without restriction (False: for
            checkpoints you trust only, as Megatron-Core loads), or restricted unless
            ``CLOUDCKPT_TRUST_PICKLES=1`` (None, the default); a strategy's own
            ``weights_only`` wins. See :mod:`cloudckpt.safe_pickle`.

    Returns:
        The loaded state dict (common state merged with the loaded shards), or with a
        ``RETURN_*`` mode, ``(state_dict, missing_keys, unexpected_keys)``.

    Raises:
        CheckpointNotFoundError: nothing at the URI.
        CheckpointKeyNotFoundError: a requested key is not stored in the checkpoint (a
            ``KeyError``, deliberately not a ``FileNotFoundError``).
        UncommittedCheckpointError: the checkpoint was never committed (names the
            missing metadata.json or manifest.json).
        CorruptObjectError: an object's size or CRC-32C differs from the manifest's
            (``IntegrityCheckError`` from ``verify_integrity``, listing every problem).
        UnexpectedKeysError: ``RAISE_*`` and this rank requested keys the checkpoint does
            not hold (Megatron-Core's "unexpected keys").
        MissingKeysError: ``RAISE_ALL`` and the checkpoint holds keys no rank requested
            (Megatron-Core's "missing keys").
        TorchDistKeyNotFoundError: ``ASSUME_OK_UNEXPECTED`` (the default) and a requested
            key is not in a torch_dist checkpoint; it is also PyTorch's
            ``CheckpointException``, which Megatron-Core lets through there.
        UnsafePickleError: a pickle needs a global outside the allow-list (names it).
        CollectiveError: a rank died, froze or stayed away from a collective.
    """
    uri = checkpoint_uri(checkpoint_dir)
    with (
        weights_only_scope(weights_only),
        dist.bounded(config),
        dist.paused_gc(),
        dist.coordinating(),
    ):
        if verify_integrity:
            check_integrity(uri, storage_options, config)
        state, missing, unexpected = load_checkpoint(
            uri,
            sharded_state_dict,
            strict,
            validate_access_integrity,
            lambda: LoadSession.open(
                uri,
                sharded_strategy,
                common_strategy,
                storage_options=storage_options,
                config=config,
                verify_checksums=verify_checksums,
            ),
            group=process_group,
        )
    if StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict)):
        return state, missing, unexpected
    return state


def _run(fn: Callable[[], _T], what: str, collective: bool, weights_only: bool | None) -> _T:
    """``fn()`` on this rank, or (collective) on rank 0 with the outcome on every rank,
    with pickles loaded as ``weights_only`` says."""
    with weights_only_scope(weights_only):
        if collective:
            return dist.run_on_coordinator(fn, what)
        return fn()


def _session(
    uri: str,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
    *,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None,
) -> LoadSession:
    return LoadSession.open(
        uri, sharded_strategy, common_strategy, storage_options=storage_options, config=config
    )


def load_common_state_dict(
    checkpoint_dir: CheckpointDir,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
    weights_only: bool | None = None,
) -> StateDict:
    """Load only the common (non-sharded) state of a checkpoint.

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        storage_options / config / weights_only: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).

    Raises:
        UnsafePickleError: ``common.pt`` needs a global outside the allow-list.
    """
    uri = checkpoint_uri(checkpoint_dir)
    return _run(
        lambda: _session(uri, storage_options=storage_options, config=config).common_state(),
        f"loading the common state of {redact_uri(uri)!r}",
        collective,
        weights_only,
    )


def load_content_metadata(
    checkpoint_dir: CheckpointDir | None = None,
    *,
    preloaded_state_dict: StateDict | None = None,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> dict[str, Any] | None:
    """The ``content_metadata`` given to :func:`save`, or None if it was given none.

    Args:
        checkpoint_dir: the checkpoint (its common state is read), unless
            ``preloaded_state_dict`` is given.
        preloaded_state_dict: a state dict already loaded from the checkpoint (the
            result of :func:`load` or :func:`load_common_state_dict`): no read.
        storage_options / config: as for :func:`load`.

    Raises:
        ValueError: neither ``checkpoint_dir`` nor ``preloaded_state_dict`` is given.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("Both checkpoint_dir and preloaded_state_dict cannot be None")
        preloaded_state_dict = load_common_state_dict(
            checkpoint_dir, storage_options=storage_options, config=config
        )
    metadata: dict[str, Any] | None = preloaded_state_dict.get(CONTENT_METADATA_KEY)
    return metadata


def load_tensors_metadata(
    checkpoint_dir: CheckpointDir,
    sharded_strategy: LoadShardedStrategy | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
    weights_only: bool | None = None,
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` with each stored tensor's global shape and dtype (no data).

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        sharded_strategy: overrides the strategy chosen from the checkpoint's metadata.
        storage_options / config / weights_only: as for :func:`load` (``weights_only``
            governs a torch_dist checkpoint's ``.metadata``).
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)
    return _run(
        lambda: _session(
            uri, sharded_strategy, storage_options=storage_options, config=config
        ).tensors_metadata(),
        f"reading the tensors of {redact_uri(uri)!r}",
        collective,
        weights_only,
    )


def load_sharded_metadata(
    checkpoint_dir: CheckpointDir,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
    weights_only: bool | None = None,
) -> ShardedStateDict:
    """Metadata (no data) of every stored ShardedTensor and ShardedObject.

    Keys are tensor keys and, for objects, their ``unique_key``.

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        sharded_strategy / common_strategy: override the strategies chosen from the
            checkpoint's metadata.
        storage_options / config / weights_only: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)
    return _run(
        lambda: _session(
            uri, sharded_strategy, common_strategy, storage_options=storage_options, config=config
        ).sharded_metadata(),
        f"reading the metadata of {redact_uri(uri)!r}",
        collective,
        weights_only,
    )


def load_plain_tensors(
    checkpoint_dir: CheckpointDir,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    weights_only: bool | None = None,
) -> StateDict:
    """Load every stored tensor whole (plus the common state), without a sharding spec.

    ``storage_options`` / ``config`` / ``weights_only``: as for :func:`load`.
    """
    metadata = load_tensors_metadata(
        checkpoint_dir, storage_options=storage_options, config=config, weights_only=weights_only
    )
    for sh in metadata.values():
        if isinstance(sh, ShardedTensor):
            sh.data = None
    return load(
        metadata,
        checkpoint_dir,
        validate_access_integrity=False,  # type: ignore[return-value]
        storage_options=storage_options,
        config=config,
        weights_only=weights_only,
    )


def remove_sharded_tensors(
    checkpoint_dir: CheckpointDir,
    key_prefix: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
) -> None:
    """Delete every stored tensor whose key starts with ``key_prefix``.

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        key_prefix: tensors whose key starts with it are removed.
        storage_options / config: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)
    _run(
        lambda: _session(
            uri, storage_options=storage_options, config=config
        ).remove_sharded_tensors(key_prefix),
        f"removing tensors {key_prefix!r}* from {redact_uri(uri)!r}",
        collective,
        None,
    )


def check_is_distributed_checkpoint(
    checkpoint_dir: CheckpointDir,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> bool:
    """True when ``checkpoint_dir`` holds a committed checkpoint: its metadata.json and,
    when cloudckpt wrote it, its manifest.json."""
    storage = open_storage(checkpoint_uri(checkpoint_dir), None, storage_options, config)
    return read_commit_state(storage).committed
