"""Objects written front to back into their files (cloudckpt/storage/streams.py) and the
torch_dist writer on local disks, which serializes its items straight into them
(cloudckpt/formats/dcp/objects.py), and where a ``torch.save`` item keeps its
elements, read with struct (cloudckpt/formats/dcp/torch_zip.py).

* Block checksums fed in pieces equal those of the whole object.
* A stream's result (size, CRC-32C, block CRCs) is that of the bytes in its file,
  whatever the sizes of the writes; abort removes the file; a failing write (a full
  disk) is a StorageError naming the object.
* Only stores that write in place stream (local files, not async staging).
* A local torch_dist save streams every ``.distcp`` object (no whole-object write), the
  manifest's sizes and CRCs are those of the files, stock DCP reads the checkpoint, and
  every item's record is the one ``zipfile`` finds; a failing item leaves no
  unfinished file behind.
* The struct parse agrees with ``zipfile`` on torch's items and on a zip64 archive,
  and refuses what is not a zip.
"""

from __future__ import annotations

import functools
import io
import logging
import random
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.checker import verify
from cloudckpt.errors import CheckpointingException, StorageError
from cloudckpt.formats.dcp.ranges import _storage_record_zipfile, storage_record
from cloudckpt.formats.dcp.save import _PackedObjectsSavePlanner, dcp_save
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.formats.dcp.torch_zip import ZipLayoutError, find_storage
from cloudckpt.manifest import MANIFEST_FNAME, Manifest
from cloudckpt.storage import CheckpointStorage
from cloudckpt.storage.blocks import BlockChecksummer, object_checksum
from cloudckpt.storage.buffers import Progress
from cloudckpt.storage.staging import StagingStorage
from cloudckpt.storage.streams import SMALL_WRITE, ObjectStream

KiB = 1024
MiB = 1024 * KiB


def _pieces(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut at random points: tiny, mid-sized and block-spanning pieces."""
    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(data):
        size = rng.choice([1, 30, 700, SMALL_WRITE - 1, SMALL_WRITE, 300 * KiB, 1 * MiB + 3])
        pieces.append(data[at : at + size])
        at += size
    return pieces


@pytest.mark.parametrize("size", [0, 5, MiB, MiB + 1, 3 * MiB + 12345])
def test_block_checksums_fed_in_pieces_equal_the_whole_objects(size: int) -> None:
    data = random.Random(size).randbytes(size)
    checksum = BlockChecksummer()
    for piece in _pieces(data, size):
        checksum.update(piece)
    assert checksum.size == size
    assert checksum.result() == object_checksum(data)


def test_a_stream_writes_its_bytes_and_their_checksums(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    assert storage.writes_in_place
    data = random.Random(1).randbytes(5 * MiB + 77)
    progress = Progress("wrote", storage.uri, len(data), 1)
    stream = storage.open_stream("sub/obj.bin", progress)
    for piece in _pieces(data, 2):
        assert stream.write(memoryview(piece)) == len(piece)
    assert stream.tell() == len(data)
    result = stream.finish()
    assert progress.done == len(data)  # every byte counted once, as it reached the file
    assert stream.finish() == result  # idempotent
    assert (tmp_path / "ckpt" / "sub" / "obj.bin").read_bytes() == data
    crc, blocks = object_checksum(data)
    assert (result.path, result.size, result.crc32c, result.blocks) == (
        "sub/obj.bin",
        len(data),
        crc,
        blocks,
    )
    assert storage.read("sub/obj.bin") == data


def test_an_aborted_stream_leaves_no_file(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    stream = storage.open_stream("obj.bin")
    stream.write(b"x" * (2 * SMALL_WRITE))
    stream.abort()
    stream.abort()
    assert not (tmp_path / "ckpt" / "obj.bin").exists()
    with pytest.raises(ValueError, match="aborted"):
        stream.finish()


def test_a_failing_write_is_a_storage_error_naming_the_object() -> None:
    """A full disk (Linux's /dev/full refuses every write)."""
    removed: list[bool] = []
    storage = CheckpointStorage("/tmp")
    stream = ObjectStream(
        "obj.bin",
        "file:///ckpt/obj.bin",
        open("/dev/full", "wb", buffering=0),  # noqa: SIM115 - the stream closes it
        storage.pool.slots,
        lambda: removed.append(True),
    )
    with pytest.raises(StorageError, match=re.escape("failed to write file:///ckpt/obj.bin")):
        stream.write(b"x" * (2 * SMALL_WRITE))
    stream.abort()
    assert removed == [True]


def test_only_stores_writing_in_place_stream(tmp_path: Path) -> None:
    local = CheckpointStorage(str(tmp_path / "ckpt"))
    assert local.writes_in_place
    assert not StagingStorage.over(local).writes_in_place  # async saves stage in memory
    assert not CheckpointStorage("memory://streams/ckpt").writes_in_place


def _items(root: Path) -> list[tuple[Any, bytes]]:
    """Every stored item of a DCP checkpoint with its bytes."""
    metadata = dcp.FileSystemReader(str(root)).read_metadata()
    out = []
    for index, info in metadata.storage_data.items():
        raw = (root / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        out.append((index, raw))
    return out


def test_a_streamed_torch_dist_save_logs_its_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rank's streamed objects share one progress: INFO lines as bytes reach the
    store (here after every write: the interval patched to 0), ending at the total."""
    state = {"big": ShardedTensor.from_rank_offsets("big", torch.randn(512, 1024))}
    quick = functools.partial(Progress, interval=0.0)
    with (
        patch("cloudckpt.formats.dcp.storage.Progress", quick),
        caplog.at_level(logging.INFO, logger="cloudckpt.storage.buffers"),
    ):
        cloudckpt.save(state, str(tmp_path / "ckpt"), sharded_strategy=("torch_dist", 1))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wrote ")]
    assert lines, caplog.text
    done = [float(line.split()[1]) for line in lines]
    assert done == sorted(done)
    assert done[-1] >= 512 * 1024 * 4 / 1e6  # every tensor byte counted (plus the framing)
    assert str(tmp_path / "ckpt") in lines[-1]


def test_a_local_torch_dist_save_streams_its_objects(tmp_path: Path) -> None:
    state = {
        "big": ShardedTensor.from_rank_offsets("big", torch.randn(300, 1000)),
        "bf16": ShardedTensor.from_rank_offsets("bf16", torch.randn(7, 5).to(torch.bfloat16)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(2.5)),
        "empty": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
        "obj": cloudckpt.ShardedObject("obj", {"a": 1}, (1,), (0,)),
    }
    whole_writes: list[str] = []
    write_many = CheckpointStorage.write_many

    def spy(self: CheckpointStorage, items: Any, **kwargs: Any) -> Any:
        items = list(items)
        whole_writes.extend(path for path, _ in items)
        return write_many(self, items, **kwargs)

    uri = str(tmp_path / "ckpt")
    with patch.object(CheckpointStorage, "write_many", spy):
        cloudckpt.save(state, uri, sharded_strategy=("torch_dist", 1))
    assert not [p for p in whole_writes if p.endswith(".distcp")]
    manifest = Manifest.from_json(CheckpointStorage(uri).read(MANIFEST_FNAME))
    distcp = [e for e in manifest.objects if e.path.endswith(".distcp")]
    assert distcp
    for entry in distcp:
        crc, blocks = object_checksum((tmp_path / "ckpt" / entry.path).read_bytes())
        assert (entry.crc32c, entry.blocks) == (crc, blocks)
    assert verify(uri, deep=True).ok
    records = dcp.FileSystemReader(uri).read_metadata().mcore_data  # type: ignore[attr-defined]
    tensor_items = [(i, raw) for i, raw in _items(tmp_path / "ckpt") if i.fqn in state]
    assert len(tensor_items) == 4
    for index, raw in tensor_items:
        recorded = records[index.fqn]["cloudckpt_tensor_data"][tuple(index.offset)]
        assert recorded == _storage_record_zipfile(memoryview(raw))
    target = {k: torch.zeros_like(v.data) for k, v in state.items() if k != "obj"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=uri)  # stock DCP's FileSystemReader
    assert all(torch.equal(target[k], state[k].data) for k in target)
    loaded = cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in target.items()},
        uri,
    )
    assert all(torch.equal(loaded[k], target[k]) for k in target)


def test_a_failing_item_leaves_no_unfinished_object(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    writer = CloudStorageWriter(storage, object_size=1500)
    resolve = _PackedObjectsSavePlanner.resolve_data
    seen: list[str] = []

    def failing(planner: Any, item: Any) -> Any:
        seen.append(item.index.fqn)
        if len(seen) == 3:
            raise RuntimeError("the planner failed")
        return resolve(planner, item)

    state = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}
    with (
        patch.object(_PackedObjectsSavePlanner, "resolve_data", failing),
        pytest.raises(CheckpointingException, match="the planner failed"),
    ):
        dcp_save(state, writer)
    # one ~2.2 kB item per object: __0_0 was finished, __0_1 (holding the second item)
    # was open when the third failed, and is removed
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["__0_0.distcp"]
    assert (tmp_path / "ckpt" / "__0_0.distcp").stat().st_size > 1024


def _saved(value: Any) -> memoryview:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return memoryview(buffer.getvalue())


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(300, 100),
        torch.zeros(0),
        torch.arange(7, dtype=torch.int8),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.tensor(3.0),
        [torch.randn(3), torch.randn(4)],  # two storages: no record
        {"a": 1},  # none
    ],
    ids=["f32", "empty", "int8", "bf16", "scalar", "two-storages", "no-storage"],
)
def test_the_struct_parse_agrees_with_zipfile(value: Any) -> None:
    item = _saved(value)
    assert storage_record(item) == _storage_record_zipfile(item)
    if isinstance(value, torch.Tensor):
        assert storage_record(item) is not None


def test_the_struct_parse_reads_zip64_entries() -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", b"pickle")
        with archive.open("archive/data/0", "w", force_zip64=True) as record:
            record.write(b"e" * 100)
    item = memoryview(buffer.getvalue())
    start, nbytes = storage_record(item) or (0, 0)
    assert nbytes == 100 and bytes(item[start : start + nbytes]) == b"e" * 100
    assert (start, nbytes) == _storage_record_zipfile(item)


def test_the_struct_parse_refuses_what_is_not_a_zip() -> None:
    junk = memoryview(b"not a zip archive at all" * 4)
    with pytest.raises(ZipLayoutError):
        find_storage(lambda offset, nbytes: junk[offset : offset + nbytes], junk.nbytes)
    assert storage_record(junk) is None  # zipfile refuses it too
    item = _saved(torch.randn(10))
    with pytest.raises(ZipLayoutError, match="not at hand"):
        find_storage(lambda offset, nbytes: None, item.nbytes)
