"""Tensor items replayed from an earlier item of the same layout
(cloudckpt/formats/dcp/item_templates.py).

* A replayed item is byte for byte what ``torch.save`` writes (torch's zip CRC off, as
  the writer saves), except the serialization id, and ``torch.load`` reads it.
* Tensors whose pickle may hold more than their layout are never replayed.
* A torch_dist save of many tensors of few layouts, locally and in memory: stock
  PyTorch DCP and cloudckpt read every tensor back exactly.
"""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.formats.dcp.item_templates import ItemTemplates, layout_of
from cloudckpt.formats.dcp.objects import without_zip_crc32
from cloudckpt.formats.dcp.ranges import storage_record


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    with without_zip_crc32():
        torch.save(tensor, buffer)
    return buffer.getvalue()


def _id_range(item: bytes) -> tuple[int, int]:
    """Where the ``.data/serialization_id`` record's bytes lie."""
    with zipfile.ZipFile(io.BytesIO(item)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("serialization_id"))
    name_length, extra_length = (
        int.from_bytes(item[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(item[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    start = info.header_offset + 30 + name_length + extra_length
    return start, start + info.file_size


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(300, 200),
        lambda: torch.randn(40, 7).to(torch.bfloat16),
        lambda: torch.randint(0, 100, (13,), dtype=torch.int64),
        lambda: torch.randn(()),
        lambda: torch.zeros(0, 5),
        lambda: torch.randn(2, 3, 4).to(torch.float16),
    ],
    ids=["f32-big", "bf16", "int64", "scalar", "empty", "f16-3d"],
)
def test_a_replayed_item_is_what_torch_save_writes(make) -> None:  # type: ignore[no-untyped-def]
    first, second = make(), make()
    templates = ItemTemplates()
    item = memoryview(_saved(first))
    templates.learn(first, storage_record(item), item.nbytes, lambda o, n: item[o : o + n])
    out = io.BytesIO()
    written = templates.write(second, out)
    assert written is not None
    replayed, expected = out.getvalue(), _saved(second)
    assert written == (len(replayed), storage_record(memoryview(expected)))
    assert len(replayed) == len(expected)
    start, end = _id_range(expected)
    assert replayed[:start] == expected[:start] and replayed[end:] == expected[end:]
    loaded = torch.load(io.BytesIO(replayed), weights_only=True)
    assert loaded.dtype == second.dtype and torch.equal(loaded, second)


def test_tensors_whose_pickle_holds_more_are_never_replayed() -> None:
    base = torch.randn(4, 4)
    assert layout_of(base) is not None
    tagged = torch.randn(4, 4)
    tagged.note = "kept by pickle"  # type: ignore[attr-defined]
    for tensor in (
        torch.nn.Parameter(torch.randn(4, 4)),
        torch.randn(4, 4, requires_grad=True),
        torch.randn(8, 4)[4:],  # storage offset, larger storage
        torch.randn(4, 4).t(),  # not contiguous
        torch.randn(4, 4, dtype=torch.complex64).conj(),
        tagged,
    ):
        assert layout_of(tensor) is None
    templates = ItemTemplates()
    item = memoryview(_saved(base))
    templates.learn(base, storage_record(item), item.nbytes, lambda o, n: item[o : o + n])
    assert templates.write(tagged, io.BytesIO()) is None


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_of_many_tensors_of_few_layouts_reads_back(tmp_path: Path, where: str) -> None:
    state = {
        f"layer{i}.{name}": ShardedTensor.from_rank_offsets(
            f"layer{i}.{name}", torch.randn(*shape).to(dtype)
        )
        for i in range(5)
        for name, shape, dtype in (
            ("w", (64, 32), torch.bfloat16),
            ("b", (32,), torch.float32),
            ("big", (300, 300), torch.float32),
        )
    }
    uri = str(tmp_path / "ckpt") if where == "local" else f"memory://templates/{tmp_path.name}"
    cloudckpt.save(state, uri, sharded_strategy=("torch_dist", 1))
    loaded = cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data)) for k, v in state.items()},
        uri,
    )
    assert all(torch.equal(loaded[k], state[k].data) for k in state)
    if where == "local":
        target = {k: torch.zeros_like(v.data) for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(target, checkpoint_id=uri)  # stock DCP's FileSystemReader
        assert all(torch.equal(target[k], state[k].data) for k in state)
