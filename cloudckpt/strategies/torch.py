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
:mod:`cloudckpt.formats.dcp.checkpointable`). Saving is collective: DCP gathers the
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

import logging
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.commit_state import amend_manifest
from cloudckpt.config import DEFAULT_CHUNK_SIZE, CheckpointConfig
from cloudckpt.dict_utils import dict_list_map_outplace, nested_values
from cloudckpt.formats.dcp import metadata_cache
from cloudckpt.formats.dcp.checkpointable import (  # Megatron-Core's torch.py has them
    CheckpointableShardedTensor,
    LocalShardsContainer,
    is_nd_flattened,
)
from cloudckpt.formats.dcp.errors import TorchDistSaveError
from cloudckpt.formats.dcp.reader import (
    DcpCheckpoint,
    is_common_state_item,
)
from cloudckpt.formats.dcp.reader import (  # re-exported: the error a missing key raises
    TorchDistKeyNotFoundError as TorchDistKeyNotFoundError,  # noqa: PLC0414
)
from cloudckpt.formats.dcp.save import (
    DcpFormat,
    dcp_save,
    to_dcp_state_dict,
)
from cloudckpt.formats.dcp.steps import SavePlanCache
from cloudckpt.formats.dcp.storage import MCoreMetadata, MCoreSavePlan
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from cloudckpt.storage import CheckpointStorage, FileSystem
from cloudckpt.storage.location import CheckpointDir, checkpoint_uri
from cloudckpt.strategies import filesystem_async
from cloudckpt.strategies._torch_async import AsyncDcpSaveMixin
from cloudckpt.strategies._torch_compat import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest, check_async_strategy
from cloudckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    FormatSaveMixin,
    LoadShardedStrategy,
    ShardedLoadMixin,
    SingleFormatLoadMixin,
    StrategyAction,
    register_default_strategy,
)
from cloudckpt.strategies.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from cloudckpt.strategies.resharding import get_reformulation_metadata
from cloudckpt.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

logger = logging.getLogger(__name__)

BACKEND = "torch_dist"
VERSION = 1


# FormatSaveMixin.save returns the write results where AsyncSaveShardedStrategy.save
# returns None: the synchronous save is cloudckpt's (and richer); mypy flags the overlap.
class TorchDistSaveShardedStrategy(  # type: ignore[misc]
    AsyncDcpSaveMixin, FormatSaveMixin, AsyncSaveShardedStrategy
):
    """Save ShardedTensors and ShardedObjects in the PyTorch DCP format.

    An :class:`~cloudckpt.strategies.base.AsyncSaveShardedStrategy`, as Megatron-Core's:
    :meth:`async_save` returns the save as a request; ``save`` writes synchronously.
    Both, and :func:`cloudckpt.save`, drive the torch_dist format
    (:class:`~cloudckpt.formats.dcp.save.DcpFormat`, :meth:`save_format`).

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
        self.plan_cache = SavePlanCache()  # the format's, while use_cached_ckpt_structure
        if object_size < 1:
            raise ValueError(f"object_size must be a positive number of bytes: {object_size}")
        self.object_size = object_size
        self._set_storage(fs, storage_options, config)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """ShardedObjects are stored as DCP bytes items."""
        return True

    def save_format(self) -> DcpFormat:
        """The torch_dist format with this strategy's settings (what a session drives)."""
        cache = self.plan_cache if self.use_cached_ckpt_structure else None
        return DcpFormat(self.object_size, self.separation_hint, cache, self.config)


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
            ``.metadata`` for the process (also as ``cached_global_metadata``) and
            reuse it when the same checkpoint is loaded again, by this strategy or a
            new one (see :mod:`cloudckpt.formats.dcp.metadata_cache`), instead of
            reading it once per load.
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

    def _checkpoint(self, storage: CheckpointStorage) -> DcpCheckpoint:
        if not self.cache_metadata:
            return DcpCheckpoint(storage, weights_only=self.weights_only)
        key = metadata_cache.cache_key(storage, self.weights_only)
        checkpoint = DcpCheckpoint(
            storage, weights_only=self.weights_only, metadata=metadata_cache.cached(key)
        )
        metadata_cache.remember(key, checkpoint.metadata)
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
        """``{key: ShardedTensor}`` without data, one shard of the whole tensor, for every
        stored tensor, as Megatron-Core's: a tensor saved N-D flattened is described as
        one flat range over its whole original shape (loading it gives the flat tensor)."""
        checkpoint = checkpoint or self._checkpoint(storage)
        out: ShardedStateDict = {}
        for key in checkpoint.tensor_keys():
            dtype = checkpoint.tensor_metadata(key).properties.dtype
            shape = checkpoint.global_shape(key)
            whole = torch.empty(shape, dtype=dtype, device="meta")
            if checkpoint.orig_shape(key) is None:
                sh = ShardedTensor.from_rank_offsets(key, whole)
            else:
                sh = ShardedTensor.from_rank_offsets_flat(
                    key, whole.flatten(), whole.shape, flattened_range=slice(0, whole.numel())
                )
            out[key] = sh.without_data()
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


def get_async_strategy(async_strategy: str = "nvrx", module: str | None = None) -> tuple[str, Any]:
    """Megatron-Core 0.19's: the async machinery for ``async_strategy``, as
    ``(name, {class or function name: object})``, or ``(name, that_dict[module])``.

    cloudckpt runs its own async save for "nvrx" and "mcore" alike (see
    :mod:`cloudckpt.strategies.async_utils`), so both give cloudckpt's classes and the
    name "mcore": Megatron-LM's training loop then takes its Megatron-Core branch
    (no NVIDIA Resiliency Extension is needed; Megatron-Core raises without it).

    Raises:
        UnknownAsyncStrategyError: ``async_strategy`` is neither (a ``TypeError``, as
            Megatron-Core's).
        KeyError: ``module`` is not one of the names.
    """
    check_async_strategy(async_strategy)
    imports: dict[str, Any] = {
        "AsyncCallsQueue": AsyncCallsQueue,
        "AsyncRequest": AsyncRequest,
        "CachedMetadataFileSystemReader": CachedMetadataFileSystemReader,
        "FileSystemWriterAsync": filesystem_async.FileSystemWriterAsync,
        "_results_queue": filesystem_async._results_queue,
        "get_write_results_queue": filesystem_async.get_write_results_queue,
        "save_state_dict_async_finalize": save_state_dict_async_finalize,
        "save_state_dict_async_plan": save_state_dict_async_plan,
    }
    if module is None:
        return "mcore", imports
    if module not in imports:
        raise KeyError(f"get_async_strategy: no {module!r}; the names are {sorted(imports)}")
    return "mcore", imports[module]


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
    "CheckpointableShardedTensor",
    "LocalShardsContainer",
    "is_nd_flattened",
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "MCoreSavePlanner",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "TorchDistSaveError",
    "dcp_save",
    "flatten_state_dict",
    "get_async_strategy",
    "get_reformulation_metadata",
    "mcore_to_pyt_state_dict",
    "register_default_torch_dist_strategies",
    "register_default_torch_strategies",
    "sharded_tensor_to_torch_sharded_tensor",
    "to_dcp_state_dict",
]
