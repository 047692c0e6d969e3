"""Megatron-Core's strategy-level asynchronous save for the torch_dist backend.

:class:`AsyncDcpSaveMixin` gives :class:`~cloudckpt.strategies.torch.
TorchDistSaveShardedStrategy` its ``async_save``: planning and staging happen in the
call, the upload in the returned request, ``.metadata`` in its finalize function
(:mod:`cloudckpt.strategies.state_dict_saver` over
:class:`~cloudckpt.strategies.filesystem_async.FileSystemWriterAsync`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from cloudckpt.mapping import ShardedStateDict
from cloudckpt.strategies._torch_compat import MCoreSavePlanner
from cloudckpt.strategies.async_utils import AsyncRequest, check_async_strategy
from cloudckpt.strategies.base import CheckpointDir
from cloudckpt.strategies.filesystem_async import FileSystemWriterAsync
from cloudckpt.strategies.state_dict_saver import (
    FinalizeArgs,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cloudckpt.config import CheckpointConfig
    from cloudckpt.storage import CheckpointStorage, WriteResult


class AsyncDcpSaveMixin:
    """``async_save`` and the plan cache of ``cached_metadata=True`` (Megatron-Core's).

    The class it is mixed into provides ``separation_hint``,
    ``use_cached_ckpt_structure``, ``_storage``, ``_object_size`` and ``_dcp_state``
    (this rank's DCP state dict and ``mcore_data``).
    """

    separation_hint: str | None
    use_cached_ckpt_structure: bool

    if TYPE_CHECKING:

        def _storage(
            self,
            checkpoint_dir: CheckpointDir,
            expected: Mapping[str, WriteResult] | None = None,
        ) -> CheckpointStorage: ...

        def _object_size(self, config: CheckpointConfig | None) -> int: ...

        def _dcp_state(
            self, sharded_state_dict: ShardedStateDict
        ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]: ...

    def _init_plan_cache(self) -> None:
        """No plans cached yet (the plans and metadata of the last ``async_save``)."""
        self.cached_central_plan: SavePlan | None = None
        self.cached_local_plan: SavePlan | None = None
        self.cached_global_metadata: Metadata | None = None
        self.validated_cache_reuse = False

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: CheckpointDir,
        async_strategy: str | None = "nvrx",
    ) -> AsyncRequest:
        """Plan and stage a save of this rank's main replicas; upload later (collective).

        Megatron-Core's strategy-level async save: the returned request's ``async_fn``
        uploads the staged ``.distcp`` objects (in the background, e.g. on an
        :class:`~cloudckpt.strategies.async_utils.AsyncCallsQueue`) and its finalize
        function writes ``.metadata`` on the coordinator once every rank is done. The
        data is staged in host memory before this returns. Like Megatron-Core's, this
        writes the DCP part only; ``metadata.json`` (and cloudckpt's manifest) are
        the caller's (``cloudckpt.save`` commits). With ``cached_metadata=True`` the
        plan of the previous save is reused while it stays the same. Megatron-Core
        0.19's ``async_strategy`` ("nvrx" or "mcore") is checked; either runs this.
        """
        check_async_strategy(async_strategy)
        state, extra = self._dcp_state(sharded_state_dict)
        writer = FileSystemWriterAsync(
            self._storage(checkpoint_dir),
            separation_hint=self.separation_hint,
            object_size=self._object_size(None),
        )
        writer.mcore_data = extra
        planner = MCoreSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        cached = (
            (self.cached_central_plan, self.cached_local_plan, self.validated_cache_reuse)
            if self.use_cached_ckpt_structure
            else None
        )
        finalize_args, central, local, reused, _ = save_state_dict_async_plan(
            state, writer, None, 0, planner, cached
        )
        if self.use_cached_ckpt_structure:
            finalize_args = self._reuse_metadata(finalize_args, reused)
            self.cached_central_plan, self.cached_local_plan = central, local
            self.validated_cache_reuse = reused
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()

        def finalize() -> None:
            save_state_dict_async_finalize(*finalize_args)

        return AsyncRequest(save_fn, save_args, [finalize], preload_fn=preload_fn)

    def _reuse_metadata(self, finalize_args: FinalizeArgs, reused: bool) -> FinalizeArgs:
        """Keep the coordinator's global metadata; supply it when planning was skipped."""
        writer, metadata, wrapper = finalize_args
        if metadata is not None:
            self.cached_global_metadata = metadata
        elif reused and self.cached_global_metadata is not None:
            metadata = self.cached_global_metadata
        return writer, metadata, wrapper
