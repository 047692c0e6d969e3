"""Multi-process save/load: 4 real ranks in a gloo group (see conftest.rank_pool).

Each scenario function runs on every rank, saves with one layout, loads with
others and asserts bit-exact equality against the global reference tensors; it
returns a count of what it checked, which the test asserts too.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import cloudckpt
from cloudckpt import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
)
from cloudckpt.errors import DistributedCheckpointError, ShardingValidationError
from cloudckpt.manifest import CLAIM_FNAME

# key -> (global shape, axis split over tensor-parallel ranks)
TP_KEYS = {"w_col": ((8, 6), 0), "w_row": ((6, 8), 1), "bias": ((8,), 0)}


def reference(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The global value of tensor ``key``: deterministic, distinct per key."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(0, 120, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def tp_state(rank: int, tp: int, empty: bool = False) -> dict:
    """Tensor-parallel (size ``tp``) x data-parallel layout of TP_KEYS on ``rank``."""
    tp_rank, dp_rank = rank % tp, rank // tp
    state = {}
    for key, (shape, axis) in TP_KEYS.items():
        local = reference(key, shape).chunk(tp, dim=axis)[tp_rank].clone()
        if empty:
            local = torch.empty_like(local)
        state[key] = ShardedTensor.from_rank_offsets(
            key, local, (axis, tp_rank, tp), replica_id=dp_rank
        )
    return state


def check_tp(loaded: dict, rank: int, tp: int) -> int:
    for key, (shape, axis) in TP_KEYS.items():
        expected = reference(key, shape).chunk(tp, dim=axis)[rank % tp]
        assert torch.equal(loaded[key], expected), (key, rank, tp)
    return len(TP_KEYS)


BACKENDS = ["zarr", "torch_dist"]


def _reshard_scenario(rank: int, world: int, uri: str, backend: str = "zarr") -> int:
    state = tp_state(rank, tp=2)
    state["layernorm"] = ShardedTensor.from_rank_offsets(
        "layernorm", reference("layernorm", (8,)), replica_id=rank
    )
    state["iteration"] = 7
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    checked = 0
    for tp in (4, 1):
        loaded = cloudckpt.load(tp_state(rank, tp, empty=True), uri)
        assert loaded["iteration"] == 7
        checked += check_tp(loaded, rank, tp)
    # 2-D tiling: w_col (8, 6) as a 2 x 2 grid of (4, 3) tiles
    row, col = divmod(rank, 2)
    tile = ShardedTensor.from_rank_offsets("w_col", torch.empty(4, 3), (0, row, 2), (1, col, 2))
    loaded = cloudckpt.load({"tile": tile}, uri)
    assert torch.equal(
        loaded["tile"], reference("w_col", (8, 6))[row * 4 : row * 4 + 4, col * 3 : col * 3 + 3]
    )
    return checked + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_tp2_dp2_load_tp4_tp1_and_2d_tiles(rank_pool, tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    assert rank_pool.run(_reshard_scenario, uri, backend) == [7, 7, 7, 7]
    if backend == "torch_dist":
        assert {".metadata", "common.pt", "manifest.json"} <= set(os.listdir(uri))
        return
    assert sorted(os.listdir(uri)) == [
        ".cloudckpt-claim.json",
        "bias",
        "common.pt",
        "layernorm",
        "manifest.json",
        "metadata.json",
        "w_col",
        "w_row",
    ]
    assert sorted(os.listdir(os.path.join(uri, "w_row"))) == [".zarray", "0.0", "0.1"]


def _flat(key: str, full: torch.Tensor, tp_rank: int, tp: int, bounds: list[int], dp_rank: int):
    """Distributed-optimizer style: DP rank ``dp_rank`` owns a flat range of the TP shard."""
    local = full.chunk(tp, dim=0)[tp_rank]
    rng = slice(bounds[dp_rank], bounds[dp_rank + 1])
    data = local.reshape(-1)[rng].clone()
    return ShardedTensor.from_rank_offsets_flat(
        key, data, tuple(local.shape), (0, tp_rank, tp), flattened_range=rng
    )


def _flat_scenario(rank: int, world: int, uri: str, backend: str = "zarr") -> int:
    full = reference("exp_avg", (12, 5))
    vec = reference("uneven", (10,))
    save_bounds = [0, 1, 5, 7, 10]  # uneven 1-D pieces over 4 ranks
    state = {
        "exp_avg": _flat("exp_avg", full, rank % 2, 2, [0, 13, 30], rank // 2),
        "uneven": ShardedTensor.from_rank_offsets_flat(
            "uneven",
            vec[save_bounds[rank] : save_bounds[rank + 1]].clone(),
            (10,),
            flattened_range=slice(save_bounds[rank], save_bounds[rank + 1]),
        ),
    }
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    load_bounds = [0, 3, 6, 9, 10]
    request = {
        "exp_avg": _flat("exp_avg", torch.zeros(12, 5), 0, 1, [0, 7, 30, 41, 60], rank),
        "uneven": ShardedTensor.from_rank_offsets_flat(
            "uneven",
            torch.empty(load_bounds[rank + 1] - load_bounds[rank]),
            (10,),
            flattened_range=slice(load_bounds[rank], load_bounds[rank + 1]),
        ),
    }
    loaded = cloudckpt.load(request, uri)
    assert torch.equal(
        loaded["exp_avg"], full.reshape(-1)[[0, 7, 30, 41, 60][rank] : [0, 7, 30, 41, 60][rank + 1]]
    )
    assert torch.equal(loaded["uneven"], vec[load_bounds[rank] : load_bounds[rank + 1]])
    plain = cloudckpt.load_plain_tensors(uri)
    # torch_dist records an N-D flattened save, and load_plain_tensors gives it whole but
    # flat, as Megatron-Core's; zarr stores the array in its shape
    whole = full.reshape(-1) if backend == "torch_dist" else full
    assert torch.equal(plain["exp_avg"], whole) and torch.equal(plain["uneven"], vec)
    return 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_flattened_ranges_saved_by_one_layout_loaded_by_another(rank_pool, tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    assert rank_pool.run(_flat_scenario, uri, backend) == [4] * 4
    if backend == "torch_dist":
        return
    assert sorted(os.listdir(os.path.join(uri, "exp_avg"))) == [".zarray", "0.0", "1.0"]
    assert sorted(os.listdir(os.path.join(uri, "uneven"))) == [".zarray", "0"]


def _split_fn(key, data, replica_id, flattened_range):
    half = data.shape[0] // 2
    return {
        "up": ShardedTensor.from_rank_offsets(
            f"{key}.up", data[:half].clone(), replica_id=replica_id
        ),
        "down": ShardedTensor.from_rank_offsets(
            f"{key}.down", data[half:].clone(), replica_id=replica_id
        ),
    }


def _merge_fn(sub_state):
    return torch.cat([sub_state["up"], sub_state["down"]])


def _objects_factories_scenario(rank: int, world: int, uri: str, backend: str = "zarr") -> int:
    fused = reference("fused", (6, 4))
    state = {
        "rng": ShardedObject("rng_state", {"rank": rank, "seed": 100 + rank}, (world,), (rank,)),
        "fused": ShardedTensorFactory(
            "fused", fused.clone(), _split_fn, _merge_fn, replica_id=rank
        ),
        "local_cache": LocalNonpersistentObject(f"not saved {rank}"),
        "step": 3,
    }
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1))
    peer = (rank + 1) % world
    request = {
        "rng": ShardedObject("rng_state", None, (world,), (peer,), replica_id=1),
        "fused": ShardedTensorFactory(
            "fused", torch.empty(6, 4), _split_fn, _merge_fn, replica_id=rank
        ),
        "local_cache": LocalNonpersistentObject(f"local {rank}"),
    }
    loaded = cloudckpt.load(request, uri, validate_access_integrity=False)
    assert loaded["rng"] == {"rank": peer, "seed": 100 + peer}
    assert torch.equal(loaded["fused"], fused)
    assert loaded["local_cache"] == f"local {rank}" and loaded["step"] == 3
    return 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_objects_factories_and_nonpersistent(rank_pool, tmp_path, backend):
    uri = str(tmp_path / "ckpt")
    assert rank_pool.run(_objects_factories_scenario, uri, backend) == [3] * 4
    if backend == "torch_dist":  # the objects are DCP items, not files
        assert "rng_state" not in os.listdir(uri)
        return
    assert sorted(os.listdir(os.path.join(uri, "rng_state"))) == [
        f"shard_{r}_4.pt" for r in range(4)
    ]
    assert {"fused.up", "fused.down"} <= set(os.listdir(uri))
    assert "local_cache" not in torch.load(os.path.join(uri, "common.pt"))


def _overlap_scenario(rank: int, world: int, uri: str) -> str:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4), replica_id=0)}
    try:
        cloudckpt.save(state, uri)
    except ShardingValidationError as exc:
        return str(exc)
    return "saved"


def test_overlapping_main_replicas_rejected_on_every_rank(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    messages = rank_pool.run(_overlap_scenario, uri)
    for message in messages:
        assert "'w'" in message and "4 main replicas" in message and "ranks 0, 1, 2, 3" in message
    assert not os.path.exists(os.path.join(uri, "metadata.json"))


def _rank_failure_scenario(rank: int, world: int, uri: str) -> str:
    state = tp_state(rank, tp=2)
    if rank == 2:  # a dtype the zarr backend cannot store, on one rank only
        state["bad"] = ShardedTensor.from_rank_offsets("bad", torch.zeros(2, dtype=torch.complex64))
    try:
        cloudckpt.save(state, uri, sharded_strategy=("zarr", 1))
    except DistributedCheckpointError as exc:
        assert sorted(exc.failures) == [2]
        return str(exc)
    return "saved"


def test_failure_on_one_rank_surfaces_on_all_and_nothing_is_committed(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    for message in rank_pool.run(_rank_failure_scenario, uri):
        assert "rank 2" in message and "'bad'" in message and "complex64" in message
    assert not os.path.exists(os.path.join(uri, "metadata.json"))
    # the manifest's tensor entries are made while preparing (the dtype fails there),
    # so the failure is agreed on before the claim: nothing at all is written
    assert not os.path.exists(os.path.join(uri, CLAIM_FNAME))
    with pytest.raises(cloudckpt.CheckpointNotFoundError, match="does not exist"):
        cloudckpt.load(tp_state(0, tp=2, empty=True), uri, validate_access_integrity=False)


def _global_unexpected_scenario(rank: int, world: int, uri: str) -> tuple:
    state = {
        f"k{r}": ShardedTensor.from_rank_offsets(f"k{r}", reference(f"k{r}", (3,)), replica_id=rank)
        for r in range(world)
    }
    cloudckpt.save(state, uri)
    # each rank requests only its own key: together they request every key
    request = {f"k{rank}": ShardedTensor.from_rank_offsets(f"k{rank}", torch.empty(3))}
    loaded, missing, unexpected = cloudckpt.load(
        request, uri, validate_access_integrity=False, strict=StrictHandling.RETURN_ALL
    )
    assert torch.equal(loaded[f"k{rank}"], reference(f"k{rank}", (3,)))
    return sorted(missing), sorted(unexpected)


def test_missing_keys_are_judged_across_all_ranks(rank_pool, tmp_path):
    assert rank_pool.run(_global_unexpected_scenario, str(tmp_path / "ckpt")) == [([], [])] * 4


def _outcome(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        result = fn()
    except (cloudckpt.CheckpointingException, KeyError) as exc:
        return type(exc).__name__
    if isinstance(result, tuple):
        state, missing, unexpected = result
        return f"keys={sorted(state)} missing={sorted(missing)} unexpected={sorted(unexpected)}"
    return f"keys={sorted(result)}"


def _strict_modes_scenario(rank: int, world: int, uri: str) -> dict:
    """Saved (torch_dist, the default): k0..k3 and 'spare'. Rank r requests k<r> plus
    'absent<r>' (unexpected: not stored); nobody requests 'spare' (missing)."""
    keys = [f"k{r}" for r in range(world)] + ["spare"]
    state = {
        k: ShardedTensor.from_rank_offsets(k, reference(k, (2,)), replica_id=rank) for k in keys
    }
    cloudckpt.save(state, uri)

    def request(with_absent: bool) -> dict:
        wanted = [f"k{rank}"] + ([f"absent{rank}"] if with_absent else [])
        return {k: ShardedTensor.from_rank_offsets(k, torch.empty(2)) for k in wanted}

    outcomes = {}
    for mode in StrictHandling:
        for with_absent in (False, True):
            outcomes[(mode.value, with_absent)] = _outcome(
                lambda m=mode, w=with_absent: cloudckpt.load(
                    request(w), uri, validate_access_integrity=False, strict=m
                )
            )
    return outcomes


def test_every_strict_mode_across_ranks(rank_pool, tmp_path):
    """Megatron-Core's semantics: missing = stored, requested by no rank ('spare', only
    the *_ALL modes look); unexpected = requested here, not stored (dropped, then per
    mode raised, logged or returned)."""
    results = rank_pool.run(_strict_modes_scenario, str(tmp_path / "ckpt"))
    for rank, outcomes in enumerate(results):
        own, gone = f"k{rank}", f"absent{rank}"
        ok = f"keys=['{own}']"
        expected = {
            ("assume_ok_unexpected", False): ok,
            ("assume_ok_unexpected", True): "TorchDistKeyNotFoundError",
            ("log_unexpected", False): ok,
            ("log_unexpected", True): ok,
            ("log_all", False): ok,
            ("log_all", True): ok,
            ("raise_unexpected", False): ok,
            ("raise_unexpected", True): "UnexpectedKeysError",
            ("raise_all", False): "MissingKeysError",
            ("raise_all", True): "UnexpectedKeysError",
            ("return_unexpected", False): f"{ok} missing=[] unexpected=[]",
            ("return_unexpected", True): f"{ok} missing=[] unexpected=['{gone}']",
            ("return_all", False): f"{ok} missing=['spare'] unexpected=[]",
            ("return_all", True): f"{ok} missing=['spare'] unexpected=['{gone}']",
            ("ignore_all", False): ok,
            ("ignore_all", True): ok,
        }
        assert outcomes == expected, rank
