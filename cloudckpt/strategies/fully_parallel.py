"""Fully parallel save and load: spread the work on replicated shards over their replicas.

Megatron-Core's names and behaviour (``megatron.core.dist_checkpointing.strategies.
fully_parallel``, 0.15). Both wrappers take another strategy and a process group (by
default the world; usually the data-parallel group is what the replicas span):

* :class:`FullyParallelSaveStrategyWrapper` - before the wrapped strategy saves, the
  ranks of the group exchange the metadata (no data) of their ShardedTensors, and
  every shard that several ranks hold (same key, global offset and flattened range)
  is given to exactly one of them, greedily balanced by bytes
  (:func:`cloudckpt.exchange_utils.determine_main_replica_uniform_distribution`). The
  chosen rank's copy becomes the main replica (``replica_id`` 0), every other copy
  ``replica_id`` 1, so the wrapped strategy, which writes main replicas only, writes
  each byte once and every rank a similar share. Shards whose main replica lies in
  another group are left to that group.
* :class:`FullyParallelLoadStrategyWrapper` - every shard requested by several ranks
  of the group is read by one of them (balanced the same way), and the read tensors
  are exchanged over ``torch.distributed`` (``exchange_algo``: ``"broadcast"`` by
  default, or Megatron's ``"gather_object"`` / ``"gather_rounds"``; gloo on CPU
  works), instead of every replica downloading it. ShardedObjects, when the wrapped
  strategy reads them, are read by the rank holding their main replica and shared
  with ``all_gather_object``: the one that also agrees, across the world, that every
  rank's reads succeeded (the wrapped strategy is called once, for the objects and
  tensors together).

What each adds to a plain save or load, in collectives: a save, one (the gather of
the group's metadata when the distribution is computed, checked on that metadata
without gathering it again across the world; or the cache's integer all-reduce); a
load, two (the distribution's, and the agreement on the reads that carries the
objects), plus the exchange's broadcasts (no check-in: they follow that agreement).
On one host a fully parallel load cannot beat a plain one: the exchange moves, over
the process group's transport, the bytes each replica would otherwise read from the
page cache (``benchmarks/profile_fully_parallel.py`` measures both).

Both wrappers work with cloudckpt's sessions (the save wrapper's format,
:class:`ParallelFormat`, wraps the wrapped strategy's once; the load wrapper's
``load_from`` reads the checkpoint the session opened) and through Megatron-Core's URI
methods; in a group of one
rank they do nothing but call the wrapped strategy.

With ``do_cache_distribution``, the distribution computed by one call is reused by the
next ones while the structure of the state dict (this rank's shard ids, sizes and
main-replica flags) stays the same; one integer all-reduce per call checks that on
every rank of the group, and a change anywhere recomputes the distribution.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from cloudckpt import dist
from cloudckpt.dict_utils import (
    merge,
    nested_values,
)
from cloudckpt.errors import CheckpointingException
from cloudckpt.exchange_utils import (
    ShardDistribution,
    _distribution_of,
    _exchange_broadcast,
    _gather_shard_metadata,
    _merge_unique,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
)
from cloudckpt.formats.foreign import save_format_of, sharded_loader_of
from cloudckpt.formats.protocol import FormatTraits, PlannedWrite, SaveFormat
from cloudckpt.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
)
from cloudckpt.replicas import (
    DistributionCache,
    check_group_replicas,
    default_group,
    defer_loading_sharded_items,
    distribute_main_replicas_with_precomputed_distribution,
    fill_in_deferred_sharded_items,
    local_structure,
    require_received,
)
from cloudckpt.storage.location import CheckpointDir, checkpoint_uri
from cloudckpt.strategies.async_utils import check_async_strategy
from cloudckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SaveShardedStrategy,
)
from cloudckpt.utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId

if TYPE_CHECKING:
    from cloudckpt.config import CheckpointConfig
    from cloudckpt.manifest import TensorEntry
    from cloudckpt.storage import CheckpointStorage
    from cloudckpt.strategies.async_utils import AsyncRequest

logger = logging.getLogger(__name__)

T = TypeVar("T", ShardedObject, ShardedTensor)

EXCHANGE_ALGOS = ("broadcast", "gather_object", "gather_rounds")

# Megatron-Core's module-level names for the load's split (cloudckpt.replicas)
_defer_loading_sharded_items = defer_loading_sharded_items
_fill_in_deferred_sharded_items = fill_in_deferred_sharded_items

_OBJECTS, _TENSORS = "objects", "tensors"
"""The two parts of a fully parallel load's one call of the wrapped strategy."""


class _WrappedStorageSettings:
    """The storage settings a session reads from a strategy (``fs``, ``storage_options``,
    ``config``) and ``can_handle_sharded_objects``: a wrapper's are those of the strategy
    it wraps; and the cached distribution, which both wrappers keep alike."""

    base_strategy: SaveShardedStrategy | LoadShardedStrategy
    _cache: DistributionCache

    @property
    def fs(self) -> Any:
        """The wrapped strategy's filesystem, if it has one."""
        return getattr(self.base_strategy, "fs", None)

    @property
    def storage_options(self) -> Any:
        """The wrapped strategy's fsspec options, if it has them."""
        return getattr(self.base_strategy, "storage_options", None)

    @property
    def config(self) -> Any:
        """The wrapped strategy's CheckpointConfig, if it has one."""
        return getattr(self.base_strategy, "config", None)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """As the wrapped strategy."""
        return bool(self.base_strategy.can_handle_sharded_objects)

    @property
    def cached_distribution(self) -> ShardDistribution | None:
        """The distribution kept for the next save or load (None: nothing cached)."""
        return self._cache.distribution

    @cached_distribution.setter
    def cached_distribution(self, distribution: ShardDistribution | None) -> None:
        self._cache.store(distribution, None)


class FullyParallelSaveStrategyWrapper(_WrappedStorageSettings, AsyncSaveShardedStrategy):
    """Wraps a save strategy and spreads the writing of replicated shards over the
    ranks that hold them, balanced by bytes; only metadata is exchanged.

    The wrapped strategy must write exactly the main replicas (``replica_id`` 0), as
    every cloudckpt and Megatron-Core strategy does.

    Args:
        strategy: the save strategy to wrap (its backend and version are recorded).
        parallelization_group: the ranks to spread over (default: the world). It need
            not match the data-parallel group exactly, but should cover the replicas.
        do_cache_distribution: reuse the distribution across saves while the structure
            of the state dict does not change (checked with one all-reduce).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy: SaveShardedStrategy = strategy
        self.parallelization_group = default_group(parallelization_group)
        self.do_cache_distribution = do_cache_distribution
        self._cache = DistributionCache()

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Choose which rank writes each shard and set the replica ids accordingly.

        Collective over the parallelization group: one ``all_gather_object`` of the
        shards' metadata when the distribution is computed, one integer all-reduce when
        a cached one is checked. A computed distribution is checked on the gathered
        metadata, without another collective (:func:`check_group_replicas`): the
        sharding across the world was validated by the save before (Megatron-Core
        gathers every rank's metadata across the world again to validate it); moving
        the main replica of a shard between the group's ranks that hold it keeps every
        tensor covered exactly once by main replicas.
        """
        started = time.perf_counter()
        group = self.parallelization_group
        if dist.get_world_size(group) <= 1:
            return
        structure = local_structure(sharded_state_dict)
        cached = self.do_cache_distribution and self._cache.reusable(structure, group)
        if cached:
            distribution = self._cache.distribution
        else:
            gathered = _gather_shard_metadata(sharded_state_dict, group)
            check_group_replicas(gathered)
            distribution = _distribution_of(gathered)
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, group, distribution
        )
        if self.do_cache_distribution:
            self._cache.store(distribution, structure)
        logger.debug(
            "rank %d: save distribution %s in %.3f s",
            dist.get_rank(),
            "reused" if cached else "computed",
            time.perf_counter() - started,
        )

    def save_format(self) -> ParallelFormat:
        """The wrapped strategy's format, planned after the distribution (what a session
        drives)."""
        return ParallelFormat(save_format_of(self.base_strategy), self)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir) -> Any:
        """Distribute, then save with the wrapped strategy (its return value)."""
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_uri(checkpoint_dir))

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: CheckpointDir,
        async_strategy: str | None = "nvrx",
    ) -> AsyncRequest:
        """Distribute, then return the wrapped strategy's async request (Megatron-Core
        0.19's ``async_strategy``, "nvrx" or "mcore", is checked; either runs this).

        Raises:
            CheckpointingException: the wrapped strategy cannot save asynchronously.
            UnknownAsyncStrategyError: another ``async_strategy``.
        """
        check_async_strategy(async_strategy)
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"cannot save asynchronously with {self.base_strategy}: it is not an "
                "AsyncSaveShardedStrategy"
            )
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_uri(checkpoint_dir))


@dataclass(frozen=True)
class ParallelFormat:
    """A format whose plan first spreads the main replicas over the group's ranks
    (:meth:`FullyParallelSaveStrategyWrapper.apply_saving_parallelization`, collective);
    everything else is the wrapped format's."""

    base: SaveFormat
    wrapper: FullyParallelSaveStrategyWrapper

    @property
    def traits(self) -> FormatTraits:
        return self.base.traits

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        return self.base.tensor_entries(tensors, config)

    def plan(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
        *,
        staged: bool = False,
    ) -> PlannedWrite:
        self.wrapper.apply_saving_parallelization(sharded_state_dict)
        return self.base.plan(storage, sharded_state_dict, config, staged=staged)


class FullyParallelLoadStrategyWrapper(_WrappedStorageSettings, LoadShardedStrategy):
    """Wraps a load strategy: each shard requested by several ranks of the group is
    read once, by one of them, and exchanged over ``torch.distributed``.

    Args:
        strategy: the load strategy to wrap.
        parallelization_group: the ranks to spread over (default: the world; usually
            the data-parallel group).
        do_cache_distribution: reuse the load distribution across loads while the
            requested structure does not change (a load distribution is never reused
            for a save: the two are not symmetric).
        exchange_algo: ``"broadcast"`` (default), ``"gather_object"`` or
            ``"gather_rounds"``.

    Raises:
        ValueError: an unknown ``exchange_algo``.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Any = None,
        do_cache_distribution: bool = False,
        exchange_algo: str = "broadcast",
    ) -> None:
        if exchange_algo not in EXCHANGE_ALGOS:
            raise ValueError(
                f"unknown exchange_algo {exchange_algo!r}; expected one of {EXCHANGE_ALGOS}"
            )
        self.base_strategy: LoadShardedStrategy = strategy
        self.parallelization_group = default_group(parallelization_group)
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self._cache = DistributionCache()
        self.cached_global_metadata: Any = None  # Megatron-Core's attribute; unused here

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """As the wrapped strategy."""
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        """As the wrapped strategy."""
        self.base_strategy.check_version_compatibility(loaded_version)

    # -- loading ---------------------------------------------------------------------------

    @property
    def stream_ckpt_dequant(self) -> bool:
        """The wrapped strategy's ``stream_ckpt_dequant`` (Megatron-Core 0.19's; False
        when it has none)."""
        return bool(getattr(self.base_strategy, "stream_ckpt_dequant", False))

    def load(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: CheckpointDir,
        async_strategy: str | None = "mcore",
    ) -> StateDict:
        """Load ``sharded_state_dict`` from ``checkpoint_dir``, each shard read once in the
        group. Collective over the group. Megatron-Core 0.19's ``async_strategy`` is
        checked; loads are the same for either."""
        check_async_strategy(async_strategy)
        uri = checkpoint_uri(checkpoint_dir)
        return self._load(sharded_state_dict, lambda part: self.base_strategy.load(part, uri))

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        """:meth:`load` on a checkpoint a session opened."""
        loader = sharded_loader_of(self.base_strategy, storage.uri)
        return self._load(sharded_state_dict, lambda part: loader.load_from(storage, part))

    def _load(self, sharded_state_dict: ShardedStateDict, read: Callable[[Any], Any]) -> StateDict:
        """Distribute, read this rank's share, exchange, fill every request in.

        Steps: (1) the ranks exchange the metadata of what they request; (2) each
        computes the same assignment of shards to readers; (3) each reads its shards
        (and the ShardedObjects whose main replica it holds); (4) the read tensors and
        objects are exchanged. A read failing on one rank fails on every rank before
        the exchange starts: the agreement on the reads is one ``all_gather_object``
        over the world that also carries the objects read (so the world is joined
        once, and the broadcasts of the exchange need no check-in of their own).
        """
        group = self.parallelization_group
        if dist.get_world_size(group) <= 1:
            loaded: StateDict = read(sharded_state_dict)
            return loaded
        distribution = self.apply_loading_parallelization(sharded_state_dict)
        if distribution is None:
            raise CheckpointingException("no load distribution for a group of several ranks")
        tensors, rest, to_load, unloaded = self._defer_loading_sharded_tensors(sharded_state_dict)
        objects, rest, objects_to_load, objects_unloaded = self._defer_loading_sharded_objects(rest)
        leftover = list(nested_values(rest))
        if leftover:
            raise CheckpointingException(
                f"fully parallel load got {len(leftover)} value(s) that are neither "
                f"ShardedTensors nor ShardedObjects: {leftover[:5]}"
            )
        tensors_read: dict[_ShardId, torch.Tensor] = {}

        def read_share() -> dict[_ShardId, Any]:
            # one call of the wrapped strategy for the objects and tensors this rank
            # reads (called even with nothing to read: it may be collective)
            got = read({_OBJECTS: objects_to_load, _TENSORS: to_load})
            tensors_read.update(got.get(_TENSORS) or {})
            return dict(got.get(_OBJECTS) or {})

        # one collective of the world: the agreement on the reads carries the objects
        # read (Megatron-Core all-gathers them across the world after the exchange)
        objects_read = dist.all_gather_agreed(
            "reading this rank's share of a fully parallel load", read_share
        )
        all_tensors = self._exchange(tensors_read, unloaded, distribution)
        require_received(unloaded, all_tensors, "tensor")
        all_objects = _merge_unique(objects_read, "object")
        require_received(objects_unloaded, all_objects, "object")
        self.fill_in_deferred_sharded_tensors(tensors, all_tensors)
        self.fill_in_deferred_sharded_objects(objects, all_objects)
        result: StateDict = {}
        merge(result, objects)
        merge(result, tensors)
        return result

    def _exchange(
        self,
        loaded_tensors: dict[_ShardId, torch.Tensor],
        unloaded: dict[_ShardId, ShardedTensor],
        distribution: ShardDistribution,
    ) -> dict[_ShardId, torch.Tensor]:
        """Exchange the read tensors (right after the agreement on the reads, a
        collective of the world, so the broadcast exchange needs no check-in)."""
        group = self.parallelization_group
        if self.exchange_algo == "broadcast":
            return _exchange_broadcast(
                loaded_tensors, unloaded, distribution, group, check_in=False
            )
        return exchange_by_distribution(
            loaded_tensors, unloaded, distribution, group, self.exchange_algo
        )

    def apply_loading_parallelization(
        self, sharded_state_dict: ShardedStateDict
    ) -> ShardDistribution | None:
        """Choose which rank reads each requested shard and mark it (``replica_id`` 0
        on the reader, 1 elsewhere). Collective over the group.

        Returns:
            The distribution (None in a group of one rank).
        """
        group = self.parallelization_group
        structure = local_structure(sharded_state_dict)
        cached = self.do_cache_distribution and self._cache.reusable(structure, group)
        if cached:
            distribution = self._cache.distribution
        else:
            distribution = determine_main_replica_uniform_distribution(
                sharded_state_dict, group, True
            )
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, group, distribution
        )
        if self.do_cache_distribution:
            self._cache.store(distribution, structure)
        return distribution

    @staticmethod
    def _defer_loading_sharded_tensors(
        sharded_state_dict: ShardedStateDict,
    ) -> tuple[
        ShardedStateDict,
        ShardedStateDict,
        dict[_ShardId, ShardedTensor],
        dict[_ShardId, ShardedTensor],
    ]:
        return defer_loading_sharded_items(
            sharded_state_dict, ShardedTensor, _sharded_tensor_shard_id
        )

    @staticmethod
    def _defer_loading_sharded_objects(
        sharded_state_dict: ShardedStateDict,
    ) -> tuple[
        ShardedStateDict,
        ShardedStateDict,
        dict[_ShardId, ShardedObject],
        dict[_ShardId, ShardedObject],
    ]:
        return defer_loading_sharded_items(sharded_state_dict, ShardedObject, _sharded_object_id)

    @staticmethod
    def fill_in_deferred_sharded_tensors(
        sharded_state_dict: ShardedStateDict, loaded_tensors: dict[_ShardId, torch.Tensor]
    ) -> None:
        """Replace every ShardedTensor of ``sharded_state_dict`` by its loaded tensor.

        Raises:
            CheckpointingException: a tensor's shard id is not in ``loaded_tensors``.
        """
        fill_in_deferred_sharded_items(
            sharded_state_dict, loaded_tensors, ShardedTensor, _sharded_tensor_shard_id
        )

    @staticmethod
    def fill_in_deferred_sharded_objects(
        sharded_state_dict: ShardedStateDict, loaded_objects: dict[_ShardId, Any]
    ) -> None:
        """Replace every ShardedObject of ``sharded_state_dict`` by its loaded value.

        Raises:
            CheckpointingException: an object's shard id is not in ``loaded_objects``.
        """
        fill_in_deferred_sharded_items(
            sharded_state_dict, loaded_objects, ShardedObject, _sharded_object_id
        )

    # -- metadata and removal: the wrapped strategy's ---------------------------------------

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """As the wrapped strategy."""
        return self.base_strategy.load_tensors_metadata(checkpoint_uri(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: CheckpointDir) -> ShardedStateDict:
        """As the wrapped strategy."""
        return self.base_strategy.load_sharded_metadata(checkpoint_uri(checkpoint_dir))

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointDir, key_prefix: str) -> None:
        """As the wrapped strategy."""
        self.base_strategy.remove_sharded_tensors(checkpoint_uri(checkpoint_dir), key_prefix)

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """As the wrapped strategy."""
        return sharded_loader_of(self.base_strategy, storage.uri).tensors_metadata_from(storage)

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """As the wrapped strategy."""
        return sharded_loader_of(self.base_strategy, storage.uri).sharded_metadata_from(storage)

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        """As the wrapped strategy."""
        sharded_loader_of(self.base_strategy, storage.uri).remove_tensors_from(storage, key_prefix)
