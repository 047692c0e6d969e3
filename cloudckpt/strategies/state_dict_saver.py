"""A DCP save in three steps, for asynchronous saving (Megatron-Core's
``strategies.state_dict_saver``).

``torch.distributed.checkpoint.save`` plans, writes and finishes in one call.
:func:`save_state_dict_async_plan` does the planning (a collective) and stages the
data with :meth:`FileSystemWriterAsync.prepare_write_data`; the writer's save function
then uploads, in the background; :func:`save_state_dict_async_finalize` gathers the
write results and lets the coordinator write ``.metadata`` (a collective again). Any
rank's failure is raised on every rank as PyTorch's ``CheckpointException``, as in
Megatron-Core.

Typical use (all ranks)::

    writer = FileSystemWriterAsync(uri)
    args, *_ = save_state_dict_async_plan(state, writer, planner=MCoreSavePlanner(...))
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    request = AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*args)])
    queue.schedule_async_request(request)

These are the DCP-level steps only: a cloudckpt checkpoint also needs its commit
(``manifest.json``, then ``metadata.json``), which :func:`cloudckpt.save` adds.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from cloudckpt import dist
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.steps import GuardedDistWrapper
from cloudckpt.strategies.filesystem_async import FileSystemWriterAsync

logger = logging.getLogger(__name__)

#: What :func:`save_state_dict_async_finalize` takes: writer, global metadata (the
#: coordinator's; None elsewhere) and the distributed wrapper of the planning.
FinalizeArgs = tuple[FileSystemWriterAsync, Metadata | None, GuardedDistWrapper]


def _compare_dataclasses(obj1: Any, obj2: Any) -> str | list[str]:
    """The fields in which two dataclass instances differ (for debug messages)."""
    if type(obj1) is not type(obj2):
        return f"Objects are of different types: {type(obj1)} and {type(obj2)}"
    diffs = [
        f"{f.name}: {getattr(obj1, f.name)} != {getattr(obj2, f.name)}"
        for f in fields(obj1)
        if getattr(obj1, f.name) != getattr(obj2, f.name)
    ]
    return diffs or "All fields are equal"


def save_state_dict_async_plan(
    state_dict: dict[str, Any],
    storage_writer: FileSystemWriterAsync,
    process_group: Any = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    cached_ckpt_structure: tuple[SavePlan | None, SavePlan | None, bool] | None = None,
    loaded_all_plans: Sequence[SavePlan] | None = None,
) -> tuple[FinalizeArgs, SavePlan, SavePlan | None, bool, bool]:
    """Plan the save (a collective) and stage this rank's data in the writer.

    Args:
        state_dict: the DCP state dict (e.g. from ``mcore_to_pyt_state_dict``).
        storage_writer: the writer that will upload.
        process_group: the group that saves (default: the default group).
        coordinator_rank: the rank that writes ``.metadata``.
        planner: the save planner (default: DCP's).
        cached_ckpt_structure: ``(central plan, local plan, validated)`` of an earlier
            save; when validated, planning reuses the central plan (no collective).
        loaded_all_plans: accepted for Megatron-Core's signature (reusing the plans
            stored in a loaded checkpoint needs a decentralized writer, which the
            cloudckpt writer is not).

    Returns:
        ``(finalize args, central plan, local plan, central plan equals the cached one,
        False)``; pass the finalize args to :func:`save_state_dict_async_finalize`.
    """
    cached_central, local_plan, validated = cached_ckpt_structure or (None, None, False)
    wrapper = GuardedDistWrapper(process_group, coordinator_rank, "torch_dist async save")
    planner = planner or DefaultSavePlanner()
    global_metadata: Metadata | None = None

    def local_step() -> SavePlan:
        nonlocal local_plan
        planner.set_up_planner(state_dict, is_coordinator=wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(wrapper.is_coordinator)
        if not validated or local_plan is None:
            local_plan = planner.create_local_plan()
        return storage_writer.prepare_local_plan(local_plan)

    def global_step(all_plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal global_metadata
        all_plans, global_metadata = planner.create_global_plan(all_plans)
        return storage_writer.prepare_global_plan(all_plans)

    started = time.perf_counter()
    if validated and cached_central is not None:
        local_step()
        central = cached_central
    else:
        central = wrapper.reduce_scatter("plan", local_step, global_step)
    central = planner.finish_plan(central)
    storage_writer.prepare_write_data(central, planner)
    logger.debug(
        "rank %s: planned and staged the save in %.3f s",
        dist.get_rank(),
        time.perf_counter() - started,
    )
    return (
        (storage_writer, global_metadata, wrapper),
        central,
        local_plan,
        cached_central == central,
        False,
    )


def verify_global_md_reuse(
    loaded_all_plans: Sequence[SavePlan] | None,
    local_plan: SavePlan,
    rank: int,
    dist_wrapper: GuardedDistWrapper,
) -> bool:
    """True when every rank's plan equals its plan stored in a loaded checkpoint
    (``storage_data`` aside), so the stored global metadata could be reused.

    A collective (an integer all-reduce) when the number of loaded plans matches the
    world; False without loaded plans.
    """
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    same = all(
        getattr(local_plan, f.name) == getattr(loaded_all_plans[rank], f.name)
        for f in fields(local_plan)
        if f.name != "storage_data"
    )
    if not same:
        logger.debug(
            "plan differs from the loaded one: %s",
            _compare_dataclasses(local_plan, loaded_all_plans[rank]),
        )
    return dist.all_reduce_int(int(same), op="min", group=dist_wrapper.group) == 1


def save_state_dict_async_finalize(
    storage_writer: FileSystemWriterAsync,
    global_metadata: Metadata | None,
    dist_wrapper: GuardedDistWrapper,
) -> None:
    """Gather every rank's write results; the coordinator writes ``.metadata``.

    A collective over the planning's group.

    Raises:
        CheckpointException: (PyTorch's) some rank's upload failed, raised on every
            rank; the coordinator's carries each failed rank's error.
        CheckpointingException: the coordinator has no global metadata to write.
    """
    try:
        results: Any = storage_writer.retrieve_write_results()
    except CheckpointingException as exc:
        results = exc
    gathered = dist_wrapper.gather_object(results)
    failures: dict[int, tuple[BaseException, traceback.StackSummary]] = {}
    if dist_wrapper.is_coordinator:
        assert gathered is not None
        failures = {
            r: (res, traceback.extract_tb(res.__traceback__))
            for r, res in enumerate(gathered)
            if isinstance(res, BaseException)
        }
        if not failures:
            if global_metadata is None:
                raise CheckpointingException(
                    f"no global metadata to write for {storage_writer.storage.uri!r}"
                )
            storage_writer.finish(global_metadata, gathered)
    failed = dist_wrapper.broadcast_object(bool(failures))
    if failed:
        raise CheckpointException("write", failures)


__all__ = [
    "FinalizeArgs",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
