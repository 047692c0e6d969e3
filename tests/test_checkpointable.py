"""CheckpointableShardedTensor / LocalShardsContainer: DCP write items, chunks, lookup."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType

from cloudckpt import ShardedTensor
from cloudckpt.errors import CheckpointingException
from cloudckpt.strategies.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    dcp_chunk,
    dcp_global_shape,
)

FULL = torch.arange(48.0).reshape(6, 8)


def _tile(row: int, col: int) -> CheckpointableShardedTensor:
    """Tile (row, col) of FULL cut into a 2 x 2 grid of (3, 4) tiles."""
    data = FULL[row * 3 : row * 3 + 3, col * 4 : col * 4 + 4].clone()
    sh = ShardedTensor.from_rank_offsets("w", data, (0, row, 2), (1, col, 2))
    return CheckpointableShardedTensor.from_sh_ten(sh)


def test_regular_shard_write_items_and_chunks():
    ten = _tile(1, 0)
    assert ten.shape == (6, 8) and ten.dtype == torch.float32
    (item,) = ten.__create_write_items__("w", ten)
    assert item.type == WriteItemType.SHARD
    assert item.index == MetadataIndex("w", torch.Size([3, 0]))
    assert item.tensor_data.size == torch.Size([6, 8])
    assert item.tensor_data.chunk.offsets == torch.Size([3, 0])
    assert item.tensor_data.chunk.sizes == torch.Size([3, 4])
    assert item.tensor_data.properties.dtype == torch.float32
    assert ten.__create_chunk_list__() == [item.tensor_data.chunk]
    assert torch.equal(ten.__get_tensor_shard__(item.index), FULL[3:6, 0:4])
    assert "CheckpointableShardedTensor" in repr(ten) and "'w'" in repr(ten)


def test_prepended_axes_become_singleton_dimensions():
    expert = torch.arange(6.0).reshape(2, 3)
    sh = ShardedTensor.from_rank_offsets("experts", expert, (0, 2, 4), prepend_axis_num=1)
    ten = CheckpointableShardedTensor.from_sh_ten(sh)
    chunk = dcp_chunk(sh)
    assert ten.shape == (4, 2, 3)
    assert chunk.offsets == torch.Size([2, 0, 0]) and chunk.sizes == torch.Size([1, 2, 3])
    assert ten.__get_tensor_shard__(MetadataIndex("experts")).shape == (1, 2, 3)


def test_flattened_shard_uses_the_nd_flattened_layout():
    # local chunk (3, 8) of a (6, 8) tensor split in two along axis 0; elements 5..17 of chunk 1
    data = FULL[3:6].reshape(-1)[5:17].clone()
    sh = ShardedTensor.from_rank_offsets_flat(
        "exp_avg", data, (3, 8), (0, 1, 2), flattened_range=slice(5, 17)
    )
    assert dcp_global_shape(sh) == torch.Size([2, 1, 24])
    ten = CheckpointableShardedTensor.from_sh_ten(sh)
    (item,) = ten.__create_write_items__("exp_avg", ten)
    assert item.tensor_data.chunk.offsets == torch.Size([1, 0, 5])
    assert item.tensor_data.chunk.sizes == torch.Size([1, 1, 12])
    assert torch.equal(ten.__get_tensor_shard__(item.index).reshape(-1), data)


def test_container_delegates_and_looks_up_by_hint_and_offset():
    shards = [_tile(r, c) for r in range(2) for c in range(2)]
    cont = LocalShardsContainer(shards)
    assert cont.shape == (6, 8)
    items = cont.__create_write_items__("w", cont)
    assert [i.index.index for i in items] == [0, 1, 2, 3]
    assert [tuple(c.offsets) for c in cont.__create_chunk_list__()] == [
        (0, 0),
        (0, 4),
        (3, 0),
        (3, 4),
    ]
    by_hint = cont.__get_tensor_shard__(MetadataIndex("w", torch.Size([3, 4]), 3))
    assert torch.equal(by_hint, FULL[3:, 4:])
    wrong_hint = cont.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 4]), 3))
    assert torch.equal(wrong_hint, FULL[:3, 4:])  # falls back to the offset search
    by_offset = cont.__get_tensor_shard__(MetadataIndex("w", torch.Size([3, 0])))
    assert torch.equal(by_offset, FULL[3:, :4])
    with pytest.raises(CheckpointingException, match="offset"):
        cont.__get_tensor_shard__(MetadataIndex("w"))
    with pytest.raises(CheckpointingException, match=r"\(1, 1\)"):
        cont.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 1])))
    assert repr(cont).startswith("LocalShardsContainer([")


def test_container_of_flattened_shards():
    chunk = FULL[:3].reshape(-1)
    pieces = [
        ShardedTensor.from_rank_offsets_flat(
            "m", chunk[a:b].clone(), (3, 8), (0, 0, 2), flattened_range=slice(a, b)
        )
        for a, b in ((0, 10), (10, 24))
    ]
    cont = LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(p) for p in pieces])
    shard = cont.__get_tensor_shard__(MetadataIndex("m", torch.Size([0, 0, 10])))
    assert torch.equal(shard.reshape(-1), chunk[10:])


def test_tensor_operations_and_bad_inputs_are_refused():
    ten = _tile(0, 0)
    with pytest.raises(NotImplementedError, match="Tensor operations"):
        ten + 1
    with pytest.raises(NotImplementedError):
        LocalShardsContainer([ten]) * 2
    with pytest.raises(CheckpointingException, match="at least one"):
        LocalShardsContainer([])
    with pytest.raises(CheckpointingException, match="CheckpointableShardedTensor"):
        LocalShardsContainer([torch.zeros(2)])
    with pytest.raises(CheckpointingException, match="no data"):
        CheckpointableShardedTensor.from_sh_ten(
            ShardedTensor.from_rank_offsets("w", torch.zeros(2)).without_data()
        )


def test_dcp_save_and_load_through_torch_distributed_checkpoint(tmp_path):
    """A state dict of checkpointables saved with stock DCP (FileSystemWriter) and loaded."""
    chunk = FULL[3:].reshape(-1)
    flat = [
        ShardedTensor.from_rank_offsets_flat(
            "m", chunk[a:b].clone(), (3, 8), (0, 1, 2), flattened_range=slice(a, b)
        )
        for a, b in ((0, 7), (7, 24))
    ]
    flat_top = ShardedTensor.from_rank_offsets_flat(
        "m", FULL[:3].reshape(-1).clone(), (3, 8), (0, 0, 2), flattened_range=slice(0, 24)
    )
    state = {
        "w": LocalShardsContainer([_tile(r, c) for r in range(2) for c in range(2)]),
        "m": LocalShardsContainer(
            [CheckpointableShardedTensor.from_sh_ten(s) for s in (*flat, flat_top)]
        ),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metadata = dcp.save(state, checkpoint_id=str(tmp_path))
        md = metadata.state_dict_metadata["m"]
        assert isinstance(md, TensorStorageMetadata) and md.size == torch.Size([2, 1, 24])
        target = {"w": torch.zeros(6, 8), "m": torch.zeros(2, 1, 24)}
        dcp.load(target, checkpoint_id=str(tmp_path))
    assert torch.equal(target["w"], FULL)
    assert torch.equal(target["m"].reshape(2, 3, 8).reshape(6, 8), FULL)
