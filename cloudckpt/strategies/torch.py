"""torch_dist backend ("torch_dist", version 1): the PyTorch DCP format, over any URI.

The layout is that of PyTorch DCP's ``FileSystemWriter`` and Megatron-Core's torch_dist
backend, written through :mod:`cloudckpt.storage` (S3, GCS, local, any fsspec URI):

* ``.metadata``: the pickled DCP ``Metadata`` - per key the global shape, dtype and
  chunks of a tensor (or a bytes entry), per stored item its object, offset and
  length; ``mcore_data`` records the original shape of N-D flattened tensors;
* ``__<rank>_<i>.distcp``: data objects, each a concatenation of items: tensors as
  ``torch.save`` bytes, ShardedObjects as ``torch.save`` bytes of a ``BytesIO``
  holding ``torch.save(obj.data)`` (as Megatron-Core stores them).

The DCP key of a ShardedTensor is its ``key``, of a ShardedObject its ``unique_key``.
Only main replicas are written. Flattened shards (distributed-optimizer state) are
stored in Megatron-Core's N-D flattened layout (see
:mod:`cloudckpt.strategies.checkpointable`). Saving is collective: DCP gathers the
plans on the coordinator, which writes ``.metadata`` directly (no temporary file and
rename) after every rank uploaded its data; cloudckpt's commit (``manifest.json``,
then ``metadata.json``) follows. Loading reshards to any requested layout, reading
only the items that overlap the requested shards (ranged reads).

Loading unpickles ``.metadata`` restricted to DCP's metadata types
(:mod:`cloudckpt.formats.dcp.unpickler`) and ShardedObjects as
``torch.load(weights_only=True)`` does with cloudckpt's allow-list
(:mod:`cloudckpt.safe_pickle`); ``weights_only=False`` or ``CLOUDCKPT_TRUST_PICKLES=1``
lifts both restrictions, for checkpoints you trust.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import pickle
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from cloudckpt.commit import amend_manifest
from cloudckpt.config import DEFAULT_CHUNK_SIZE, CheckpointConfig
from cloudckpt.dict_utils import dict_list_map_outplace, nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.errors import TorchDistSaveError, save_failure
from cloudckpt.formats.dcp.plan import LinearGlobalPlanMixin
from cloudckpt.formats.dcp.reader import (
    ORIG_SHAPE_KEY,
    DcpCheckpoint,
    is_common_state_item,
)
from cloudckpt.formats.dcp.reader import (  # re-exported: the error a missing key raises
    TorchDistKeyNotFoundError as TorchDistKeyNotFoundError,  # noqa: PLC0414
)
from cloudckpt.formats.dcp.steps import PlannedSave, SavePlanCache, plan_save, save_state_dict
from cloudckpt.formats.dcp.storage import (
    METADATA_FNAME,
    CloudStorageWriter,
    MCoreMetadata,
    MCoreSavePlan,
    merge_metadata,
)
from cloudckpt.formats.host_copies import HOST_COPIES
from cloudckpt.manifest import TensorEntry
from cloudckpt.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from cloudckpt.safe_pickle import resolve_weights_only
from cloudckpt.storage import CheckpointStorage, FileSystem, WriteResult
from cloudckpt.strategies._torch_async import AsyncDcpSaveMixin
from cloudckpt.strategies._torch_compat import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from cloudckpt.strategies.async_utils import check_async_strategy
from cloudckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    CheckpointDir,
    LoadShardedStrategy,
    SingleFormatLoadMixin,
    StrategyAction,
    checkpoint_uri,
    register_default_strategy,
)
from cloudckpt.strategies.bound import ShardedLoadMixin, ShardedSaveMixin
from cloudckpt.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    is_nd_flattened,
)
from cloudckpt.strategies.resharding import get_reformulation_metadata

logger = logging.getLogger(__name__)

BACKEND = "torch_dist"
VERSION = 1
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def to_dcp_state_dict(
    sharded_state_dict: ShardedStateDict,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """This rank's DCP state dict (main replicas only) and the per-key ``mcore_data``.

    ShardedTensors become CheckpointableShardedTensors (several shards of one key a
    LocalShardsContainer); ShardedObjects become ``BytesIO`` of ``torch.save([data])``,
    the one-element list Megatron-Core stores (and expects) for each object.
    """
    shards: dict[str, list[CheckpointableShardedTensor]] = {}
    state: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            shards.setdefault(value.key, []).append(CheckpointableShardedTensor.from_sh_ten(value))
            if is_nd_flattened(value):
                extra[value.key] = {ORIG_SHAPE_KEY: tuple(value.global_shape)}
        elif isinstance(value, ShardedObject) and is_main_replica(value.replica_id):
            buffer = io.BytesIO()
            torch.save([value.data], buffer)
            state[value.unique_key] = buffer
    for key, local in shards.items():
        state[key] = local[0] if len(local) == 1 else LocalShardsContainer(list(local))
    return state, extra


class _PackedObjectsSavePlanner(LinearGlobalPlanMixin):
    """DCP's default planner, except that bytes items are stored as the ``BytesIO``
    already holds them (``torch.save([data])``, as Megatron-Core stores ShardedObjects)
    instead of being pickled once more. Unlike :class:`MCoreSavePlanner` it leaves the
    metadata a plain DCP ``Metadata`` (the writer adds ``mcore_data``), so that no
    cloudckpt class is pickled into a checkpoint that stock Megatron-Core must read.
    The coordinator's step is linear (:class:`~cloudckpt.formats.dcp.plan.
    LinearGlobalPlanMixin`: DCP's plans and metadata, without DCP's per-item costs)."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


_DCP_LOGGERS = "torch.distributed.checkpoint"
_quiet = threading.local()


class _DcpDebugFilter(logging.Filter):
    """Drops DCP's records below INFO made in a thread inside :func:`quiet_dcp_debug`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or not getattr(_quiet, "depth", 0)


_FILTER = _DcpDebugFilter()


def _dcp_loggers() -> list[logging.Logger]:
    """PyTorch DCP's loggers: its event logger (``c10d-...-dcp_logger``) and every
    ``torch.distributed.checkpoint.*`` logger created so far."""
    from torch.distributed.checkpoint import logger as dcp_logger  # noqa: PLC0415

    found = [dcp_logger._dcp_logger]
    for name, obj in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith(_DCP_LOGGERS) and isinstance(obj, logging.Logger):
            found.append(obj)
    return found


@contextlib.contextmanager
def quiet_dcp_debug() -> Iterator[None]:
    """Keep PyTorch DCP's DEBUG records (an event per DCP call and step) out of the
    caller's handlers while this thread runs cloudckpt's DCP calls. DCP's event logger
    does not propagate, but a logging configuration may make it (``dictConfig``, test
    harnesses); its INFO and WARNING records pass. Other threads are not affected."""
    for dcp_log in _dcp_loggers():
        if _FILTER not in dcp_log.filters:
            dcp_log.addFilter(_FILTER)
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1


def dcp_save(
    state: dict[str, Any], writer: CloudStorageWriter, plan_cache: SavePlanCache | None = None
) -> None:
    """``torch.distributed.checkpoint.save`` with ``writer`` (collective when distributed);
    with ``plan_cache``, the previous save's plans while no rank's plan changed."""
    planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings(), quiet_dcp_debug():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        try:
            save_state_dict(state, writer, planner, plan_cache=plan_cache)
        except CheckpointException as exc:  # a BaseException: made a CheckpointingException
            raise save_failure(exc, writer.storage.uri) from exc


# ShardedSaveMixin.save returns the write results where AsyncSaveShardedStrategy.save
# returns None: the synchronous save is cloudckpt's (and richer); mypy flags the overlap.
class TorchDistSaveShardedStrategy(  # type: ignore[misc]
    AsyncDcpSaveMixin, ShardedSaveMixin, AsyncSaveShardedStrategy
):
    """Save ShardedTensors and ShardedObjects in the PyTorch DCP format.

    An :class:`~cloudckpt.strategies.base.AsyncSaveShardedStrategy`, as Megatron-Core's:
    :meth:`async_save` returns the save as a request; ``save`` (and ``save_to``, which
    sessions call) write synchronously.

    Megatron-Core's constructor arguments come first, in its order:

    Args:
        backend: must be "torch_dist".
        version: format version (1).
        keep_only_main_replica: Megatron-Core's switch between replica_id-based
            de-duplication (True, its recommended default) and DCP's. cloudckpt always
            writes the main replicas only (the same bytes DCP's de-duplication keeps);
            the value is recorded, not used.
        thread_count: Megatron-Core's writer threads per rank. cloudckpt's concurrency
            is the storage pool's ``max_in_flight`` (config) shared by all uploads, and
            the number of objects follows ``object_size``; recorded, not used.
        cached_metadata: reuse the DCP plans of the previous save while the structure
            is unchanged (Megatron-Core's ``ckpt_assume_constant_structure``): the plans
            are not gathered and scattered again. One integer all-reduce per save checks
            every rank's local plan against the cached one; a change plans afresh.
        separation_hint: tensors (and objects) whose key starts with it are written to
            ``.distcp`` objects of their own, as in Megatron-Core.
        cpu_shm_mode: Megatron-Core 0.19's switch that stages GPU tensors in CPU shared
            memory for NVIDIA Resiliency Extension's writer processes. cloudckpt uploads
            from threads of the training process, which read its host staging buffers
            directly; recorded, not used.
        fs: an fsspec filesystem to use instead of resolving one from the URI.
        storage_options: options for the filesystem resolved from the URI.
        object_size: target size in bytes of one ``.distcp`` object (small items share
            an object; a larger item gets its own); the config's ``chunk_size`` wins.
        config: a :class:`~cloudckpt.config.CheckpointConfig`.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
        separation_hint: str | None = None,
        cpu_shm_mode: bool = False,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        object_size: int = DEFAULT_CHUNK_SIZE,
        config: CheckpointConfig | None = None,
    ) -> None:
        super().__init__(backend, version)
        self.cpu_shm_mode = cpu_shm_mode
        if thread_count < 1:
            raise ValueError(f"thread_count must be positive: {thread_count}")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint
        self._init_plan_cache()
        self.plan_cache = SavePlanCache()  # used by save_to while use_cached_ckpt_structure
        if object_size < 1:
            raise ValueError(f"object_size must be a positive number of bytes: {object_size}")
        self.object_size = object_size
        self._set_storage(fs, storage_options, config)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are stored as DCP bytes items."""
        return True

    def _dcp_state(
        self, sharded_state_dict: ShardedStateDict
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        return to_dcp_state_dict(sharded_state_dict)

    def _object_size(self, config: CheckpointConfig | None) -> int:
        """The strategy's own config's chunk size, else the save's, else ``object_size``."""
        config = self.config or config
        if config is not None and config.chunk_size is not None:
            return config.chunk_size
        return self.object_size

    def _batch_bytes(self, config: CheckpointConfig | None) -> int:
        effective = self.config or config or CheckpointConfig()
        return max(self._object_size(config), effective.part_size * effective.max_in_flight)

    def tensor_entries(
        self, tensors: Iterable[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        """Manifest entries (global shape, dtype; no chunking) of ``tensors``: one per
        key (a rank's shards of one tensor share them), each dtype named once."""
        entries: dict[str, TensorEntry] = {}
        names: dict[torch.dtype, str] = {}
        for sh in tensors:
            if sh.key in entries:
                continue
            name = names.get(sh.dtype)
            if name is None:
                name = names[sh.dtype] = str(sh.dtype).removeprefix("torch.")
            entries[sh.key] = TensorEntry(sh.key, tuple(sh.global_shape), name, None)
        return list(entries.values())

    def save_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> list[WriteResult]:
        """Write this rank's main replicas as DCP items. Collective.

        Returns:
            This rank's write results (on the coordinator, ``.metadata`` included).
        """
        state, extra = to_dcp_state_dict(sharded_state_dict)
        writer = self._writer(storage, config, extra)
        with _write_failures(storage.uri):
            dcp_save(state, writer, self.plan_cache if self.use_cached_ckpt_structure else None)
        return writer.results

    def _writer(
        self, storage: CheckpointStorage, config: CheckpointConfig | None, extra: Any
    ) -> CloudStorageWriter:
        return CloudStorageWriter(
            storage,
            self._object_size(config),
            self._batch_bytes(config),
            extra,
            separation_hint=self.separation_hint,
        )

    @property
    def finish_deferrable(self) -> bool:
        """Whether a session may call :meth:`save_deferring_finish` instead of
        :meth:`save_to` (not when a subclass writes differently)."""
        return type(self).save_to is TorchDistSaveShardedStrategy.save_to

    def save_deferring_finish(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> tuple[list[WriteResult], DeferredDcpFinish]:
        """:meth:`save_to` up to DCP's finish: plan (collective) and write this rank's
        items (no collective); the returned finish carries their DCP write results to
        the coordinator in the session's gather of the commit records, where
        :meth:`DeferredDcpFinish.finish_on_coordinator` writes ``.metadata`` before the
        commit (DCP's own gather of the results and broadcast of its verdict are not
        needed: the session's agreement on the writes and the commit's verdict carry
        them). Returns this rank's write results (``.metadata``'s comes from the finish)."""
        state, extra = to_dcp_state_dict(sharded_state_dict)
        writer = self._writer(storage, config, extra)
        planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        cache = self.plan_cache if self.use_cached_ckpt_structure else None
        with warnings.catch_warnings(), quiet_dcp_debug():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            try:
                planned = plan_save(lambda: state, writer, planner, plan_cache=cache)
            except CheckpointException as exc:  # a BaseException: made a CheckpointingException
                raise save_failure(exc, storage.uri) from exc
            with _write_failures(storage.uri):
                items = planned.write()
        return list(writer.results), DeferredDcpFinish(planned, writer, items)

    def stage_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> StagedDcpSave:
        """The blocking half of an async save (``save(..., async_sharded_save=True)``):
        copy this rank's main replicas to host memory and plan (collective; with
        ``cached_metadata``, the previous save's plans while unchanged). The returned
        save serializes the copies and uploads them in :meth:`StagedDcpSave.upload`
        (a background thread) and writes ``.metadata`` in :meth:`StagedDcpSave.finish`.
        """
        writer = CloudStorageWriter(
            storage,
            self._object_size(config),
            self._batch_bytes(config),
            separation_hint=self.separation_hint,
        )

        lent: list[torch.Tensor] = []

        def make_state() -> dict[str, Any]:
            state, extra = to_dcp_state_dict(host_copy(sharded_state_dict, lent))
            writer.mcore_data = dict(extra)
            return state

        planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        cache = self.plan_cache if self.use_cached_ckpt_structure else None
        with warnings.catch_warnings(), quiet_dcp_debug():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            try:
                planned = plan_save(make_state, writer, planner, plan_cache=cache)
            except CheckpointException as exc:
                raise save_failure(exc, storage.uri) from exc
        return StagedDcpSave(planned, writer, lent)

    def batch_writer(
        self, storage: CheckpointStorage, config: CheckpointConfig | None = None
    ) -> DcpBatchWriter:
        """A writer of this checkpoint in several DCP saves (see :class:`DcpBatchWriter`)."""
        return DcpBatchWriter(self, storage, config)


def _metadata_cache_key(
    storage: CheckpointStorage, weights_only: bool | None
) -> tuple[str, int | None, bool]:
    """A checkpoint's ``.metadata`` identity: its URI, the manifest's CRC-32C of it (None
    without a manifest entry, as for Megatron-Core's checkpoints), and whether it is
    unpickled restricted (metadata trusted once is not reused by a restricted load)."""
    entry = storage.expected.entries.get(METADATA_FNAME)
    return storage.uri, None if entry is None else entry.crc32c, resolve_weights_only(weights_only)


def host_copy(
    sharded_state_dict: ShardedStateDict, lent: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """This rank's main replicas, each ShardedTensor with a host copy of its data (a
    shallow copy of the ShardedTensor): what an async save serializes later, while the
    training loop changes its own tensors. Device tensors are copied into the buffers
    :data:`~cloudckpt.formats.host_copies.HOST_COPIES` keeps (pinned with CUDA,
    reused by the next save once ``lent`` - which gets every copy - is released).
    ShardedObjects are kept as they are (:func:`to_dcp_state_dict` serializes them at
    once)."""
    entries: list[Any] = []
    staged: list[ShardedTensor] = []
    tensors: list[torch.Tensor] = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            if value.data is None:
                raise CheckpointingException(f"tensor {value.key!r} has no data to save")
            staged.append(copy.copy(value))
            tensors.append(value.data)
            entries.append(staged[-1])
        elif isinstance(value, ShardedObject) and is_main_replica(value.replica_id):
            entries.append(value)
    copies = HOST_COPIES.copies(tensors)
    for entry, data in zip(staged, copies, strict=True):
        entry.data = data
    if lent is not None:
        lent.extend(copies)
    return {str(i): entry for i, entry in enumerate(entries)}


@contextlib.contextmanager
def _write_failures(uri: str) -> Iterator[None]:
    """Any error of a torch_dist write as a :class:`CheckpointingException` naming ``uri``."""
    try:
        yield
    except CheckpointingException:
        raise
    except Exception as exc:
        raise CheckpointingException(
            f"saving the torch_dist part of checkpoint {uri!r} failed: {exc}"
        ) from exc


class DeferredDcpFinish:
    """The finish of a torch_dist save whose items are written (see
    :meth:`TorchDistSaveShardedStrategy.save_deferring_finish`): :attr:`payload`
    (this rank's DCP write results) travels to the coordinator, which writes
    ``.metadata`` from every rank's."""

    def __init__(self, planned: PlannedSave, writer: CloudStorageWriter, items: list[Any]) -> None:
        self._planned = planned
        self._writer = writer
        self.payload = items

    def finish_on_coordinator(self, payloads: list[Any]) -> list[WriteResult]:
        """Write ``.metadata`` from every rank's :attr:`payload` (by rank; the
        coordinator only); its write result."""
        written = len(self._writer.results)
        with warnings.catch_warnings(), quiet_dcp_debug():
            warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
            self._planned.write_metadata(payloads)  # results in columns where they are
        return list(self._writer.results[written:])


class StagedDcpSave:
    """A torch_dist save planned and copied to host memory (see
    :meth:`TorchDistSaveShardedStrategy.stage_to`)."""

    def __init__(
        self, planned: PlannedSave, writer: CloudStorageWriter, lent: list[torch.Tensor]
    ) -> None:
        self._planned = planned
        self._writer = writer
        self._lent = lent  # the host copies, back to HOST_COPIES once written
        self._items: list[Any] | None = None

    def upload(self) -> None:
        """Serialize and upload this rank's items (no collective). The host copies are
        released once written, or once the upload failed (the save is lost then)."""
        try:
            self._items = self._planned.write()
            self._planned.planner.set_up_planner(
                {}, is_coordinator=self._planned.wrapper.is_coordinator
            )
        finally:
            HOST_COPIES.release(self._lent)
            self._lent = []

    def finish(self) -> list[WriteResult]:
        """Gather every rank's item results; the coordinator writes ``.metadata``.
        Collective; call it after every rank's :meth:`upload` succeeded.

        Returns:
            This rank's write results (the coordinator's include ``.metadata``).

        Raises:
            CheckpointingException: a rank's upload did not run, or ``.metadata`` failed;
                raised on every rank.
        """
        uri = self._writer.storage.uri

        def written() -> list[Any]:
            if self._items is None:
                raise CheckpointingException(f"the upload of {uri!r} did not run on this rank")
            return self._items

        with quiet_dcp_debug():
            try:
                self._planned.finish(written)
            except CheckpointException as exc:
                raise save_failure(exc, uri) from exc
        return self._writer.results


class DcpBatchWriter:
    """Write one torch_dist checkpoint in several DCP saves (single process), for
    :func:`cloudckpt.convert.convert`: each :meth:`add` writes its ``.distcp`` objects,
    :meth:`finish` writes the one ``.metadata`` describing all of them."""

    def __init__(
        self,
        strategy: TorchDistSaveShardedStrategy,
        storage: CheckpointStorage,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.strategy = strategy
        self.storage = storage
        self.config = config
        self.parts: list[Metadata] = []

    def add(self, sharded_state_dict: ShardedStateDict) -> list[WriteResult]:
        """Write one batch's items; returns their write results."""
        state, extra = to_dcp_state_dict(sharded_state_dict)
        writer = CloudStorageWriter(
            self.storage,
            self.strategy._object_size(self.config),
            self.strategy._batch_bytes(self.config),
            extra,
            part=f"{len(self.parts)}_",
            write_metadata=False,
        )
        dcp_save(state, writer)
        assert writer.metadata is not None  # a single process is the coordinator
        self.parts.append(writer.metadata)
        return writer.results

    def finish(self) -> WriteResult:
        """Write ``.metadata`` for every batch added."""
        if not self.parts:
            raise CheckpointingException(f"no batch was written to {self.storage.uri!r}")
        metadata = merge_metadata(self.parts)
        return self.storage.write(METADATA_FNAME, pickle.dumps(metadata))


class TorchDistLoadShardedStrategy(SingleFormatLoadMixin, ShardedLoadMixin, LoadShardedStrategy):
    """Load ShardedTensors and ShardedObjects from a PyTorch DCP checkpoint, resharding.

    Reads checkpoints of cloudckpt, Megatron-Core's torch_dist backend and plain DCP.

    Args:
        backend / version: "torch_dist", 1.
        fs / storage_options: as for the save strategy.
        weights_only: True unpickles ``.metadata`` and ShardedObjects restricted (see
            :mod:`cloudckpt.safe_pickle`); False without restriction (trusted
            checkpoints only); None (default) as the load call or
            ``CLOUDCKPT_TRUST_PICKLES`` says, restricted when neither does.
        cache_metadata: Megatron-Core 0.19's: keep the last checkpoint's DCP
            ``.metadata`` (also as ``cached_global_metadata``) and reuse it when the same
            checkpoint is loaded again (same URI and, for cloudckpt's checkpoints, the
            same manifest CRC-32C of ``.metadata``, so a checkpoint saved again at the
            URI is read afresh; unpickled as restricted as before), instead of reading
            it once per load.
        stream_ckpt_dequant: Megatron-Core 0.19's per-tensor dequantization of
            Transformer Engine FP8 / NVFP4 destinations while loading. Recorded, not
            used: cloudckpt loads into the destination tensors' dtype and has no
            Transformer Engine path (it needs CUDA; see docs/megatron-compat.md).
        checkpoint_name: Megatron-Core 0.19's; recorded, not used.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        weights_only: bool | None = None,
        *,
        cache_metadata: bool = False,
        stream_ckpt_dequant: bool = True,
        checkpoint_name: str | None = None,
    ) -> None:
        self.backend = backend
        self.version = version
        self._set_storage(fs, storage_options)
        self.weights_only = weights_only
        self.cache_metadata = cache_metadata
        self.stream_ckpt_dequant = stream_ckpt_dequant
        self.checkpoint_name = checkpoint_name
        self.cached_global_metadata: Metadata | None = None
        self._metadata_cache: dict[tuple[str, int | None, bool], Metadata] = {}

    def _checkpoint(self, storage: CheckpointStorage) -> DcpCheckpoint:
        if not self.cache_metadata:
            return DcpCheckpoint(storage, weights_only=self.weights_only)
        key = _metadata_cache_key(storage, self.weights_only)
        cached = self._metadata_cache.get(key)
        checkpoint = DcpCheckpoint(storage, weights_only=self.weights_only, metadata=cached)
        self._metadata_cache = {key: checkpoint.metadata}  # the last checkpoint's only
        self.cached_global_metadata = checkpoint.metadata
        return checkpoint

    def load(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: CheckpointDir,
        async_strategy: str | None = "mcore",
    ) -> StateDict:
        """Load ``sharded_state_dict`` from ``checkpoint_dir`` (Megatron-Core 0.19's
        ``async_strategy`` is accepted and checked; loads are the same for either)."""
        check_async_strategy(async_strategy)
        return super().load(sharded_state_dict, checkpoint_uri(checkpoint_dir))

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are read from DCP bytes items."""
        return True

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        """Return ``sharded_state_dict`` with every ShardedTensor and ShardedObject loaded."""
        values = list(nested_values(sharded_state_dict))
        tensors = [v for v in values if isinstance(v, ShardedTensor)]
        objects = [v for v in values if isinstance(v, ShardedObject)]
        if not tensors and not objects:
            return dict_list_map_outplace(lambda v: v, sharded_state_dict)
        checkpoint = self._checkpoint(storage)
        loaded = checkpoint.load_tensors(tensors)
        loaded.update(checkpoint.load_objects(objects))

        def replace(value: Any) -> Any:
            return loaded[id(value)] if isinstance(value, (ShardedTensor, ShardedObject)) else value

        return dict_list_map_outplace(replace, sharded_state_dict)

    def load_tensors_metadata(
        self, checkpoint_dir: CheckpointDir, metadata: Metadata | None = None
    ) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (meta-device data) for every stored tensor.

        Args:
            checkpoint_dir: the checkpoint.
            metadata: its DCP ``.metadata`` when the caller read it already
                (Megatron-Core's argument); it is then not read again.
        """
        storage = self._storage(checkpoint_dir)
        checkpoint = None if metadata is None else DcpCheckpoint(storage, metadata=metadata)
        return self.tensors_metadata_from(storage, checkpoint)

    def tensors_metadata_from(
        self, storage: CheckpointStorage, checkpoint: DcpCheckpoint | None = None
    ) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (meta-device data, one shard) for every stored tensor."""
        checkpoint = checkpoint or self._checkpoint(storage)
        out: ShardedStateDict = {}
        for key in checkpoint.tensor_keys():
            dtype = checkpoint.tensor_metadata(key).properties.dtype
            shape = checkpoint.global_shape(key)
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(shape, dtype=dtype, device="meta")
            )
        return out

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """Tensors (as :meth:`tensors_metadata_from`) and ShardedObjects (by unique key)."""
        checkpoint = self._checkpoint(storage)  # .metadata read once for both
        out = self.tensors_metadata_from(storage, checkpoint)
        for key in checkpoint.object_keys():
            if is_common_state_item(key):  # Megatron-Core 0.19's common state, not an object
                continue
            try:
                obj = ShardedObject.empty_from_unique_key(key)
            except Exception:  # noqa: BLE001 - a bytes item that is no ShardedObject
                logger.debug("bytes item %r is not a ShardedObject; not listed", key)
                continue
            out[obj.unique_key] = obj
        return out

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        """Drop every tensor whose key starts with ``key_prefix`` from ``.metadata``.

        The items stay in the ``.distcp`` objects (they share objects with other items)
        but are no longer reachable. The manifest, when there is one, is rewritten with
        the new ``.metadata``'s size and CRC-32C.
        """
        checkpoint = self._checkpoint(storage)
        metadata = checkpoint.metadata
        removed = {k for k in checkpoint.tensor_keys() if k.startswith(key_prefix)}
        if not removed:
            return
        logger.info("removing tensors %s from %s", sorted(removed), checkpoint.storage.uri)
        metadata.state_dict_metadata = {
            k: v for k, v in metadata.state_dict_metadata.items() if k not in removed
        }
        metadata.storage_data = {
            i: info for i, info in (metadata.storage_data or {}).items() if i.fqn not in removed
        }
        extra = getattr(metadata, "mcore_data", None)
        if extra:
            metadata.mcore_data = {  # type: ignore[attr-defined]
                k: v for k, v in extra.items() if k not in removed
            }
        written = checkpoint.storage.write(METADATA_FNAME, pickle.dumps(metadata))
        amend_manifest(checkpoint.storage, rewritten=[written], removed_tensors=sorted(removed))


def register_default_torch_dist_strategies() -> None:
    """Register the torch_dist save and load strategies as defaults for ("torch_dist", 1)."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION, TorchDistSaveShardedStrategy()
    )
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, VERSION, TorchDistLoadShardedStrategy()
    )


register_default_torch_dist_strategies()


#: Megatron-Core's name for :func:`register_default_torch_dist_strategies`.
register_default_torch_strategies = register_default_torch_dist_strategies

__all__ = [
    "BACKEND",
    "VERSION",
    "DcpBatchWriter",
    "StagedDcpSave",
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "MCoreSavePlanner",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "TorchDistSaveError",
    "dcp_save",
    "flatten_state_dict",
    "get_reformulation_metadata",
    "mcore_to_pyt_state_dict",
    "register_default_torch_dist_strategies",
    "register_default_torch_strategies",
    "sharded_tensor_to_torch_sharded_tensor",
    "to_dcp_state_dict",
]
