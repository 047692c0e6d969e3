"""Write results in columns and ``.metadata`` from columns (cloudckpt.formats.
dcp.columns, dcp.storage.CloudStorageWriter.finish_columns, dcp.metadata_pickle.
dumps_metadata_columns): the ``.metadata`` written unpickles to the ``Metadata`` of
the object path and of DCP's own step on the same state, and anything the columns
cannot say (a custom writer, an unknown storage info) takes the object path."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.formats.dcp import metadata_pickle as _dcp_metadata_pickle
from cloudckpt.formats.dcp import steps as _dcp_dist
from cloudckpt.formats.dcp.columns import (
    ItemResultColumns,
    PlanKeys,
    StorageColumns,
    _record_tables,
    as_write_results,
)
from cloudckpt.formats.dcp.plan import apply_global_plan_update, global_plan_updates
from cloudckpt.formats.dcp.ranges import RecordedStorageInfo, plain_info
from cloudckpt.formats.dcp.steps import column_keys, create_global_plan, writes_columns
from cloudckpt.formats.dcp.storage import CloudStorageWriter, read_metadata
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.formats.dcp.unpickler import load_dcp_metadata
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim

WORLDS = [sim.World(2, 2, 2, 16), sim.World(4, 2, 3, 24)]


def _ranks(world: sim.World, tensors: int, uri: str) -> tuple[list[Any], list[SavePlan]]:
    """Every rank's (writer, planner, local plan) over checkpoint ``uri``."""
    shards_of = sim.rank_shards(world, tensors)
    storage = open_checkpoint(uri)
    steps = [sim.dcp_local_step(r, shards_of(r), storage) for r in range(world.size)]
    return steps, [s[2] for s in steps]


def _planned(world: sim.World, tensors: int, uri: str) -> tuple[Any, ...]:
    """The coordinator's writer, metadata and column keys, and each rank's final plan
    and item results (as ``write_data`` gives them)."""
    steps, local = _ranks(world, tensors, uri)
    writer, planner = steps[0][0], steps[0][1]
    planned, metadata = create_global_plan(planner, writer, local)
    central = writer.prepare_global_plan(planned)
    updates = global_plan_updates(planner, planned, central)
    keys = column_keys(planner, writer, planned, updates)
    final = [apply_global_plan_update(p, u) for p, u in zip(local, updates, strict=True)]
    results = [sim.dcp_item_results(p) for p in final]
    return writer, metadata, keys, final, results


def _key_view(md: Metadata) -> dict[Any, Any]:
    """``storage_data`` with each key's index hint (not part of its equality)."""
    return {(k.fqn, k.offset, k.index): vars(v) for k, v in md.storage_data.items()}


@pytest.mark.parametrize("rows", [None, 5], ids=["blocks", "five-item-blocks"])
@pytest.mark.parametrize("world", WORLDS)
def test_metadata_from_columns_is_the_object_paths_and_dcps(
    world: sim.World, rows: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rows is not None:  # the records written in blocks of five items (others inside)
        monkeypatch.setattr(_dcp_metadata_pickle, "_ROWS", rows)
    writer, metadata, keys, final, results = _planned(world, 13, str(tmp_path / "obj"))
    assert keys is not None  # cloudckpt's linear step and writer: columns
    columns = [ItemResultColumns.of(p.items, r) for p, r in zip(final, results, strict=True)]
    assert all(c is not None for c in columns)
    writer.finish(copy.copy(metadata), copy.deepcopy(results))
    expected = pickle.loads(writer.storage.read(METADATA_FNAME))

    col_writer, col_md, col_keys, _, _ = _planned(world, 13, str(tmp_path / "col"))
    col_writer.save_id = writer.save_id
    col_writer.finish_columns(col_md, col_keys, columns)
    raw = col_writer.storage.read(METADATA_FNAME)
    assert col_writer.metadata is not None and col_writer.metadata.storage_data is None
    assert col_writer.storage_columns is not None and len(col_writer.storage_columns) == len(
        expected.storage_data
    )
    for loaded in (
        pickle.loads(raw),
        load_dcp_metadata(raw, "test", weights_only=True),  # cloudckpt's restricted unpickler
        read_metadata(col_writer.storage),
        FileSystemReader(str(tmp_path / "col")).read_metadata(),  # DCP's reader
    ):
        loaded.storage_meta = expected.storage_meta  # the checkpoint's own uri
        assert type(loaded) is Metadata and loaded == expected
        assert _key_view(loaded) == _key_view(expected)
        assert loaded.mcore_data == expected.mcore_data  # type: ignore[attr-defined]
        assert all(type(v) is _StorageInfo for v in loaded.storage_data.values())

    # DCP's own step on the same local plans: the same chunks, keys, hints and infos
    _, local = _ranks(world, 13, str(tmp_path / "dcp"))
    dcp_plans, dcp_md = DefaultSavePlanner(flatten_state_dict=False).create_global_plan(local)
    assert dcp_md.state_dict_metadata == expected.state_dict_metadata
    dcp_plans = CloudStorageWriter(writer.storage).prepare_global_plan(dcp_plans)
    dcp_storage = {  # as DCP's FileSystemWriter.finish merges the results
        (r.index.fqn, r.index.offset, r.index.index): _pickled_vars(plain_info(r.storage_data))
        for plan in dcp_plans
        for r in sim.dcp_item_results(plan)
    }
    assert _key_view(pickle.loads(raw)) == dcp_storage


def _pickled_vars(info: Any) -> dict[str, Any]:
    """``info``'s fields as its pickle stores them (``_StorageInfo.__getstate__``)."""
    return vars(pickle.loads(pickle.dumps(info)))


def test_result_columns_round_trip_to_the_results(tmp_path: Path) -> None:
    _, _, keys, final, results = _planned(sim.World(2, 2, 2, 16), 9, str(tmp_path / "c"))
    assert keys is not None
    for plan_keys, plan, rank in zip(keys, final, results, strict=True):
        columns = ItemResultColumns.of(plan.items, list(reversed(rank)))  # any order
        assert columns is not None
        again = pickle.loads(pickle.dumps(columns))  # as the gather sends it
        back = {(r.index.fqn, r.index.offset): r for r in as_write_results(plan_keys, again)}
        assert len(back) == len(rank)
        for result in rank:
            got = back[(result.index.fqn, result.index.offset)]
            assert vars(got.index) == vars(result.index)
            assert got.size_in_bytes == result.size_in_bytes
            assert vars(got.storage_data) == vars(result.storage_data)
            assert type(got.storage_data) is RecordedStorageInfo


def test_results_the_columns_cannot_say_are_sent_as_objects(tmp_path: Path) -> None:
    _, _, _, final, results = _planned(sim.World(2, 1, 1, 16), 5, str(tmp_path / "c"))
    items, rank = final[0].items, results[0]
    assert ItemResultColumns.of(items, rank) is not None
    assert ItemResultColumns.of(items, rank[:-1]) is None  # a result missing
    assert ItemResultColumns.of(items, [rank[0], *rank[:-1]]) is None  # one twice
    info = rank[0].storage_data
    transformed = dataclasses.replace(info, transform_descriptors=["zstd"])
    edited = [DcpWriteResult(rank[0].index, info.length, transformed), *rank[1:]]
    assert ItemResultColumns.of(items, edited) is None
    foreign = dataclasses.replace(rank[0], index=copy.copy(rank[0].index))
    assert ItemResultColumns.of(items, [foreign, *rank[1:]]) is None  # not the plan's item


def test_custom_writers_and_planners_take_the_object_path(tmp_path: Path) -> None:
    class Custom(CloudStorageWriter):
        def finish(self, metadata: Metadata, results: list[list[DcpWriteResult]]) -> None:
            super().finish(metadata, results)

    storage = open_checkpoint(str(tmp_path / "w"))
    assert writes_columns(CloudStorageWriter(storage))
    assert not writes_columns(Custom(storage))
    steps, local = _ranks(sim.World(2, 1, 2, 16), 5, str(tmp_path / "p"))
    planner = steps[0][1]
    writer = Custom(storage)
    planned, _ = create_global_plan(planner, writer, local)
    updates = global_plan_updates(planner, planned, writer.prepare_global_plan(planned))
    assert column_keys(planner, writer, planned, updates) is None
    dcp_planner = DefaultSavePlanner(flatten_state_dict=False)
    plain = CloudStorageWriter(storage)
    planned, _ = dcp_planner.create_global_plan(local)
    updates = global_plan_updates(dcp_planner, planned, plain.prepare_global_plan(planned))
    assert column_keys(dcp_planner, plain, planned, updates) is None  # DCP's planner


def test_plan_keys_carry_the_hints(tmp_path: Path) -> None:
    _, _, keys, final, _ = _planned(sim.World(2, 2, 2, 16), 9, str(tmp_path / "c"))
    assert keys is not None
    for plan_keys, plan in zip(keys, final, strict=True):
        assert isinstance(plan_keys, PlanKeys)
        assert [vars(plan_keys.index(i)) for i in range(len(plan_keys))] == [
            vars(item.index) for item in plan.items
        ]


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(8, 6)),
        "b": ShardedTensor.from_rank_offsets("b", torch.randn(6)),
        "emb": ShardedTensor.from_rank_offsets("emb", torch.randn(4, 4).bfloat16()),
        "rng": ShardedObject("rng_state", {"seed": 11}, (1,), (0,)),
    }


def test_a_real_save_writes_columns_and_equals_the_object_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = CloudStorageWriter.finish_columns

    def spy(self: CloudStorageWriter, *args: Any) -> None:
        calls.append(1)
        real(self, *args)

    monkeypatch.setattr(CloudStorageWriter, "finish_columns", spy)
    cloudckpt.save(_state(), str(tmp_path / "col"), sharded_strategy=("torch_dist", 1))
    assert calls == [1]
    monkeypatch.setattr(_dcp_dist, "global_step_columns", lambda *a: None)  # the object path
    monkeypatch.setattr(_dcp_dist, "column_keys", lambda *a: None)
    cloudckpt.save(_state(), str(tmp_path / "obj"), sharded_strategy=("torch_dist", 1))
    assert calls == [1]
    col = read_metadata(open_checkpoint(str(tmp_path / "col")))
    obj = read_metadata(open_checkpoint(str(tmp_path / "obj")))
    col.storage_meta = obj.storage_meta
    assert col == obj and _key_view(col) == _key_view(obj)
    assert col.mcore_data == obj.mcore_data  # type: ignore[attr-defined]
    loaded = cloudckpt.load(_state(), str(tmp_path / "col"))
    for key, value in _state().items():
        if isinstance(value, ShardedTensor):
            assert torch.equal(loaded[key], value.data)


def test_record_tables_of_items_all_recorded_or_not() -> None:
    """``_record_tables`` where every item has a record (no subset taken) gives the tables
    it gives with an item without one added (a bytes item: no offset, no record)."""
    rng = np.random.default_rng(3)
    n, names = 500, [f"t{i}" for i in range(40)]
    key_ids = rng.integers(0, len(names), n)
    offset_ids = rng.integers(0, 3, n)
    starts, nbytes = rng.integers(0, 1000, n), rng.integers(1, 100, n)

    def tables(extra: int) -> Any:
        pad = [np.full(extra, -1, dtype=np.int64)]
        cols = StorageColumns(
            [*names, "bytes"],
            [torch.Size([0]), torch.Size([4]), torch.Size([8])],
            ["p"],
            np.concatenate([key_ids, np.full(extra, len(names))]),
            np.concatenate([offset_ids, *pad]),
            np.zeros(n + extra, dtype=np.int64),
            np.zeros(n + extra, dtype=np.int64),
            np.concatenate([starts, *pad]),
            np.ones(n + extra, dtype=np.int64),
        )
        return _record_tables(cols, cols.starts, np.concatenate([nbytes, *pad]))

    every, some = tables(0), tables(1)
    assert every.names == some.names and len(every.names) == len(set(key_ids.tolist()))
    for field in ("bounds", "point_ids", "starts", "nbytes"):
        assert np.array_equal(getattr(every, field), getattr(some, field)), field
    every.fill()
    expected: dict[str, dict[tuple[int, ...], tuple[int, int]]] = {}
    for i in range(n):  # item order: the later of equal offsets wins
        point = ((0,), (4,), (8,))[int(offset_ids[i])]
        expected.setdefault(names[int(key_ids[i])], {})[point] = (int(starts[i]), int(nbytes[i]))
    assert every.by_name() == expected
