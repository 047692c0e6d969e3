"""The coordinator step's column checks and unhinted plans (cloudckpt.formats.dcp.plan,
_dcp_dist.create_global_plan): the chunks of every tensor are validated at once in numpy
columns, anything unproven is left to DCP, and where the writer keeps the items the
coordinator leaves the index hints to the ranks, which expand the same global plans."""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from cloudckpt.formats.dcp.plan import (
    GlobalPlanUpdate,
    apply_global_plan_update,
    global_plan_updates,
    linear_global_save_plan,
)
from cloudckpt.formats.dcp.steps import create_global_plan, keeps_plan_items
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim

from tests.test_dcp_plan import _local_plans, _planner  # the same plans, as gathered


def _writer() -> CloudStorageWriter:
    return CloudStorageWriter(open_checkpoint(f"memory://test-dcp-columns-w-{os.getpid()}"))


def test_unhinted_plans_expand_to_the_hinted_ones():
    local = _local_plans(sim.World(2, 2, 2, 16), 13)
    hinted_planner, planner = _planner(), _planner()
    hinted, hinted_md = hinted_planner.create_global_plan(local)
    writer = _writer()
    planned, metadata = create_global_plan(planner, writer, local)
    assert planner.items_hinted is False and hinted_planner.items_hinted is True
    assert metadata == hinted_md and repr(metadata) == repr(hinted_md)
    assert all(p is q for p, q in zip(planned, local, strict=True))  # items untouched
    central = writer.prepare_global_plan(planned)
    updates = global_plan_updates(planner, planned, central)
    assert all(isinstance(u, GlobalPlanUpdate) for u in updates)
    expanded = [apply_global_plan_update(p, u) for p, u in zip(local, updates, strict=True)]
    expected = _writer().prepare_global_plan(hinted)
    assert pickle.dumps(expanded) == pickle.dumps(expected)
    assert [[i.index.index for i in p.items] for p in expanded] == [
        [i.index.index for i in p.items] for p in hinted
    ]


def test_a_writer_that_may_change_items_gets_hinted_plans():
    class Rewriting(CloudStorageWriter):
        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return [dataclasses.replace(p, items=list(p.items)) for p in plans]

    rewriting = Rewriting(open_checkpoint(f"memory://test-dcp-columns-r-{os.getpid()}"))
    assert keeps_plan_items(_writer()) and not keeps_plan_items(rewriting)
    local = _local_plans(sim.World(2, 1, 1, 16), 5)
    planner = _planner()
    planned, _ = create_global_plan(planner, rewriting, local)
    assert planner.items_hinted is True
    assert any(i.index.index is not None for p in planned for i in p.items)
    central = rewriting.prepare_global_plan(planned)
    assert global_plan_updates(planner, planned, central) == central


def test_unhinted_plans_refuse_a_writer_that_changed_items():
    local = _local_plans(sim.World(2, 1, 1, 16), 5)
    planner = _planner()
    planned, _ = planner.create_global_plan_unhinted(local)
    copied = [dataclasses.replace(p, items=list(p.items)) for p in planned]
    try:
        global_plan_updates(planner, planned, copied)
    except ValueError as exc:
        assert "without index hints" in str(exc)
    else:
        raise AssertionError("no error")


def _replace_item(plans: list[SavePlan], rank: int, pos: int, new) -> list[SavePlan]:
    plan = plans[rank]
    items = [*plan.items[:pos], new, *plan.items[pos + 1 :]]
    return [*plans[:rank], dataclasses.replace(plan, items=items), *plans[rank + 1 :]]


def test_the_same_chunk_twice_in_one_plan_is_left_to_dcp():
    plans = _local_plans(sim.World(1, 1, 1, 16), 5)  # one plan: no fill check
    items = plans[0].items
    first = next(i for i in items if i.tensor_data is not None)
    doubled = [dataclasses.replace(plans[0], items=[*items, first])]
    assert linear_global_save_plan(doubled) is None


def test_an_index_naming_another_chunk_is_left_to_dcp():
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    pos, item = next((i, it) for i, it in enumerate(plans[0].items) if it.tensor_data is not None)
    moved = dataclasses.replace(item, index=MetadataIndex(item.index.fqn, torch.Size([1, 0])))
    assert linear_global_save_plan(_replace_item(plans, 0, pos, moved)) is None


def test_chunks_with_a_wrong_rank_or_negative_size_are_left_to_dcp():
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    pos, item = next((i, it) for i, it in enumerate(plans[0].items) if it.tensor_data is not None)
    for offsets, sizes in (([0, 0, 0], [1, 1, 1]), ([0, 0], [-1, 16])):
        chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        data = dataclasses.replace(item.tensor_data, chunk=chunk)
        index = MetadataIndex(item.index.fqn, torch.Size(offsets))
        bad = dataclasses.replace(item, tensor_data=data, index=index)
        assert linear_global_save_plan(_replace_item(plans, 0, pos, bad)) is None
    assert linear_global_save_plan(plans) is not None


def test_a_single_chunk_not_reaching_the_end_is_valid_alone():
    """One plan, a tensor of one chunk that covers part of it: DCP's step accepts it
    (no fill check with one plan), and so does the fast path."""
    plans = _local_plans(sim.World(1, 1, 1, 16), 1)
    pos, item = next((i, it) for i, it in enumerate(plans[0].items) if it.tensor_data is not None)
    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 16]))
    data = dataclasses.replace(item.tensor_data, chunk=chunk)
    part = dataclasses.replace(item, tensor_data=data)
    fast = linear_global_save_plan(_replace_item(plans, 0, pos, part))
    assert fast is not None
    assert fast[1].state_dict_metadata[item.index.fqn].chunks == [chunk]
