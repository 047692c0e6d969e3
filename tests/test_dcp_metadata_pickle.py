"""``.metadata`` pickled in columns (cloudckpt.formats.dcp.metadata_pickle): it
unpickles, with ``pickle``, DCP's ``FileSystemReader`` and cloudckpt's restricted reader,
to a ``Metadata`` equal to what ``pickle.dumps`` gives (same classes, same instance
dicts, same order), and falls back to ``pickle.dumps`` where an item has another shape."""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from cloudckpt.formats.dcp import metadata_pickle as _dcp_metadata_pickle
from cloudckpt.formats.dcp.columns import RecordColumns
from cloudckpt.formats.dcp.metadata_pickle_dict import dumps_metadata
from cloudckpt.formats.dcp.unpickler import load_dcp_metadata

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim


def _metadata(world: sim.World, tensors: int) -> Metadata:
    """The ``.metadata`` the simulated save's coordinator writes."""
    row = sim.simulate("torch_dist", world, tensors)
    md = row.artifacts["dcp_metadata"]
    assert isinstance(md, Metadata)
    return md


def _same(loaded: Metadata, expected: Metadata) -> None:
    """Equal, field by field, down to the storage items' classes and instance dicts."""
    assert type(loaded) is type(expected) is Metadata
    assert loaded == expected and repr(loaded) == repr(expected)
    assert vars(loaded).keys() == vars(expected).keys()
    assert list(loaded.storage_data) == list(expected.storage_data)  # same order
    for (key, info), (ref_key, ref_info) in zip(
        loaded.storage_data.items(), expected.storage_data.items(), strict=True
    ):
        assert type(key) is MetadataIndex and type(info) is _StorageInfo
        assert vars(key) == vars(ref_key) and list(vars(key)) == list(vars(ref_key))
        assert vars(info) == vars(ref_info) and list(vars(info)) == list(vars(ref_info))
        assert key.index == ref_key.index  # the hint (not part of equality)
    assert getattr(loaded, "mcore_data", None) == getattr(expected, "mcore_data", None)


@pytest.mark.parametrize("world", [sim.World(2, 2, 2, 16), sim.World(4, 2, 3, 24)])
def test_unpickles_to_what_pickle_dumps_gives(world, tmp_path: Path) -> None:
    md = _metadata(world, 13)
    raw = dumps_metadata(md)
    expected = pickle.loads(pickle.dumps(md))
    assert raw != pickle.dumps(md)  # the columns path ran
    assert any(k.offset is None for k in md.storage_data)  # bytes items: records apart
    _same(pickle.loads(raw), expected)
    _same(load_dcp_metadata(raw, "test", weights_only=True), expected)  # restricted
    (tmp_path / ".metadata").write_bytes(raw)
    read = FileSystemReader(str(tmp_path)).read_metadata()  # PyTorch DCP's reader
    assert read.storage_meta is not None and read.storage_meta.load_id  # which it sets
    read.storage_meta.load_id = None
    _same(read, expected)


def test_fewer_bytes_than_pickle_dumps() -> None:
    md = _metadata(sim.World(2, 2, 2, 16), 40)
    assert len(dumps_metadata(md)) < len(pickle.dumps(md))


def test_large_offsets_and_odd_keys() -> None:
    """Offsets past 2 GiB (8-byte ints), a tensor item without index hint or offset,
    fqns equal to the field names, non-ASCII keys and paths."""
    md = _metadata(sim.World(2, 1, 2, 16), 6)
    items = list(md.storage_data.items())
    (key, info), (key2, info2) = items[0], items[1]
    extra = {
        MetadataIndex("offset", torch.Size([0, 1])): _StorageInfo("p/ä.distcp", 3 << 31, 1 << 33),
        MetadataIndex("fqn"): _StorageInfo("index", 0, 1),
        MetadataIndex("schlüssel\udcff", torch.Size([2]), 7): _StorageInfo("x", -1, 5),
        MetadataIndex(key.fqn, key.offset, None): info,
        key2: info2,
    }
    md.storage_data = {**dict(items[2:]), **extra}
    raw = dumps_metadata(md)
    assert raw != pickle.dumps(md)
    _same(pickle.loads(raw), pickle.loads(pickle.dumps(md)))


@pytest.mark.parametrize(
    "edit",
    [
        lambda info: setattr(info, "transform_descriptors", ["zstd"]),
        lambda info: setattr(info, "relative_path", b"bytes"),
        lambda info: setattr(info, "extra", 1),
    ],
)
def test_other_shapes_fall_back_to_pickle_dumps(edit) -> None:
    md = _metadata(sim.World(2, 1, 1, 16), 4)
    md = copy.deepcopy(md)
    edit(next(iter(md.storage_data.values())))
    assert dumps_metadata(md) == pickle.dumps(md, protocol=4)


def test_other_keys_fall_back_to_pickle_dumps() -> None:
    md = copy.deepcopy(_metadata(sim.World(2, 1, 1, 16), 4))
    key, info = next(iter(md.storage_data.items()))
    md.storage_data[MetadataIndex(key.fqn, [5, 5], 0)] = info  # a torch.Size made of a list
    object.__setattr__(next(iter(md.storage_data)), "offset", (0, 0))  # a plain tuple
    assert dumps_metadata(md) == pickle.dumps(md, protocol=4)


def test_chunks_of_another_shape_are_left_to_the_pickler() -> None:
    """A chunk whose offsets are a plain tuple: the chunk lists are pickled by the
    pickler, the storage items still in columns; equal either way."""
    md = copy.deepcopy(_metadata(sim.World(2, 2, 1, 16), 6))
    tensor = next(v for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))
    tensor.chunks[0].offsets = tuple(tensor.chunks[0].offsets)
    raw = dumps_metadata(md)
    assert raw != pickle.dumps(md)
    loaded = pickle.loads(raw)
    _same(loaded, pickle.loads(pickle.dumps(md)))
    assert type(loaded.state_dict_metadata[tensor_key(md, tensor)].chunks[0].offsets) is tuple


def tensor_key(md: Metadata, value: object) -> str:
    return next(k for k, v in md.state_dict_metadata.items() if v is value)


def test_chunk_lists_in_columns_load_as_chunks() -> None:
    md = _metadata(sim.World(2, 2, 2, 16), 13)
    loaded = pickle.loads(dumps_metadata(md))
    for key, value in md.state_dict_metadata.items():
        chunks = getattr(value, "chunks", None)
        if chunks is None:
            continue
        got = loaded.state_dict_metadata[key].chunks
        assert type(got) is list and got == chunks
        assert [list(vars(c)) for c in got] == [["offsets", "sizes"]] * len(chunks)
        assert all(type(c.offsets) is type(c.sizes) is torch.Size for c in got)


def _records(wide: bool) -> RecordColumns:
    """Two record tables: the first with equal offsets twice (the later record wins)."""
    ids = np.array
    last = 2**40 if wide else 9
    return RecordColumns(
        ["a", "b"],
        [{}, {}],
        [(0, 0), (4, 0), (), (8, 8)],
        ids([0, 3, 4]),
        ids([0, 1, 0, 2]),
        ids([5, 6, 7, last]),
        ids([1, 2, 3, 4]),
    )


@pytest.mark.parametrize("wide", [False, True])
def test_record_tables_written_from_arrays_unpickle_to_the_dicts(wide: bool) -> None:
    records = _records(wide)
    out = _dcp_metadata_pickle._Stream()
    out.write(pickle.PROTO + bytes([4]))
    assert _dcp_metadata_pickle._write_record_columns(out, records)
    assert records.tables == [{}, {}]  # written without the objects
    pickler = pickle.Pickler(out.buffer, protocol=4)
    pickler.memo = out.memo
    pickler.dump({"x": {"t": records.tables[0]}, "y": records.tables[1]})
    loaded = pickle.loads(out.buffer.getvalue())
    records.fill()
    assert records.tables[0] == {(0, 0): (7, 3), (4, 0): (6, 2)}
    assert records.tables[1] == {(): (9 if not wide else 2**40, 4)}
    assert loaded == {"x": {"t": records.tables[0]}, "y": records.tables[1]}
    assert list(loaded["x"]["t"]) == list(records.tables[0])  # the same order
    # a table filled since: the pickler writes them all
    assert not _dcp_metadata_pickle._write_record_columns(_dcp_metadata_pickle._Stream(), records)


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
def test_runs_are_written_block_by_block_as_one_array_writes_them(rows: int) -> None:
    """``_write_runs``: runs (empty ones too, first, inside and last) whose records are
    filled block by block give the bytes of the runs written from one array."""
    values = np.arange(10, dtype=np.uint8)
    cases = [[0, 10], [0, 0, 3, 3, 10, 10], [0, 4, 4, 4, 7, 10], [0, 0], [0, 0, 0], [0, 10, 10, 10]]
    head, tail = b"(", b")"
    for bounds in cases:
        expected = (
            head
            + (tail + head).join(values[a:b].tobytes() for a, b in itertools.pairwise(bounds))
            + tail
        )
        out = _dcp_metadata_pickle._Stream()
        block = np.zeros(min(rows, bounds[-1]), dtype=np.uint8)

        def fill(part: slice, block: np.ndarray = block) -> None:
            block[: len(values[part])] = values[part]

        _dcp_metadata_pickle._write_runs(out, block, fill, bounds, (head, tail))
        assert out.buffer.getvalue() == expected, bounds
