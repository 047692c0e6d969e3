"""The linear coordinator step of torch_dist saves (cloudckpt.formats.dcp.plan) gives
DCP's own global plans and metadata (pickled byte for byte) for TP x PP x DP layouts,
and leaves every case it cannot prove valid to DCP (duplicates, overlaps, gaps, chunks
out of bounds or off a grid), whose results and errors are then DCP's."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import sys

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from cloudckpt.formats.dcp.plan import (
    GlobalPlanUpdate,
    apply_global_plan_update,
    global_plan_updates,
    linear_global_save_plan,
)
from cloudckpt.formats.dcp.save import _PackedObjectsSavePlanner
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim


def _local_plans(world: sim.World, tensors: int) -> list[SavePlan]:
    shards_of = sim.rank_shards(world, tensors)
    storage = open_checkpoint(f"memory://test-dcp-plan-{os.getpid()}")
    plans = [sim.dcp_local_step(r, shards_of(r), storage)[2] for r in range(world.size)]
    return [pickle.loads(pickle.dumps(p)) for p in plans]  # as gathered


def _dcp(plans: list[SavePlan]) -> tuple[list[SavePlan], object]:
    planner = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    return planner.create_global_plan(plans)


@pytest.mark.parametrize(
    "world", [sim.World(1, 1, 1, 16), sim.World(2, 2, 2, 16), sim.World(4, 2, 3, 24)]
)
def test_same_plans_and_metadata_as_dcp(world):
    plans = _local_plans(world, 13)
    fast = linear_global_save_plan(plans)
    assert fast is not None
    expected_plans, expected_md = _dcp(plans)
    # equal values (repr: index hints too); the pickles may differ in which equal
    # sizes are one object (share_equal_sizes), not in what they unpickle to
    assert repr(fast[1]) == repr(expected_md) and fast[1] == expected_md
    assert repr(fast[0]) == repr(expected_plans) and fast[0] == expected_plans
    assert pickle.loads(pickle.dumps(fast[1])) == pickle.loads(pickle.dumps(expected_md))
    assert [[i.index.index for i in p.items] for p in fast[0]] == [
        [i.index.index for i in p.items] for p in expected_plans
    ]


def test_planner_uses_it_and_records_the_plan():
    plans = _local_plans(sim.World(2, 1, 2, 16), 6)
    planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    global_plan, metadata = planner.create_global_plan(plans)
    assert planner.global_plan is global_plan and planner.metadata is metadata
    assert repr(metadata) == repr(_dcp(plans)[1])


def _edit_chunk(plans: list[SavePlan], rank: int, offsets, sizes) -> list[SavePlan]:
    """``plans`` with rank ``rank``'s first tensor item moved to ``offsets``/``sizes``."""
    plan = plans[rank]
    pos, item = next((i, it) for i, it in enumerate(plan.items) if it.tensor_data is not None)
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    data = dataclasses.replace(item.tensor_data, chunk=chunk)
    index = dataclasses.replace(item.index, offset=torch.Size(offsets))
    new: WriteItem = dataclasses.replace(item, tensor_data=data, index=index)
    items = [*plan.items[:pos], new, *plan.items[pos + 1 :]]
    return [*plans[:rank], dataclasses.replace(plan, items=items), *plans[rank + 1 :]]


def _first_tensor(plans: list[SavePlan]) -> WriteItem:
    return next(i for i in plans[0].items if i.tensor_data is not None)


def test_defers_to_dcp_on_duplicates():
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    doubled = [plans[0], dataclasses.replace(plans[1], items=[*plans[1].items, plans[0].items[1]])]
    assert linear_global_save_plan(doubled) is None
    deduped, _ = _dcp(doubled)  # DCP de-duplicates them
    assert sum(len(p.items) for p in deduped) == sum(len(p.items) for p in plans)


@pytest.mark.parametrize(
    "edit, dcp_error",
    [
        (lambda size: ([1, 0], [size[0] // 2, size[1]]), "overlapping chunks"),  # shifted
        (lambda size: ([size[0], 0], [size[0] // 2, size[1]]), "out of bounds"),
        (lambda size: ([0, 0], [1, 1]), "invalid fill"),  # a gap
    ],
)
def test_defers_to_dcp_on_invalid_chunks(edit, dcp_error):
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    item = _first_tensor(plans)
    size = tuple(item.tensor_data.size)
    bad = _edit_chunk(plans, 1 if "overlap" in dcp_error else 0, *edit(size))
    assert linear_global_save_plan(bad) is None
    with pytest.raises(ValueError, match=dcp_error):
        _dcp(bad)
    planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with pytest.raises(ValueError, match=dcp_error):
        planner.create_global_plan(bad)


def test_defers_to_dcp_off_a_grid_and_agrees_when_valid():
    """Chunks that tile a tensor without forming a grid are valid: DCP's step runs."""
    plans = _local_plans(sim.World(1, 1, 1, 16), 1)  # one (3h x h) = (48, 16) tensor
    size = tuple(_first_tensor(plans).tensor_data.size)
    assert size == (48, 16)
    # split into (0,0)+(24,16) rows and two (24,8) halves below: a tiling, not a grid
    base = plans[0]
    tensor = _first_tensor(plans)
    pieces = [((0, 0), (24, 16)), ((24, 0), (24, 8)), ((24, 8), (24, 8))]
    items = []
    for offsets, sizes in pieces:
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        items.append(
            dataclasses.replace(
                tensor,
                tensor_data=dataclasses.replace(tensor.tensor_data, chunk=chunk),
                index=dataclasses.replace(tensor.index, offset=torch.Size(offsets)),
            )
        )
    rest = [i for i in base.items if i is not tensor]
    tiled = [dataclasses.replace(base, items=[items[0], *rest]), SavePlan(items[1:])]
    assert linear_global_save_plan(tiled) is None
    planner = _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    _, metadata = planner.create_global_plan(tiled)
    assert repr(metadata) == repr(_dcp(tiled)[1])


def _planner() -> _PackedObjectsSavePlanner:
    return _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def test_scattered_updates_expand_to_the_global_plans():
    """The coordinator scatters index hints and the writer's storage data; each rank's
    expansion is the global plan DCP's step gives it, hints included, in fewer bytes."""
    local = _local_plans(sim.World(2, 2, 2, 16), 13)
    planner = _planner()
    planned, _ = planner.create_global_plan(local)
    writer = CloudStorageWriter(open_checkpoint(f"memory://test-dcp-updates-{os.getpid()}"))
    central = writer.prepare_global_plan(planned)
    updates = global_plan_updates(planner, planned, central)
    assert all(isinstance(u, GlobalPlanUpdate) for u in updates)
    expanded = [
        apply_global_plan_update(p, pickle.loads(pickle.dumps(u)))
        for p, u in zip(local, updates, strict=True)
    ]
    assert pickle.dumps(expanded) == pickle.dumps(central)
    hints = [[i.index.index for i in p.items] for p in expanded]
    assert hints == [[i.index.index for i in p.items] for p in _dcp(local)[0]]
    assert any(h is not None for p in hints for h in p)
    for update, plan in zip(updates, central, strict=True):
        assert len(pickle.dumps(update)) * 5 < len(pickle.dumps(plan))


def test_whole_plans_where_dcp_planned_or_the_writer_changed_items():
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    doubled = [plans[0], dataclasses.replace(plans[1], items=[*plans[1].items, plans[0].items[1]])]
    planner = _planner()
    planned, _ = planner.create_global_plan(doubled)  # DCP's own step: de-duplicated
    assert planner.index_hints is None
    assert global_plan_updates(planner, planned, planned) == planned
    planned, _ = planner.create_global_plan(plans)  # the fast path, then a writer that
    rewritten = [dataclasses.replace(p, items=list(p.items)) for p in planned]  # copies
    updates = global_plan_updates(planner, planned, rewritten)
    assert updates == rewritten and all(isinstance(u, SavePlan) for u in updates)
    assert apply_global_plan_update(plans[0], updates[0]) is updates[0]


def test_an_update_for_another_plan_is_refused():
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    planner = _planner()
    planned, _ = planner.create_global_plan(plans)
    (update, _) = global_plan_updates(planner, planned, planned)
    short = dataclasses.replace(plans[0], items=plans[0].items[1:])
    with pytest.raises(ValueError, match="index hints for"):
        apply_global_plan_update(short, update)


def test_local_plans_share_equal_sizes():
    """The planner's local plan refers to each distinct size once: the same plan when
    unpickled, in fewer bytes than with DCP's separate objects."""
    shards = sim.rank_shards(sim.World(2, 1, 2, 16), 13)(1)
    storage = open_checkpoint(f"memory://test-dcp-share-{os.getpid()}")
    plan = sim.dcp_local_step(1, shards, storage)[2]
    tensors = [i for i in plan.items if i.tensor_data is not None]
    assert all(i.index.offset is i.tensor_data.chunk.offsets for i in tensors)
    assert len({id(i.tensor_data.size) for i in tensors}) == len(
        {tuple(i.tensor_data.size) for i in tensors}
    )
    separate = copy.deepcopy(plan)
    for item in separate.items:  # as DCP makes them: a torch.Size per field
        if item.tensor_data is not None:
            chunk = item.tensor_data.chunk
            chunk.offsets, chunk.sizes = torch.Size(chunk.offsets), torch.Size(chunk.sizes)
    assert pickle.loads(pickle.dumps(plan)) == separate
    assert len(pickle.dumps(plan)) < len(pickle.dumps(separate))
