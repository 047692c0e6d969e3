"""Megatron-Core's strategy-level asynchronous save for the torch_dist backend.

:class:`AsyncDcpSaveMixin` gives :class:`~cloudckpt.strategies.torch.
TorchDistSaveShardedStrategy` its ``async_save``, on the torch_dist format as every save
runs it (:mod:`cloudckpt.formats.protocol`): planning and the copy to host memory in the
call, the upload in the returned request's function, ``.metadata`` in its finalize
function (:func:`cloudckpt.formats.run.finish_written`). Like Megatron-Core's, it writes
the DCP part only: ``metadata.json`` and cloudckpt's manifest are
:func:`cloudckpt.save`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cloudckpt.formats.run import finish_written
from cloudckpt.strategies.async_utils import AsyncRequest, check_async_strategy

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cloudckpt.formats.dcp.save import DcpFormat
    from cloudckpt.formats.dcp.steps import SavePlanCache
    from cloudckpt.formats.protocol import Written
    from cloudckpt.mapping import ShardedStateDict
    from cloudckpt.storage import CheckpointStorage, WriteResult
    from cloudckpt.storage.location import CheckpointDir


class AsyncDcpSaveMixin:
    """``async_save``, and Megatron-Core's attributes of its plan cache.

    The class it is mixed into provides ``save_format``, ``plan_cache``,
    ``use_cached_ckpt_structure`` and ``_storage``.
    """

    use_cached_ckpt_structure: bool
    plan_cache: SavePlanCache

    if TYPE_CHECKING:

        def _storage(
            self,
            checkpoint_dir: CheckpointDir,
            expected: Mapping[str, WriteResult] | None = None,
        ) -> CheckpointStorage: ...

        def save_format(self) -> DcpFormat: ...

    def _init_plan_cache(self) -> None:
        """Megatron-Core's cache attributes: cloudckpt keeps the plans in its
        :class:`~cloudckpt.formats.dcp.steps.SavePlanCache` (``plan_cache``);
        ``validated_cache_reuse`` says whether the last save reused them."""
        self.cached_central_plan: Any = None
        self.cached_local_plan: Any = None
        self.cached_global_metadata: Any = None
        self.validated_cache_reuse = False

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: CheckpointDir,
        async_strategy: str | None = "nvrx",
    ) -> AsyncRequest:
        """Plan and stage a save of this rank's main replicas; upload later (collective).

        Megatron-Core's strategy-level async save: the returned request's ``async_fn``
        uploads this rank's ``.distcp`` objects (in the background, e.g. on an
        :class:`~cloudckpt.strategies.async_utils.AsyncCallsQueue`) and its finalize
        function writes ``.metadata`` on the coordinator once every rank is done. The
        data is copied to host memory before this returns. With ``cached_metadata=True``
        the plans of the previous save are reused while no rank's changed. Megatron-Core
        0.19's ``async_strategy`` ("nvrx" or "mcore") is checked; either runs this.
        """
        check_async_strategy(async_strategy)
        storage = self._storage(checkpoint_dir)
        reused = self.plan_cache.reused
        planned = self.save_format().plan(storage, sharded_state_dict, staged=True)
        if self.use_cached_ckpt_structure:
            self.validated_cache_reuse = self.plan_cache.reused > reused
        written: list[Written] = []

        def upload() -> None:
            written.append(planned.write())

        def finalize() -> None:
            finish_written(planned, written[0], None, storage.uri)

        return AsyncRequest(upload, (), [finalize])
