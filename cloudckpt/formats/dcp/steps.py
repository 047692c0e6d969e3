"""PyTorch DCP's save, with cloudckpt's bounded collectives.

``torch.distributed.checkpoint.save`` exchanges plans and write results through
``_DistWrapper``, whose object collectives block in the backend: a rank killed or
frozen while the others wait for its uploads leaves them waiting for the process
group's timeout (gloo's is 30 minutes). :class:`GuardedDistWrapper` keeps DCP's
steps and their error handling (a failure on any rank is raised on every rank) but
routes each collective through :mod:`cloudckpt.dist`, whose waits are bounded and
name the lost rank (:mod:`cloudckpt.dist_guard`). :func:`save_state_dict` runs DCP's
plan / write / finish steps with it.

The coordinator scatters each rank only what its step changed in that rank's local
plan (:class:`~cloudckpt.formats.dcp.plan.GlobalPlanUpdate`: the items' index
hints and the writer's storage data) where that is all it changed, instead of the
whole global plan: a few bytes per item, not growing with the world size.

With cloudckpt's own planner and writer (the common case, :func:`plans_in_columns`)
the ranks send their local plans in columns (:class:`~cloudckpt.formats.
dcp.columns.PlanColumns`: keys once, ids into the rank's distinct sizes and
properties) instead of pickled ``WriteItem`` s; the coordinator plans them on arrays
(:func:`~cloudckpt.formats.dcp.plan.linear_global_columns`: the same ``Metadata``
and index hints as DCP's step), keeps every rank's item keys, and asks the ranks for
their write results in columns (:class:`~cloudckpt.formats.dcp.columns.
ItemResultColumns`), from which the writer pickles ``.metadata`` without building the
per-item objects (:meth:`~cloudckpt.formats.dcp.storage.CloudStorageWriter.
finish_columns`). Anything the columns cannot prove (a duplicate, chunks off a grid,
an item of another shape) goes to the object path and DCP's own step, and a custom
planner or writer (Megatron-Core's, a subclass overriding a step) always takes it.

A :class:`SavePlanCache` (a strategy's ``cached_metadata=True``, Megatron-Core's
``ckpt_assume_constant_structure``) keeps the plans of one save for the next: while
every rank's local plan is the one it had, the plans are not gathered, planned and
scattered again; one integer all-reduce checks that on every save, and a change on any
rank plans afresh. Unlike Megatron-Core's cache, a changed structure is never written
with a stale plan.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.checkpoint.utils import _DistWrapper

from cloudckpt import dist
from cloudckpt.formats.dcp.columns import (
    ChunkColumns,
    ItemResultColumns,
    PlanColumns,
    PlanKeys,
)
from cloudckpt.formats.dcp.plan import (
    GlobalPlanUpdate,
    LinearGlobalPlanMixin,
    apply_global_plan_update,
    global_plan_updates,
)
from cloudckpt.formats.dcp.storage import CloudStorageWriter

_T = TypeVar("_T")
logger = logging.getLogger(__name__)


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


@dataclass
class _CachedPlans:
    """One save's plans: this rank's local and central plan, and on the coordinator
    the global metadata and the writer's merged extra metadata (``mcore_data``)."""

    where: tuple[int, int]  # (rank, world size) of the group
    local: SavePlan
    central: SavePlan
    metadata: Metadata | None
    extra: dict[str, Any] | None
    columns: bool = False  # this rank sends its write results in columns
    keys: list[PlanKeys] | None = None  # the coordinator's: every rank's item keys
    chunks: ChunkColumns | None = None  # the coordinator's: the chunk lists as ids


class SavePlanCache:
    """The plans of the last save through one strategy, reused while no rank's local
    plan changes (see the module docstring). Not thread-safe: one save at a time."""

    def __init__(self) -> None:
        self._plans: _CachedPlans | None = None
        self.reused = 0  # saves that reused the plans (for tests and logs)

    @property
    def holds_plans(self) -> bool:
        """Whether a save's plans are kept (the next save checks them)."""
        return self._plans is not None

    def lookup(self, local: SavePlan | None, wrapper: GuardedDistWrapper) -> _CachedPlans | None:
        """The cached plans when ``local`` (None: this rank failed to plan) is the cached
        local plan on every rank of the wrapper's group. Collective once anything is
        cached (one integer all-reduce)."""
        plans = self._plans
        if plans is None:
            return None
        where = (wrapper.get_rank(), wrapper.get_world_size())
        changed = int(local is None or plans.where != where or plans.local != local)
        if wrapper.use_dist:
            group_what = wrapper._what("plan cache check")
            changed = dist.all_reduce_int(changed, "max", wrapper.group, group_what)
        if changed:
            self._plans = None
            return None
        self.reused += 1
        return plans

    def store(
        self,
        wrapper: GuardedDistWrapper,
        local: SavePlan,
        central: SavePlan,
        metadata: Metadata | None,
        extra: dict[str, Any] | None,
        columns: bool = False,
        keys: list[PlanKeys] | None = None,
        chunks: ChunkColumns | None = None,
    ) -> None:
        """Keep one save's plans for the next."""
        where = (wrapper.get_rank(), wrapper.get_world_size())
        self._plans = _CachedPlans(where, local, central, metadata, extra, columns, keys, chunks)


@dataclass
class PlannedSave:
    """A DCP save planned on every rank (:func:`plan_save`): :meth:`write` serializes
    and uploads this rank's items (no collective: it may run in a background thread);
    :meth:`finish` then gathers every rank's item results and lets the coordinator
    write ``.metadata`` (collective)."""

    wrapper: GuardedDistWrapper
    writer: StorageWriter
    planner: SavePlanner
    plan: SavePlan
    metadata: Metadata | None
    columns: bool = False
    """This rank sends its write results in columns (the coordinator knows the keys)."""
    keys: list[PlanKeys] | None = None
    """The coordinator's: every rank's item keys, for results sent in columns."""
    chunks: ChunkColumns | None = None
    """The coordinator's: the metadata's chunk lists as ids (its step on columns)."""

    def write(self) -> Any:
        """Serialize and upload this rank's items; their DCP write results (in columns,
        :class:`~cloudckpt.formats.dcp.columns.ItemResultColumns`, where the
        coordinator asked for them and they say the results exactly)."""
        pending = self.writer.write_data(self.plan, self.planner)
        pending.wait()
        results: list[Any] = pending.value()
        if self.columns:
            columns = ItemResultColumns.of(self.plan.items, results)
            if columns is not None:
                return columns
        return results

    def finish(self, write: Callable[[], Any] | None = None) -> Metadata | None:
        """Run ``write`` (default :meth:`write`; a function returning the results of an
        earlier write, or raising its error) on every rank, gather the results and let
        the coordinator write ``.metadata``. Collective.

        Returns:
            The global metadata on the coordinator, None on the other ranks: the
            coordinator broadcasts its verdict only (DCP's ``save`` broadcasts the
            metadata, every chunk of every tensor: bytes on every rank that grow with
            the world). On the coordinator's fast path (columns) the metadata holds no
            ``storage_data``: the writer keeps it in columns.

        Raises:
            CheckpointException: (PyTorch's) some rank's write, or the coordinator's
                ``.metadata``, failed; raised on every rank.
        """

        def written(results: list[Any]) -> None:
            self.write_metadata(results)

        self.wrapper.all_reduce("write", write or self.write, written)
        return self.metadata if self.wrapper.is_coordinator else None

    def write_metadata(self, results: list[Any]) -> Metadata:
        """The coordinator's: ``.metadata`` from every rank's :meth:`write` results, by
        rank (in columns where they came in columns)."""
        assert self.metadata is not None, "the coordinator planned no metadata"
        with dist.paused_gc():  # every rank's item results, merged at once
            if self.keys is not None and isinstance(self.writer, CloudStorageWriter):
                self.writer.finish_columns(self.metadata, self.keys, results, self.chunks)
            else:
                self.writer.finish(metadata=self.metadata, results=results)
        return self.metadata


def plan_save(
    make_state: Callable[[], dict[str, Any]],
    writer: StorageWriter,
    planner: SavePlanner,
    group: Any = None,
    coordinator_rank: int = 0,
    plan_cache: SavePlanCache | None = None,
) -> PlannedSave:
    """DCP's planning step with :class:`GuardedDistWrapper` (collective); with
    ``plan_cache``, the plans of the previous save when no rank's plan changed.

    ``make_state`` builds this rank's DCP state dict; it is called once, inside the
    planning, so that its failure on one rank is raised on every rank.

    Raises:
        CheckpointException: (PyTorch's, a BaseException) planning failed on some rank;
            raised on every rank.
        CollectiveError: a rank was lost or silent in a collective.
    """
    wrapper = GuardedDistWrapper(group, coordinator_rank, "torch_dist save")
    global_metadata: Metadata | None = None
    local_plans: list[SavePlan] = []
    states: list[dict[str, Any]] = []
    keys: list[PlanKeys] | None = None
    chunks: ChunkColumns | None = None

    def local_step() -> SavePlan:
        if not states:
            states.append(make_state())
        planner.set_up_planner(
            states[0], storage_meta=writer.storage_meta(), is_coordinator=wrapper.is_coordinator
        )
        writer.set_up_storage_writer(wrapper.is_coordinator)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
        return local_plans[-1]

    def send_local_plan() -> SavePlan | PlanColumns:
        plan = local_step()
        if plans_in_columns(planner, writer):
            return PlanColumns.of(plan) or plan
        return plan

    def global_step(sent: list[SavePlan | PlanColumns]) -> list[SavePlan | GlobalPlanUpdate]:
        nonlocal global_metadata, keys, chunks
        with dist.paused_gc():  # every rank's items, planned at once (see paused_gc)
            fast = global_step_columns(planner, writer, sent)
            if fast is not None:
                global_metadata, keys, scattered, chunks = fast
                return list(scattered)
            plans = [p.to_plan() if isinstance(p, PlanColumns) else p for p in sent]
            planned, global_metadata = create_global_plan(planner, writer, plans)
            central = writer.prepare_global_plan(planned)
            updates = global_plan_updates(planner, planned, central)
            keys = column_keys(planner, writer, planned, updates)
            if keys is None:
                return updates
            return [
                dataclasses.replace(u, columns=True) if isinstance(u, GlobalPlanUpdate) else u
                for u in updates
            ]

    cached = _reusable_plans(plan_cache, local_step, wrapper)
    if cached is not None:
        central = cached.central
        global_metadata = copy.copy(cached.metadata)  # the writer's finish sets its fields
        if cached.extra is not None:
            writer.mcore_data = dict(cached.extra)  # type: ignore[attr-defined]
        columns, keys, chunks = cached.columns, cached.keys, cached.chunks
    else:
        update = wrapper.reduce_scatter("plan", send_local_plan, global_step)
        central = apply_global_plan_update(local_plans[-1], update)
        columns = isinstance(update, GlobalPlanUpdate) and update.columns
        if plan_cache is not None:
            extra = getattr(writer, "mcore_data", None) if wrapper.is_coordinator else None
            plan_cache.store(
                wrapper,
                local_plans[-1],
                central,
                copy.copy(global_metadata),
                dict(extra) if extra is not None else None,
                columns,
                keys,
                chunks,
            )
    final = planner.finish_plan(central)
    return PlannedSave(wrapper, writer, planner, final, global_metadata, columns, keys, chunks)


def save_state_dict(
    state_dict: dict[str, Any],
    writer: StorageWriter,
    planner: SavePlanner,
    group: Any = None,
    coordinator_rank: int = 0,
    plan_cache: SavePlanCache | None = None,
) -> Metadata | None:
    """DCP's save steps (plan, write, finish) with :class:`GuardedDistWrapper`; with
    ``plan_cache``, the plans of the previous save when no rank's plan changed. The
    global metadata on the coordinator, None elsewhere (see :meth:`PlannedSave.finish`).

    Raises:
        CheckpointException: (PyTorch's, a BaseException) a step failed on some rank;
            raised on every rank.
        CollectiveError: a rank was lost or silent in a collective.
    """
    planned = plan_save(lambda: state_dict, writer, planner, group, coordinator_rank, plan_cache)
    return planned.finish()


def create_global_plan(
    planner: SavePlanner, writer: StorageWriter, plans: list[SavePlan]
) -> tuple[list[SavePlan], Metadata]:
    """The planner's global plans and metadata: without the index hints on the items
    (:meth:`~cloudckpt.formats.dcp.plan.LinearGlobalPlanMixin.
    create_global_plan_unhinted`, the ranks set them from the scattered updates) where
    the writer's ``prepare_global_plan`` is known to keep the items (cloudckpt's)."""
    if isinstance(planner, LinearGlobalPlanMixin) and keeps_plan_items(writer):
        return planner.create_global_plan_unhinted(plans)
    return planner.create_global_plan(plans)


def keeps_plan_items(writer: StorageWriter) -> bool:
    """Whether ``writer.prepare_global_plan`` keeps each plan's items (it changes only
    ``storage_data``): cloudckpt's writer, as its class declares."""
    return isinstance(writer, CloudStorageWriter) and type(writer).keeps_plan_items


def writes_columns(writer: StorageWriter) -> bool:
    """Whether ``writer`` is cloudckpt's own writer, whose steps the columns of
    :mod:`~cloudckpt.formats.dcp.columns` say exactly (its class declares it)."""
    return (
        isinstance(writer, CloudStorageWriter)
        and type(writer).exact_in_columns
        and (type(writer).keeps_plan_items)
    )


def plans_in_columns(planner: SavePlanner, writer: StorageWriter) -> bool:
    """Whether the ranks send their local plans in columns (:class:`~cloudckpt.
    formats.dcp.columns.PlanColumns`): the planner's coordinator step is cloudckpt's
    linear one, as its class declares (a custom planner, such as Megatron-Core's, gets
    its own step on the plans as objects), and the writer is cloudckpt's own."""
    return (
        isinstance(planner, LinearGlobalPlanMixin)
        and type(planner).exact_in_columns
        and not planner.flatten_state_dict
        and not getattr(planner, "_enable_plan_caching", False)
        and writes_columns(writer)
    )


def global_step_columns(
    planner: SavePlanner, writer: StorageWriter, sent: list[SavePlan | PlanColumns]
) -> tuple[Metadata, list[PlanKeys], list[GlobalPlanUpdate], ChunkColumns] | None:
    """The coordinator's step on plans sent in columns: the global metadata, every
    rank's item keys and the updates to scatter (results asked in columns); None where
    a rank sent its plan as objects or the fast path cannot prove the plans (the caller
    then runs the step on the plans as objects)."""
    columns = [p for p in sent if isinstance(p, PlanColumns)]
    if len(columns) != len(sent) or not plans_in_columns(planner, writer):
        return None
    assert isinstance(planner, LinearGlobalPlanMixin)
    fast = planner.create_global_plan_columns(columns)
    if fast is None:
        return None
    stubs = [SavePlan([], c.storage_data, c.planner_data, c.usable) for c in columns]
    central = writer.prepare_global_plan(stubs)  # cloudckpt's: only storage_data changes
    updates = [
        GlobalPlanUpdate(hints, plan.storage_data, plan.planner_data, plan.usable, columns=True)
        for hints, plan in zip(fast.hints, central, strict=True)
    ]
    return fast.metadata, fast.keys, updates, fast.chunks


def column_keys(
    planner: SavePlanner,
    writer: StorageWriter,
    planned: list[SavePlan],
    updates: list[SavePlan | GlobalPlanUpdate],
) -> list[PlanKeys] | None:
    """Every rank's item keys where the ranks can send their write results in columns:
    cloudckpt's linear step planned (every item's key and index hint known), every rank
    gets a :class:`GlobalPlanUpdate` and the writer is cloudckpt's own
    (:func:`writes_columns`); None otherwise (DCP's object path)."""
    hints = getattr(planner, "index_hints", None)
    if hints is None or len(hints) != len(planned) or not writes_columns(writer):
        return None
    if not all(isinstance(u, GlobalPlanUpdate) for u in updates):
        return None
    keys = [PlanKeys.of(plan, h) for plan, h in zip(planned, hints, strict=True)]
    found = [k for k in keys if k is not None]
    return found if len(found) == len(keys) else None


def _reusable_plans(
    cache: SavePlanCache | None, local_step: Any, wrapper: GuardedDistWrapper
) -> _CachedPlans | None:
    """The cached plans, when ``cache`` holds plans that every rank's new local plan
    matches (collective then). This rank's local planning failing counts as a change:
    the save then plans afresh, where DCP raises the failure on every rank."""
    if cache is None or not cache.holds_plans:
        return None
    local: SavePlan | None = None
    try:
        local = local_step()
    except Exception:  # noqa: BLE001 - raised again, on every rank, by the fresh planning
        logger.debug("rank %d: local planning failed; planning afresh", wrapper.get_rank())
    return cache.lookup(local, wrapper)


__all__ = [
    "GuardedDistWrapper",
    "column_keys",
    "global_step_columns",
    "plans_in_columns",
    "PlannedSave",
    "SavePlanCache",
    "create_global_plan",
    "keeps_plan_items",
    "plan_save",
    "save_state_dict",
    "writes_columns",
]
