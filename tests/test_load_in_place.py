"""A torch_dist load reads each unresharded chunk straight into the requested tensor's own
memory (``ShardedTensor.data``), as Megatron-Core's torch_dist load and the fully parallel
exchange do, where that memory can hold the chunk as it is: a plain CPU tensor of the
shard's dtype and local shape, contiguous, whole (no flattened range), sharing memory with
no other requested tensor. Otherwise a new tensor is allocated; the values are exact either
way. A default load makes two collectives (4 real gloo processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor


def _values(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator).to(dtype)


def _save(uri: str, tensors: dict[str, torch.Tensor]) -> None:
    state = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    cloudckpt.save(state, uri)


def test_a_whole_chunk_is_read_into_the_requested_tensor(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    saved = {"w": _values((256, 512), 0), "b": _values((512,), 1, torch.bfloat16)}
    _save(uri, saved)
    targets = {k: torch.zeros_like(v) for k, v in saved.items()}
    request = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}
    loaded = cloudckpt.load(request, uri)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value)
        assert torch.equal(targets[key], value)  # the caller's memory holds the values
        assert loaded[key].data_ptr() == targets[key].data_ptr()


def test_requests_sharing_memory_each_get_their_own_values(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    saved = {"a": _values((64, 64), 2), "b": _values((64, 64), 3), "c": _values((32, 64), 4)}
    _save(uri, saved)
    shared = torch.zeros(64, 64)
    alone = torch.zeros(32, 64)
    request = {
        "a": ShardedTensor.from_rank_offsets("a", shared),
        "b": ShardedTensor.from_rank_offsets("b", shared),  # the same memory as "a"
        "c": ShardedTensor.from_rank_offsets("c", alone),
    }
    loaded = cloudckpt.load(request, uri, validate_access_integrity=False)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    assert loaded["a"].data_ptr() != loaded["b"].data_ptr()
    assert loaded["c"].data_ptr() == alone.data_ptr()  # alone: read in place


def test_a_tensor_that_cannot_hold_the_chunk_as_it_is_gets_a_new_one(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    saved = {"t": _values((64, 32), 5)}
    _save(uri, saved)
    transposed = torch.zeros(32, 64).t()  # (64, 32), not contiguous
    loaded = cloudckpt.load({"t": ShardedTensor.from_rank_offsets("t", transposed)}, uri)
    assert torch.equal(loaded["t"], saved["t"])
    assert torch.count_nonzero(transposed) == 0  # left alone
    assert loaded["t"].data_ptr() != transposed.data_ptr()


def test_a_parameter_is_filled_without_autograd(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    saved = {"p": _values((16, 16), 6)}
    _save(uri, saved)
    param = torch.nn.Parameter(torch.zeros(16, 16))
    loaded = cloudckpt.load({"p": ShardedTensor.from_rank_offsets("p", param)}, uri)
    assert torch.equal(param.detach(), saved["p"])
    assert not loaded["p"].requires_grad and param.requires_grad


# -- collectives of a load (4 real gloo processes) -------------------------------------------


def _count_collectives(rank: int, world: int, root: str, backend: str) -> dict[str, Any]:
    """Save a TP2 x DP2 state, then count cloudckpt's collectives (check-ins) of a
    default load of it, and check what was loaded."""
    from cloudckpt import dist_guard  # noqa: PLC0415
    from tests.test_multirank import check_tp, tp_state  # noqa: PLC0415

    uri = os.path.join(root, f"ckpt-{backend}")
    cloudckpt.save(tp_state(rank, tp=2), uri, sharded_strategy=(backend, 1))
    with dist_guard.recorded_check_ins() as names:
        loaded = cloudckpt.load(tp_state(rank, tp=2, empty=True), uri)
    check_tp(loaded, rank, tp=2)
    return {"names": names}


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_a_default_load_makes_two_collectives(rank_pool: Any, tmp_path: Path, backend: str) -> None:
    """One all-gather agrees on opening and carries every rank's shards' metadata (for
    the validation), one agrees on the reads: no separate gather of the metadata."""
    for out in rank_pool.run(_count_collectives, str(tmp_path), backend):
        assert len(out["names"]) == 2, out["names"]
        assert out["names"][0].startswith("agreeing on opening checkpoint")
        assert out["names"][1].startswith("agreeing on loading checkpoint")
