"""The coordinator's ``.metadata`` (``CloudStorageWriter.finish``): built in one pass, with
equal offsets, sizes and keys shared, it unpickles to the same ``Metadata`` as DCP's
plain construction (``_StorageInfo`` per item, the records in ``mcore_data``), in fewer
bytes, and cloudckpt's restricted reader reads it."""

from __future__ import annotations

import copy
import os
import pickle
import sys

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

from cloudckpt.formats.dcp.ranges import TENSOR_DATA_KEY, plain_info, with_records
from cloudckpt.formats.dcp.storage import CloudStorageWriter, read_metadata
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim


def _planned(world: sim.World, tensors: int):
    """The coordinator's metadata, its writer and every rank's item results (as gathered)."""
    shards_of = sim.rank_shards(world, tensors)
    storage = open_checkpoint(f"memory://test-dcp-finish-{os.getpid()}-{world}")
    steps = [sim.dcp_local_step(r, shards_of(r), storage) for r in range(world.size)]
    writer, planner = steps[0][0], steps[0][1]
    gathered = [pickle.loads(pickle.dumps(plan)) for _, _, plan in steps]
    planned, metadata = planner.create_global_plan(gathered)
    central = writer.prepare_global_plan(planned)
    results = [pickle.loads(pickle.dumps(sim.dcp_item_results(p))) for p in central]
    return writer, metadata, results, storage


def _reference(writer: CloudStorageWriter, metadata: Metadata, results) -> Metadata:
    """``.metadata`` as built before: a ``_StorageInfo`` per result, then the records."""
    md = copy.deepcopy(metadata)
    md.version = "1.0.0"
    md.storage_data = {wr.index: plain_info(wr.storage_data) for rank in results for wr in rank}
    md.storage_meta = writer.storage_meta()
    md.mcore_data = with_records(dict(writer.mcore_data), results)  # type: ignore[attr-defined]
    return md


def test_metadata_is_dcps_in_fewer_bytes() -> None:
    writer, metadata, results, storage = _planned(sim.World(2, 2, 2, 16), 13)
    reference = _reference(writer, metadata, copy.deepcopy(results))
    writer.finish(metadata, results)
    raw = storage.read(METADATA_FNAME)
    stored = pickle.loads(raw)
    assert type(stored) is Metadata
    assert stored.state_dict_metadata == reference.state_dict_metadata
    assert stored.storage_data == reference.storage_data
    assert list(stored.storage_data) == list(reference.storage_data)  # same order
    hints = [k.index for k in stored.storage_data]
    assert hints == [k.index for k in reference.storage_data]
    assert any(h is not None for h in hints)
    assert all(type(v) is _StorageInfo for v in stored.storage_data.values())
    assert all(not hasattr(v, "record") for v in stored.storage_data.values())
    assert stored.mcore_data == reference.mcore_data  # type: ignore[attr-defined]
    assert any(TENSOR_DATA_KEY in e for e in stored.mcore_data.values())  # type: ignore[attr-defined]
    assert stored.storage_meta == reference.storage_meta
    assert len(raw) < 0.8 * len(pickle.dumps(reference))
    restricted = read_metadata(storage, weights_only=True)
    assert restricted.storage_data == reference.storage_data


def test_the_stored_objects_are_shared_where_equal() -> None:
    writer, metadata, results, storage = _planned(sim.World(2, 1, 2, 16), 9)
    writer.finish(metadata, results)
    stored = pickle.loads(storage.read(METADATA_FNAME))
    by_value: dict[tuple[str, tuple[int, ...]], set[int]] = {}
    for key in stored.storage_data:
        if key.offset is not None:
            by_value.setdefault(("offset", tuple(key.offset)), set()).add(id(key.offset))
            by_value.setdefault(("fqn", key.fqn), set()).add(id(key.fqn))
    assert by_value and all(len(ids) == 1 for ids in by_value.values())
