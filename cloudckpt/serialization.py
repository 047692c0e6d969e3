"""Entry points: save and load sharded state dicts (Megatron-Core's top-level API).

``save`` runs on every rank with that rank's sharded state dict: factories are
applied, LocalNonpersistentObjects dropped, the sharding validated across ranks,
then every rank writes its main-replica shards, rank 0 the common state, and, after
all ranks succeeded, rank 0 writes ``metadata.json``. ``load`` does the reverse,
resharding to whatever layout the requested state dict describes.

Without an initialised process group, both work in one process (a world of one).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from cloudckpt import dist
from cloudckpt.commit import (
    claim,
    commit,
    describe_claim,
    read_commit_state,
    read_manifest,
    require_committed,
)
from cloudckpt.config import CheckpointConfig, redact_uri
from cloudckpt.core import CheckpointingConfig, load_config
from cloudckpt.dict_utils import (
    dict_list_map_outplace,
    extract_matching_values,
    merge,
    nested_values,
)
from cloudckpt.errors import (
    CheckpointingException,
    CommitConflictError,
    IncompatibleCheckpointError,
    MissingKeysError,
    StrategyNotFoundError,
    UnexpectedKeysError,
)
from cloudckpt.manifest import CLAIM_FNAME, Manifest, TensorEntry, common_key_paths
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from cloudckpt.storage import CheckpointStorage, WriteResult, open_checkpoint, validate_relpath
from cloudckpt.strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    check_compatibility,
    checkpoint_uri,
    get_default_strategy,
)
from cloudckpt.validation import (
    DROPS_MISSING,
    StrictHandling,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_SHARDED_BACKEND = ("zarr", 1)
DEFAULT_COMMON_BACKEND = ("torch", 1)

SaveShardedArg = SaveShardedStrategy | tuple[str, int] | None
SaveCommonArg = SaveCommonStrategy | tuple[str, int] | None
LoadResult = StateDict | tuple[StateDict, set[str], set[str]]


def _with_storage(
    strategy: Any, storage_options: dict[str, Any] | None, config: CheckpointConfig | None = None
) -> Any:
    """A copy of a strategy that uses ``storage_options`` and ``config`` (registered
    strategies are shared, so they are never modified in place)."""
    if not hasattr(strategy, "storage_options"):
        return strategy
    use_options = bool(storage_options) and getattr(strategy, "fs", None) is None
    use_config = config is not None and getattr(strategy, "config", None) is None
    if use_options or use_config:
        strategy = copy.copy(strategy)
        if use_options:
            strategy.storage_options = storage_options
        if use_config:
            strategy.config = config
    return strategy


def _open(
    uri: str,
    strategy: Any,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None = None,
) -> CheckpointStorage:
    storage = open_checkpoint(
        uri,
        getattr(strategy, "fs", None),
        storage_options,
        config=config or getattr(strategy, "config", None),
    )
    _require_shared_store(storage)
    return storage


def _require_shared_store(storage: CheckpointStorage) -> None:
    """Refuse a store the other ranks cannot see (``memory://`` lives in one process)."""
    world = dist.get_world_size()
    if storage.process_local and world > 1:
        raise CheckpointingException(
            f"checkpoint {storage.uri!r} is in this process's memory (memory://), which "
            f"the other {world - 1} rank(s) cannot see: use a local directory or an object "
            f"store URI with {world} ranks (rank {dist.get_rank()})"
        )


def _split_state_dict(
    sharded_state_dict: ShardedStateDict,
) -> tuple[ShardedStateDict, ShardedStateDict, StateDict, ShardedStateDict]:
    """-> (sharded objects, sharded tensors, common state, objects and tensors);
    nonpersistent values dropped."""
    _, persistent = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
    )
    sharded, common = extract_matching_values(persistent, lambda v: isinstance(v, ShardedBase))
    objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
    return objects, tensors, common, sharded


def _local_metadata(sharded: ShardedStateDict, uri: str) -> list[ShardedBase]:
    metadata = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedBase):
            validate_relpath(value.key, uri)
            metadata.append(value.without_data())
    return metadata


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: SaveShardedArg = None,
    common_strategy: SaveCommonArg = None,
    validate_access_integrity: bool = True,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> None:
    """Save a sharded state dict to ``checkpoint_dir`` (a URI or local path). Collective.

    Args:
        sharded_state_dict: this rank's state: ShardedTensors, ShardedObjects,
            ShardedTensorFactories, LocalNonpersistentObjects and plain values
            (the plain values of rank 0 become the common state). Factories are
            applied in place, as in Megatron-Core.
        checkpoint_dir: destination; it must hold no objects yet.
        sharded_strategy: a save strategy or a (backend, version) pair; default: the
            config's backend (zarr) at version 1.
        common_strategy: a common-state strategy or pair; default torch v1.
        validate_access_integrity: check, across ranks, that every tensor is covered
            exactly once by main replicas and that shard metadata agrees.
        storage_options: fsspec options for the URI's filesystem (credentials, endpoint);
            they override the config's and the environment's.
        config: a training-config section (:func:`cloudckpt.config.from_dict`): storage
            options, backend, part size, in-flight requests, chunk size.

    Raises:
        ShardingValidationError: the sharding is inconsistent (every problem listed).
        CheckpointingException: the destination is not empty, or a rank failed to write
            (then every rank raises, naming the failed ranks).
    """
    started = time.perf_counter()
    uri = checkpoint_uri(checkpoint_dir)
    default_sharded = (config.backend, 1) if config is not None else DEFAULT_SHARDED_BACKEND
    sharded_saver: SaveShardedStrategy = _with_storage(
        _save_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, default_sharded),
        storage_options,
        config,
    )
    common_saver: SaveCommonStrategy = _with_storage(
        _save_strategy(StrategyAction.SAVE_COMMON, common_strategy, DEFAULT_COMMON_BACKEND),
        storage_options,
        config,
    )
    shown = redact_uri(uri)  # the URI with any secret redacted, for messages
    with dist.agree(f"opening checkpoint {shown!r}"):
        storage = _open(uri, sharded_saver, storage_options)
        error = _destination_error(storage) if dist.get_rank() == 0 else None
        if error is not None:
            raise error
    parts = _prepare(sharded_state_dict, shown, validate_access_integrity)
    _, tensors, common, _ = parts
    claimed = claim(storage)
    results: list[WriteResult] = [claimed] if claimed is not None else []
    with dist.agree(f"saving checkpoint {shown!r}"), _logged_failure("save", shown):
        results += _write_parts(sharded_saver, common_saver, uri, parts)
    backends = CheckpointingConfig(
        sharded_saver.backend, sharded_saver.version, common_saver.backend, common_saver.version
    )
    common_keys = common_key_paths(common) if dist.get_rank() == 0 else []
    entries = _tensor_entries(sharded_saver, tensors)
    commit(storage, results, backends, entries, common_keys, claimed=claimed)
    _log_rate("saved", shown, sum(r.size for r in results), len(results), started)


def _prepare(
    sharded_state_dict: ShardedStateDict, shown: str, validate: bool
) -> tuple[ShardedStateDict, ShardedStateDict, StateDict, ShardedStateDict]:
    """Apply factories, split, check keys and (collectively) the sharding. A local
    failure (a bad key, a factory error) is raised on every rank, naming the rank."""
    with dist.agree(f"preparing checkpoint {shown!r}"):
        apply_factories(sharded_state_dict)
        parts = _split_state_dict(sharded_state_dict)
        local_metadata = _local_metadata(parts[0], shown) + _local_metadata(parts[1], shown)
    if validate:
        validate_sharding_integrity(dist.all_gather_object(local_metadata), shown)
    result: tuple[ShardedStateDict, ShardedStateDict, StateDict, ShardedStateDict] = parts
    return result


def _write_parts(
    sharded_saver: SaveShardedStrategy,
    common_saver: SaveCommonStrategy,
    uri: str,
    parts: tuple[ShardedStateDict, ShardedStateDict, StateDict, ShardedStateDict],
) -> list[WriteResult]:
    """Write this rank's part of the checkpoint. ``parts`` is what
    :func:`_split_state_dict` returns; sharded objects go to the sharded strategy when it
    handles them (torch_dist: DCP items), else to the common strategy."""
    objects, tensors, common, sharded = parts
    with_objects = sharded_saver.can_handle_sharded_objects
    results: list[WriteResult] = sharded_saver.save(sharded if with_objects else tensors, uri) or []
    if dist.get_rank() == 0:
        results += common_saver.save_common(common, uri) or []
    if not with_objects:
        results += common_saver.save_sharded_objects(objects, uri) or []
    return results


def _tensor_entries(strategy: Any, tensors: ShardedStateDict) -> list[TensorEntry]:
    """This rank's tensors for the manifest: the strategy's chunking where it has one."""
    shards = [v for v in nested_values(tensors) if isinstance(v, ShardedTensor)]
    describe = getattr(strategy, "tensor_entries", None)
    if describe is not None:
        entries: list[TensorEntry] = describe(shards)
        return entries
    return [
        TensorEntry(sh.key, tuple(sh.global_shape), str(sh.dtype).removeprefix("torch."))
        for sh in shards
    ]


def _log_rate(verb: str, uri: str, nbytes: int, count: int, started: float) -> None:
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


def _save_strategy(action: StrategyAction, strategy: Any, default: tuple[str, int]) -> Any:
    if strategy is None:
        strategy = default
    if isinstance(strategy, tuple):
        return get_default_strategy(action, *strategy)
    return strategy


@contextlib.contextmanager
def _logged_failure(verb: str, shown: str) -> Iterator[None]:
    """Log this rank's own failure (the agreement then raises it on every rank)."""
    try:
        yield
    except Exception as exc:
        logger.error("rank %d failed to %s %s: %s", dist.get_rank(), verb, shown, exc)
        raise


def _destination_error(storage: CheckpointStorage) -> CheckpointingException | None:
    if storage.is_empty():
        return None
    where = f"checkpoint destination {storage.uri!r} is not empty"
    if read_commit_state(storage).committed:
        return CommitConflictError(
            f"{where}: it holds a committed checkpoint; refusing to overwrite (choose a new "
            "URI or remove it with `cloudckpt rm`)"
        )
    if storage.exists(CLAIM_FNAME):
        return CommitConflictError(
            f"{where}: another save claimed it ({describe_claim(storage)}); it is still "
            "running, or it failed and left an uncommitted checkpoint (`cloudckpt gc` "
            "removes those)"
        )
    return CheckpointingException(
        f"{where}; refusing to overwrite (choose a new URI or remove what is there)"
    )


def _load_strategies(
    storage: CheckpointStorage,
    sharded_strategy: LoadShardedStrategy | None,
    common_strategy: LoadCommonStrategy | None,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None = None,
    verify_checksums: bool = False,
) -> tuple[Any, Any]:
    """The strategies to read this checkpoint with, checked against its metadata.json;
    with a manifest, every read is checked against it.

    Raises:
        UncommittedCheckpointError: naming the missing commit object.
    """
    state = require_committed(storage)
    metadata = load_config(storage)
    manifest = read_manifest(storage) if state.manifest else None
    if sharded_strategy is None:
        sharded_strategy = _registered_loader(
            storage,
            StrategyAction.LOAD_SHARDED,
            metadata.sharded_backend,
            metadata.sharded_backend_version,
        )
    if common_strategy is None:
        common_strategy = _registered_loader(
            storage,
            StrategyAction.LOAD_COMMON,
            metadata.common_backend,
            metadata.common_backend_version,
        )
    check_compatibility(
        sharded_strategy, metadata.sharded_backend, metadata.sharded_backend_version, storage.uri
    )
    check_compatibility(
        common_strategy, metadata.common_backend, metadata.common_backend_version, storage.uri
    )
    expected = _expected_objects(manifest)
    sharded = _with_storage(sharded_strategy, storage_options, config)
    common = _with_storage(common_strategy, storage_options, config)
    checks = (expected, verify_checksums)
    return _checked(sharded, *checks), _checked(common, *checks)


def _expected_objects(manifest: Manifest | None) -> dict[str, WriteResult] | None:
    if manifest is None:
        return None
    return {e.path: WriteResult(e.path, e.size, e.crc32c) for e in manifest.objects}


def _checked(
    strategy: Any, expected: dict[str, WriteResult] | None, verify_checksums: bool
) -> Any:
    """A copy of ``strategy`` whose reads are checked against the manifest's entries."""
    if expected is None or not hasattr(strategy, "expected_objects"):
        return strategy
    strategy = copy.copy(strategy)
    strategy.expected_objects = expected
    strategy.verify_checksums = verify_checksums
    return strategy


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


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
    validate_access_integrity: bool = True,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    verify_checksums: bool = False,
) -> LoadResult:
    """Load a checkpoint into the layout ``sharded_state_dict`` describes. Collective.

    Args:
        sharded_state_dict: what to load: ShardedTensors (any sharding; data, if
            given, only sets the device), ShardedObjects, ShardedTensorFactories,
            LocalNonpersistentObjects (returned unwrapped, not read).
        checkpoint_dir: the checkpoint URI or local path.
        sharded_strategy / common_strategy: override the strategies chosen from the
            checkpoint's metadata.json (they must be compatible with it).
        validate_access_integrity: validate the requested sharding across ranks.
        strict: a StrictHandling mode, or its value as a string.
        storage_options: fsspec options for the URI's filesystem.
        config: a training-config section (storage options, in-flight requests, part
            size for ranged reads).
        verify_checksums: check the CRC-32C of every object a read touches, reading
            partly needed objects whole. Without it, objects read whole are still checked
            against the manifest's CRC-32C, and every read against its size.

    Returns:
        The loaded state dict (common state merged with the loaded shards), or with a
        ``RETURN_*`` mode, ``(state_dict, missing_keys, unexpected_keys)``.

    Raises:
        CheckpointNotFoundError: nothing at the URI.
        CheckpointKeyNotFoundError: a requested key is not stored in the checkpoint (a
            ``KeyError``, deliberately not a ``FileNotFoundError``).
        UncommittedCheckpointError: the checkpoint was never committed (names the
            missing metadata.json or manifest.json).
        CorruptObjectError: an object's size or CRC-32C differs from the manifest's.
        MissingKeysError / UnexpectedKeysError: per ``strict``.
    """
    started = time.perf_counter()
    uri = checkpoint_uri(checkpoint_dir)
    shown = redact_uri(uri)
    with dist.agree(f"opening checkpoint {shown!r}"):
        strict = parse_strict_flag(strict)
        storage = _open(uri, sharded_strategy, storage_options, config)
        sharded_strategy, common_strategy = _load_strategies(
            storage, sharded_strategy, common_strategy, storage_options, config, verify_checksums
        )
        common_state = common_strategy.load_common(uri)
        nonpersistent, requested = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject)
        )
        factories, _ = extract_matching_values(
            requested, lambda v: isinstance(v, ShardedTensorFactory), return_lists_as_dicts=True
        )
        apply_factories(requested)
        sharded, _ = extract_matching_values(requested, lambda v: isinstance(v, ShardedBase))
        local = _local_metadata(sharded, shown)
    sharded, missing, unexpected = _apply_strictness(
        sharded,
        local,
        shown,
        strict,
        validate_access_integrity,
        lambda: _stored_keys(sharded_strategy, common_strategy, uri),
    )
    with dist.agree(f"loading checkpoint {shown!r}"), _logged_failure("load", shown):
        loaded = _load_sharded(sharded_strategy, common_strategy, sharded, uri)
        apply_factory_merges(loaded, factories)
    merge(common_state, loaded)
    merge(common_state, _unwrap(nonpersistent))
    tensors_loaded = [t for t in nested_values(loaded) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors_loaded)
    _log_rate("loaded", storage.uri, nbytes, len(tensors_loaded), started)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state, missing, unexpected
    return common_state


def _load_sharded(
    sharded_strategy: LoadShardedStrategy,
    common_strategy: LoadCommonStrategy,
    sharded: ShardedStateDict,
    uri: str,
) -> StateDict:
    """Load tensors and objects; objects with the sharded strategy when it handles them."""
    if sharded_strategy.can_handle_sharded_objects:  # e.g. torch_dist: objects in DCP
        return sharded_strategy.load(sharded, uri)
    objects, tensors = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))
    loaded = sharded_strategy.load(tensors, uri)
    if objects:
        merge(loaded, common_strategy.load_sharded_objects(objects, uri))
    return loaded


def _unwrap(nonpersistent: StateDict) -> StateDict:
    return dict_list_map_outplace(lambda v: v.unwrap(), nonpersistent)


def _stored_keys(
    sharded_strategy: LoadShardedStrategy, common_strategy: LoadCommonStrategy, uri: str
) -> set[str]:
    """Keys of every stored tensor and object (what strict handling compares against)."""
    stored = {sh.key for sh in sharded_strategy.load_sharded_metadata(uri).values()}
    if not sharded_strategy.can_handle_sharded_objects:
        stored |= {sh.key for sh in common_strategy.load_sharded_metadata(uri).values()}
    return stored


def _apply_strictness(
    sharded: ShardedStateDict,
    local: list[ShardedBase],
    uri: str,
    strict: StrictHandling,
    validate_access_integrity: bool,
    stored_keys: Callable[[], set[str]],
) -> tuple[ShardedStateDict, set[str], set[str]]:
    """Validate the requested sharding and handle missing / unexpected keys per
    ``strict``. Collective; a rank that raises (keys missing there only) makes every
    rank raise. ``local`` is this rank's requested metadata, ``uri`` redacted."""
    needs_global = validate_access_integrity or StrictHandling.requires_global_app_metadata(strict)
    global_metadata = dist.all_gather_object(local) if needs_global else [local]
    if validate_access_integrity:
        validate_sharding_integrity(global_metadata, uri)
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return sharded, set(), set()
    with dist.agree(f"checking the keys of checkpoint {uri!r}"):
        stored = stored_keys()
        missing = {sh.key for sh in local} - stored
        unexpected = stored - {sh.key for shards in global_metadata for sh in shards}
        _report_mismatch(uri, strict, missing, unexpected)
    if missing and strict in DROPS_MISSING:
        _, sharded = extract_matching_values(
            sharded, lambda v: isinstance(v, ShardedBase) and v.key in missing
        )
    return sharded, missing, unexpected


def _report_mismatch(
    uri: str, strict: StrictHandling, missing: set[str], unexpected: set[str]
) -> None:
    where = f"checkpoint {redact_uri(uri)!r}, rank {dist.get_rank()}"
    if strict in (StrictHandling.RAISE_ALL,) and missing:
        raise MissingKeysError(f"{where}: requested keys not in the checkpoint: {sorted(missing)}")
    if strict in (StrictHandling.RAISE_ALL, StrictHandling.RAISE_UNEXPECTED) and unexpected:
        raise UnexpectedKeysError(
            f"{where}: checkpoint keys requested by no rank: {sorted(unexpected)}"
        )
    if strict in (StrictHandling.LOG_ALL,) and missing:
        logger.warning("%s: requested keys not in the checkpoint: %s", where, sorted(missing))
    if strict in (StrictHandling.LOG_ALL, StrictHandling.LOG_UNEXPECTED) and unexpected:
        logger.warning("%s: checkpoint keys requested by no rank: %s", where, sorted(unexpected))


def _run(fn: Callable[[], _T], what: str, collective: bool) -> _T:
    """``fn()`` on this rank, or (collective) on rank 0 with the outcome on every rank."""
    if collective:
        return dist.run_on_coordinator(fn, what)
    return fn()


def load_common_state_dict(
    checkpoint_dir: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
) -> StateDict:
    """Load only the common (non-sharded) state of a checkpoint.

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        storage_options / config: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)

    def read() -> StateDict:
        _, common = _load_strategies(
            _open(uri, None, storage_options, config), None, None, storage_options, config
        )
        state: StateDict = common.load_common(uri)
        return state

    return _run(read, f"loading the common state of {redact_uri(uri)!r}", collective)


def load_tensors_metadata(
    checkpoint_dir: str,
    sharded_strategy: LoadShardedStrategy | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` with each stored tensor's global shape and dtype (no data).

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        sharded_strategy: overrides the strategy chosen from the checkpoint's metadata.
        storage_options / config: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)

    def read() -> ShardedStateDict:
        storage = _open(uri, sharded_strategy, storage_options, config)
        sharded, _ = _load_strategies(storage, sharded_strategy, None, storage_options, config)
        metadata: ShardedStateDict = sharded.load_tensors_metadata(uri)
        return metadata

    return _run(read, f"reading the tensors of {redact_uri(uri)!r}", collective)


def load_sharded_metadata(
    checkpoint_dir: str,
    sharded_strategy: LoadShardedStrategy | None = None,
    common_strategy: LoadCommonStrategy | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
) -> ShardedStateDict:
    """Metadata (no data) of every stored ShardedTensor and ShardedObject.

    Keys are tensor keys and, for objects, their ``unique_key``.

    Args:
        checkpoint_dir: the checkpoint URI or local path.
        sharded_strategy / common_strategy: override the strategies chosen from the
            checkpoint's metadata.
        storage_options / config: as for :func:`load`.
        collective: call on every rank: rank 0 does the I/O and sends the outcome to
            all, so its failure is raised on every rank (default: this rank alone).
    """
    uri = checkpoint_uri(checkpoint_dir)

    def read() -> ShardedStateDict:
        sharded, common = _load_strategies(
            _open(uri, sharded_strategy, storage_options, config),
            sharded_strategy,
            common_strategy,
            storage_options,
            config,
        )
        metadata = dict(sharded.load_sharded_metadata(uri))
        if not sharded.can_handle_sharded_objects:
            metadata.update(common.load_sharded_metadata(uri))
        return metadata

    return _run(read, f"reading the metadata of {redact_uri(uri)!r}", collective)


def load_plain_tensors(
    checkpoint_dir: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> StateDict:
    """Load every stored tensor whole (plus the common state), without a sharding spec."""
    metadata = load_tensors_metadata(
        checkpoint_dir, storage_options=storage_options, config=config
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
    )


def remove_sharded_tensors(
    checkpoint_dir: str,
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

    def remove() -> None:
        sharded, _ = _load_strategies(
            _open(uri, None, storage_options, config), None, None, storage_options, config
        )
        sharded.remove_sharded_tensors(uri, key_prefix)

    _run(remove, f"removing tensors {key_prefix!r}* from {redact_uri(uri)!r}", collective)


def check_is_distributed_checkpoint(
    checkpoint_dir: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> bool:
    """True when ``checkpoint_dir`` holds a committed checkpoint: its metadata.json and,
    when cloudckpt wrote it, its manifest.json."""
    storage = _open(checkpoint_uri(checkpoint_dir), None, storage_options, config)
    return read_commit_state(storage).committed

