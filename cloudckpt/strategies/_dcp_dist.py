"""PyTorch DCP's save, with cloudckpt's bounded collectives.

``torch.distributed.checkpoint.save`` exchanges plans and write results through
``_DistWrapper``, whose object collectives block in the backend: a rank killed or
frozen while the others wait for its uploads leaves them waiting for the process
group's timeout (gloo's is 30 minutes). :class:`GuardedDistWrapper` keeps DCP's
steps and their error handling (a failure on any rank is raised on every rank) but
routes each collective through :mod:`cloudckpt.dist`, whose waits are bounded and
name the lost rank (:mod:`cloudckpt.dist_guard`). :func:`save_state_dict` runs DCP's
plan / write / finish steps with it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from cloudckpt import dist

_T = TypeVar("_T")


class GuardedDistWrapper(_DistWrapper):
    """DCP's ``_DistWrapper`` whose collectives are cloudckpt's (bounded, naming a
    lost rank); ``step`` names them in errors."""

    def __init__(self, group: Any, coordinator_rank: int = 0, step: str = "torch_dist") -> None:
        super().__init__(group, dist.is_distributed(), coordinator_rank)
        self.step = step

    def _what(self, collective: str) -> str:
        return f"{self.step}: {collective}"

    def broadcast_object(self, object: _T | None) -> _T:
        if not self.use_dist:
            return object  # type: ignore[return-value]
        src = self.global_coordinator_rank
        return dist.broadcast_object(object, src, self.group, self._what("broadcast"))  # type: ignore[no-any-return]

    def gather_object(self, object: _T) -> list[_T] | None:
        if not self.use_dist:
            return [object]
        dst = self.global_coordinator_rank
        return dist.gather_object(object, dst, self.group, self._what("gather"))

    def all_gather_object(self, object: _T) -> list[_T]:
        return dist.all_gather_object(object, self.group, self._what("all_gather"))

    def scatter_object(self, object_list: list[_T] | None) -> _T:
        if not self.use_dist:
            assert object_list is not None
            return object_list[0]
        src = self.global_coordinator_rank
        return dist.scatter_object(object_list, src, self.group, self._what("scatter"))  # type: ignore[no-any-return]

    def barrier(self) -> None:
        dist.barrier(self.group, self._what("barrier"))


def save_state_dict(
    state_dict: dict[str, Any],
    writer: StorageWriter,
    planner: SavePlanner,
    group: Any = None,
    coordinator_rank: int = 0,
) -> Metadata:
    """DCP's save steps (plan, write, finish) with :class:`GuardedDistWrapper`.

    Raises:
        CheckpointException: (PyTorch's, a BaseException) a step failed on some rank;
            raised on every rank.
        CollectiveError: a rank was lost or silent in a collective.
    """
    wrapper = GuardedDistWrapper(group, coordinator_rank, "torch_dist save")
    global_metadata: Metadata | None = None

    def local_step() -> SavePlan:
        planner.set_up_planner(
            state_dict, storage_meta=writer.storage_meta(), is_coordinator=wrapper.is_coordinator
        )
        writer.set_up_storage_writer(wrapper.is_coordinator)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal global_metadata
        with dist.paused_gc():  # every rank's items, planned at once (see paused_gc)
            plans, global_metadata = planner.create_global_plan(plans)
            return writer.prepare_global_plan(plans)

    central = wrapper.reduce_scatter("plan", local_step, global_step)

    def write() -> Any:
        pending = writer.write_data(planner.finish_plan(central), planner)
        pending.wait()
        return pending.value()

    def finish(results: list[Any]) -> Metadata:
        assert global_metadata is not None, "the coordinator planned no metadata"
        with dist.paused_gc():  # every rank's item results, merged at once
            writer.finish(metadata=global_metadata, results=results)
        return global_metadata

    return wrapper.all_reduce("write", write, finish)


__all__ = ["GuardedDistWrapper", "save_state_dict"]
