"""Local plans sent in columns (cloudckpt.formats.dcp.columns.PlanColumns) and the
coordinator's step on them (_dcp_plan.linear_global_columns, _dcp_dist.
global_step_columns): the same metadata and index hints as the step on the plans as
objects and as DCP's, DCP's own step wherever the columns cannot prove the plans, and
the object path for custom planners."""

from __future__ import annotations

import array
import copy
import dataclasses
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

import cloudckpt
from cloudckpt.formats.dcp import metadata_pickle as _dcp_metadata_pickle
from cloudckpt.formats.dcp import plan as _dcp_plan
from cloudckpt.formats.dcp.columns import PlanColumns
from cloudckpt.formats.dcp.metadata_pickle import dumps_metadata_columns
from cloudckpt.formats.dcp.plan import (
    GlobalPlanUpdate,
    LinearGlobalPlanMixin,
    apply_global_plan_update,
    global_plan_updates,
    linear_global_columns,
    linear_global_save_plan,
)
from cloudckpt.formats.dcp.save import _PackedObjectsSavePlanner
from cloudckpt.formats.dcp.steps import (
    create_global_plan,
    global_step_columns,
    plans_in_columns,
)
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim

from tests.test_dcp_plan import _dcp, _edit_chunk, _first_tensor, _local_plans, _planner
from tests.test_dcp_result_columns import _state

WORLDS = [sim.World(1, 1, 1, 16), sim.World(2, 2, 2, 16), sim.World(4, 2, 3, 24)]


def _sent(plans: list[SavePlan]) -> list[PlanColumns]:
    """Each plan in columns, as the coordinator unpickles it."""
    out = []
    for plan in plans:
        columns = PlanColumns.of(plan)
        assert columns is not None
        out.append(pickle.loads(pickle.dumps(columns)))
    return out


def _writer() -> CloudStorageWriter:
    return CloudStorageWriter(open_checkpoint(f"memory://test-dcp-sent-{os.getpid()}"))


@pytest.mark.parametrize("world", WORLDS)
def test_columns_give_the_plan_back(world: sim.World) -> None:
    plans = _local_plans(world, 13)
    for plan, columns in zip(plans, _sent(plans), strict=True):
        again = columns.to_plan()
        assert again == plan and repr(again) == repr(plan)
        assert len(pickle.dumps(columns)) < len(pickle.dumps(plan))


@pytest.mark.parametrize("world", WORLDS)
def test_same_metadata_and_hints_as_the_object_step_and_dcps(world: sim.World) -> None:
    plans = _local_plans(world, 13)
    fast = linear_global_columns(_sent(plans))
    objects = linear_global_save_plan(plans)
    assert fast is not None and objects is not None
    expected_plans, expected_md = _dcp(plans)
    # the chunk lists stay empty (the pickle is written from the ids) until filled
    assert all(not chunks for chunks in fast.chunks.lists)
    fast.chunks.fill()
    assert repr(fast.metadata) == repr(expected_md) and fast.metadata == expected_md
    assert list(fast.metadata.state_dict_metadata) == list(expected_md.state_dict_metadata)
    assert [list(h) for h in fast.hints] == [
        [-1 if i.index.index is None else i.index.index for i in p.items] for p in objects[0]
    ]
    for keys, plan in zip(fast.keys, expected_plans, strict=True):
        assert [vars(keys.index(i)) for i in range(len(keys))] == [
            vars(item.index) for item in plan.items
        ]


def test_the_real_step_scatters_the_same_updates() -> None:
    world = sim.World(2, 2, 2, 16)
    plans = _local_plans(world, 13)
    planner, writer = _planner(), _writer()
    assert plans_in_columns(planner, writer)
    fast = global_step_columns(planner, writer, list(_sent(plans)))
    assert fast is not None
    metadata, keys, updates, chunks = fast
    chunks.fill()
    assert all(isinstance(u, GlobalPlanUpdate) and u.columns for u in updates)
    ref_planner, ref_writer = _planner(), _writer()
    planned, ref_md = create_global_plan(ref_planner, ref_writer, plans)
    central = ref_writer.prepare_global_plan(planned)
    ref_updates = global_plan_updates(ref_planner, planned, central)
    assert metadata == ref_md and repr(metadata) == repr(ref_md)
    assert writer.mcore_data == ref_writer.mcore_data
    for plan, update, ref in zip(plans, updates, ref_updates, strict=True):
        ours = apply_global_plan_update(plan, update)
        theirs = apply_global_plan_update(plan, ref)
        assert pickle.dumps(ours) == pickle.dumps(theirs)
    assert len(keys) == len(plans)


def test_defers_to_dcp_on_duplicates() -> None:
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    doubled = [plans[0], dataclasses.replace(plans[1], items=[*plans[1].items, plans[0].items[1]])]
    assert linear_global_columns(_sent(doubled)) is None
    byte_item = next(i for i in plans[0].items if i.tensor_data is None)
    twice = [plans[0], dataclasses.replace(plans[1], items=[*plans[1].items, byte_item])]
    assert linear_global_columns(_sent(twice)) is None


def _with_scalar(plan: SavePlan, shard: bool) -> SavePlan:
    """``plan`` with a 0-d tensor's item (a chunk of no dimensions) added."""
    local = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    local.set_up_planner({"step": torch.tensor(3.0)}, is_coordinator=False)
    (item,) = local.create_local_plan().items
    if shard:
        item = dataclasses.replace(item, type=WriteItemType.SHARD)
    return dataclasses.replace(plan, items=[*plan.items, item])


def test_zero_dimensional_tensors_are_checked_with_the_others() -> None:
    """Tensors of every rank are checked in one pass (padded to the largest): a 0-d
    tensor's one chunk is valid and planned as DCP plans it; the same 0-d chunk sent by
    two ranks is left to DCP."""
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    with_scalar = [_with_scalar(plans[0], shard=False), plans[1]]
    fast = linear_global_columns(_sent(with_scalar))
    assert fast is not None
    fast.chunks.fill()
    expected = _dcp(with_scalar)[1]
    assert repr(fast.metadata) == repr(expected) and fast.metadata == expected
    assert len(fast.metadata.state_dict_metadata["step"].chunks) == 1
    twice = [_with_scalar(plan, shard=True) for plan in plans]
    assert linear_global_columns(_sent(twice)) is None
    assert linear_global_save_plan(twice) is None  # the step on objects too
    assert linear_global_save_plan(with_scalar) is not None


@pytest.mark.parametrize(
    "edit, rank",
    [
        (lambda size: ([1, 0], [size[0] // 2, size[1]]), 1),  # overlapping
        (lambda size: ([size[0], 0], [size[0] // 2, size[1]]), 0),  # out of bounds
        (lambda size: ([0, 0], [1, 1]), 0),  # a gap
        (lambda size: ([0], [size[0]]), 0),  # a chunk of another rank (dimensions)
    ],
)
def test_defers_to_dcp_on_invalid_chunks(edit: Any, rank: int) -> None:
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    size = tuple(_first_tensor(plans).tensor_data.size)
    bad = _edit_chunk(plans, rank, *edit(size))
    assert linear_global_save_plan(bad) is None
    assert linear_global_columns(_sent(bad)) is None
    planner, writer = _planner(), _writer()
    assert global_step_columns(planner, writer, list(_sent(bad))) is None


def test_unusual_plans_are_sent_as_objects() -> None:
    plan = _local_plans(sim.World(2, 1, 1, 16), 5)[0]
    item = _first_tensor([plan])
    hinted = dataclasses.replace(item, index=dataclasses.replace(item.index, index=3))
    assert PlanColumns.of(dataclasses.replace(plan, items=[hinted])) is None
    other = dataclasses.replace(
        item, index=dataclasses.replace(item.index, offset=torch.Size([5, 0]))
    )
    assert PlanColumns.of(dataclasses.replace(plan, items=[other])) is None

    @dataclasses.dataclass(frozen=True)
    class OwnPlan(SavePlan):
        extra: int = 0

    assert PlanColumns.of(OwnPlan(plan.items)) is None


def test_custom_planners_get_their_own_step() -> None:
    writer = _writer()

    class OwnStep(_PackedObjectsSavePlanner):
        def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
            return super().create_global_plan(all_plans)

    assert plans_in_columns(_planner(), writer)
    assert not plans_in_columns(OwnStep(flatten_state_dict=False), writer)
    assert not plans_in_columns(DefaultSavePlanner(flatten_state_dict=False), writer)
    assert not plans_in_columns(_PackedObjectsSavePlanner(flatten_state_dict=True), writer)

    class OwnWriter(CloudStorageWriter):
        def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
            return super().prepare_global_plan(plans)

    assert not plans_in_columns(_planner(), OwnWriter(writer.storage))
    plans = _local_plans(sim.World(2, 1, 1, 16), 5)
    assert (
        global_step_columns(OwnStep(flatten_state_dict=False), writer, list(_sent(plans))) is None
    )


def test_a_real_save_plans_in_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = LinearGlobalPlanMixin.create_global_plan_columns

    def spy(self: LinearGlobalPlanMixin, plans: Any) -> Any:
        out = real(self, plans)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(LinearGlobalPlanMixin, "create_global_plan_columns", spy)
    cloudckpt.save(_state(), str(tmp_path / "col"), sharded_strategy=("torch_dist", 1))
    assert calls == [True]
    monkeypatch.setattr(_dcp_plan, "linear_global_columns", lambda plans: None)
    cloudckpt.save(_state(), str(tmp_path / "obj"), sharded_strategy=("torch_dist", 1))
    assert calls == [True, False]  # the object step ran instead
    for name in ("col", "obj"):
        loaded = cloudckpt.load(_state(), str(tmp_path / name))
        for key, value in _state().items():
            if hasattr(value, "data") and isinstance(value.data, torch.Tensor):
                assert torch.equal(loaded[key], value.data)


@pytest.mark.parametrize("rows", [None, 3], ids=["blocks", "three-chunk-blocks"])
def test_chunk_lists_written_from_ids_unpickle_to_the_metadatas(
    rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rows is not None:  # the records filled in blocks of three (runs across blocks)
        monkeypatch.setattr(_dcp_metadata_pickle, "_ROWS", rows)
    plans = _local_plans(sim.World(4, 2, 3, 24), 13)
    fast = linear_global_columns(_sent(plans))
    assert fast is not None
    md, chunks = fast.metadata, fast.chunks
    storage = _storage_columns(fast)
    with_ids = pickle.loads(dumps_metadata_columns(md, storage, chunks))
    assert all(not chunk_list for chunk_list in chunks.lists)  # written without objects
    chunks.fill()
    filled = pickle.loads(dumps_metadata_columns(md, storage, chunks))
    without = pickle.loads(dumps_metadata_columns(md, storage))
    expected = copy.copy(md)
    expected.storage_data = storage.storage_data()
    expected = pickle.loads(pickle.dumps(expected))
    for loaded in (with_ids, filled, without):
        assert loaded == expected and repr(loaded) == repr(expected)
    # a list replaced since (or ids that do not match): the objects are pickled
    name = chunks.names[0]
    swapped = copy.copy(md)
    swapped.state_dict_metadata = dict(md.state_dict_metadata)
    value = copy.copy(md.state_dict_metadata[name])
    value.chunks = list(value.chunks[:1])
    swapped.state_dict_metadata[name] = value
    loaded = pickle.loads(dumps_metadata_columns(swapped, storage, chunks))
    assert loaded.state_dict_metadata[name].chunks == value.chunks
    assert loaded.state_dict_metadata == swapped.state_dict_metadata


def _storage_columns(fast: Any) -> Any:
    """Made-up storage columns for ``fast``'s items (one object per rank)."""
    from cloudckpt.formats.dcp.columns import ItemResultColumns, join_columns  # noqa: PLC0415

    results = []
    for keys in fast.keys:
        n = len(keys)
        zeros = array.array("q", [0]) * n
        results.append(
            ItemResultColumns(
                ("__0_0.distcp",),
                zeros,
                array.array("q", range(n)),
                array.array("q", [7]) * n,
                array.array("q", [-1]) * n,
                zeros,
            )
        )
    joined = join_columns(fast.keys, results, {}, {})
    assert joined is not None
    return joined[0]


def test_replicas_key_lists_are_looked_up_once() -> None:
    plans = _local_plans(sim.World(4, 2, 3, 24), 7)
    sent = _sent(plans)
    table = _dcp_plan._KeyTable()
    parts = [table.add(p) for p in sent]
    assert all(p is not None for p in parts)
    distinct = {p.keys for p in sent}
    assert len(table._known) == len(distinct) < len(sent)  # DP replicas: equal lists
    fast = linear_global_columns(sent)
    expected_plans, expected_md = _dcp(plans)
    assert fast is not None
    fast.chunks.fill()
    assert fast.metadata == expected_md
    for keys, plan in zip(fast.keys, expected_plans, strict=True):
        assert [vars(keys.index(i)) for i in range(len(keys))] == [
            vars(item.index) for item in plan.items
        ]


def test_a_repeated_key_list_with_bytes_items_defers_to_dcp() -> None:
    plans = _local_plans(sim.World(1, 1, 1, 16), 5)
    assert any(i.tensor_data is None for i in plans[0].items)
    assert linear_global_columns(_sent([plans[0], copy.deepcopy(plans[0])])) is None


def test_plans_send_their_keys_as_one_string() -> None:
    plans = _local_plans(sim.World(2, 2, 2, 16), 5)
    columns = PlanColumns.of(plans[0])
    assert columns is not None and type(columns.keys) is bytes
    assert columns.fqns == [item.index.fqn for item in plans[0].items]
    assert PlanColumns.of(SavePlan([])) is not None and PlanColumns.of(SavePlan([])).fqns == []
    # a key holding the separator: the plan goes as objects
    item = plans[0].items[0]
    odd = dataclasses.replace(item, index=dataclasses.replace(item.index, fqn="a\x00b"))
    assert PlanColumns.of(SavePlan([odd, *plans[0].items[1:]])) is None


def test_a_rank_sending_objects_gets_the_chunk_lists_filled(tmp_path: Path) -> None:
    """The coordinator's step on columns leaves the chunk lists empty; where a rank then
    sends its write results as objects, ``finish_columns`` takes the objects path, which
    pickles the lists themselves: it fills them first, and ``.metadata`` is the same."""
    from cloudckpt.formats.dcp.columns import ItemResultColumns  # noqa: PLC0415
    from cloudckpt.formats.dcp.plan import apply_global_plan_update  # noqa: PLC0415
    from cloudckpt.formats.dcp.storage import read_metadata  # noqa: PLC0415

    plans = _local_plans(sim.World(2, 2, 2, 16), 13)
    written = []
    for name in ("columns", "objects"):
        planner = _planner()
        writer = CloudStorageWriter(open_checkpoint(str(tmp_path / name)))
        fast = global_step_columns(planner, writer, list(_sent(plans)))
        assert fast is not None
        metadata, keys, updates, chunks = fast
        assert all(not c for c in chunks.lists)
        results: list[Any] = []
        for plan, update in zip(plans, updates, strict=True):
            final = apply_global_plan_update(copy.deepcopy(plan), update)
            items = sim.dcp_item_results(final)
            results.append(ItemResultColumns.of(final.items, items))
        if name == "objects":
            results[1] = sim.dcp_item_results(apply_global_plan_update(plans[1], updates[1]))
        writer.save_id = "same"
        writer.finish_columns(metadata, keys, results, chunks)
        assert all(chunks.lists) == (name == "objects")
        loaded = read_metadata(writer.storage)
        loaded.storage_meta = None
        written.append(loaded)
    assert written[0] == written[1] and written[0].mcore_data == written[1].mcore_data
    assert all(getattr(v, "chunks", [1]) for v in written[0].state_dict_metadata.values())
