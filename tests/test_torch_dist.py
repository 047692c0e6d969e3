"""The torch_dist backend (PyTorch DCP format) over every kind of location and on 4 ranks."""

from __future__ import annotations

import io
import json
import os
import warnings
import zipfile
import zlib
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed.checkpoint as dcp

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.checker import verify
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    StorageError,
    UnexpectedKeysError,
)
from cloudckpt.formats.dcp.objects import ITEM_OVERHEAD
from cloudckpt.formats.dcp.save import _PackedObjectsSavePlanner, dcp_save
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.formats.dcp.storage_reader import CloudStorageReader
from cloudckpt.manifest import Manifest
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.base import get_default_strategy
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

StoreLocation = tuple[str, dict[str, Any]]
TORCH_DIST = ("torch_dist", 1)


def reference(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.fixture
def location(checkpoint_uri: StoreLocation) -> StoreLocation:
    uri, options = checkpoint_uri
    return uri, {k: v for k, v in options.items() if k != "skip_instance_cache"}


def _fresh(location: StoreLocation) -> CheckpointStorage:
    uri, options = location
    return CheckpointStorage(uri, storage_options={**options, "skip_instance_cache": True})


def _state() -> dict:
    w = reference("w", (8, 6))
    return {
        "w": ShardedTensor.from_rank_offsets("w", w.clone()),
        "emb": ShardedTensor.from_rank_offsets("emb", reference("emb", (4, 4), torch.bfloat16)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5)),
        "rng": ShardedObject("rng_state", {"seed": 11}, (1,), (0,)),
        "args": {"lr": 0.1},
        "iteration": 42,
    }


def test_save_load_reshard_metadata_and_verify(location):
    uri, options = location
    cloudckpt.save(_state(), uri, sharded_strategy=TORCH_DIST, storage_options=options)
    storage = _fresh(location)
    assert json.loads(storage.read("metadata.json")) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    listing = storage.list()
    manifest = Manifest.from_json(storage.read("manifest.json"))
    in_manifest = {o.path for o in manifest.objects}
    assert {t.key: (t.global_shape, t.dtype) for t in manifest.tensors} == {
        "w": ((8, 6), "float32"),
        "emb": ((4, 4), "bfloat16"),
        "scalar": ((), "float32"),
    }
    distcp = {p for p in listing if p.endswith(".distcp")}
    assert distcp and distcp | {".metadata", "common.pt"} <= in_manifest
    assert not any(p.startswith("rng_state") for p in listing)  # the object lives in DCP
    request = {
        "top": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6), (0, 0, 2)),
        "right": ShardedTensor.from_rank_offsets("w", torch.empty(8, 3), (1, 1, 2)),
        "emb": ShardedTensor.from_rank_offsets("emb", torch.empty(4, 4, dtype=torch.bfloat16)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.empty(())),
        "rng": ShardedObject("rng_state", None, (1,), (0,)),
    }
    out = cloudckpt.load(request, uri, validate_access_integrity=False, storage_options=options)
    w = reference("w", (8, 6))
    assert torch.equal(out["top"], w[:4]) and torch.equal(out["right"], w[:, 3:])
    assert torch.equal(out["emb"], reference("emb", (4, 4), torch.bfloat16))
    assert out["scalar"].item() == 3.5
    assert out["rng"] == {"seed": 11} and out["iteration"] == 42 and out["args"] == {"lr": 0.1}
    meta = cloudckpt.load_tensors_metadata(uri, storage_options=options)
    assert {k: (v.global_shape, v.dtype) for k, v in meta.items()} == {
        "w": ((8, 6), torch.float32),
        "emb": ((4, 4), torch.bfloat16),
        "scalar": ((), torch.float32),
    }
    sharded = cloudckpt.load_sharded_metadata(uri, storage_options=options)
    assert sorted(sharded) == ["emb", "rng_state/shard_0_1", "scalar", "w"]
    assert verify(uri, deep=True, storage_options=options).ok


def test_strict_raise_all_and_missing_keys(location):
    uri, options = location
    cloudckpt.save(_state(), uri, sharded_strategy=TORCH_DIST, storage_options=options)
    exact = {k: v for k, v in _state().items() if k not in ("args", "iteration")}
    out = cloudckpt.load(exact, uri, strict="raise_all", storage_options=options)
    assert torch.equal(out["w"], reference("w", (8, 6)))
    extra = {"nope": ShardedTensor.from_rank_offsets("nope", torch.empty(2)), **exact}
    with pytest.raises(UnexpectedKeysError, match="nope"):  # requested, not stored
        cloudckpt.load(extra, uri, strict="raise_all", storage_options=options)
    with pytest.raises(CheckpointKeyNotFoundError, match="'nope'"):
        cloudckpt.load(extra, uri, storage_options=options)


def test_stock_dcp_load_reads_a_local_checkpoint(tmp_path):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(), uri, sharded_strategy=TORCH_DIST)
    target = {
        "w": torch.zeros(8, 6),
        "emb": torch.zeros(4, 4, dtype=torch.bfloat16),
        "rng_state/shard_0_1": io.BytesIO(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=uri)
    assert torch.equal(target["w"], reference("w", (8, 6)))
    assert torch.equal(target["emb"], reference("emb", (4, 4), torch.bfloat16))
    # Megatron-Core's layout: the item is the bytes of torch.save([data]), which DCP's
    # default planner unpickles into the one-element list
    assert target["rng_state/shard_0_1"] == [{"seed": 11}]


def test_dcp_reader_over_cloud_storage(location):
    uri, options = location
    cloudckpt.save(_state(), uri, sharded_strategy=TORCH_DIST, storage_options=options)
    target = {"w": torch.zeros(8, 6)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=CloudStorageReader(_fresh(location)))
    assert torch.equal(target["w"], reference("w", (8, 6)))


def test_common_state_as_a_dcp_item_megatron_019(location):
    """Megatron-Core 0.19's layout: the common state is the DCP bytes item
    ``common_state/shard_0_1`` holding ``torch.save([common])``, and metadata.json has
    only the two sharded-backend keys."""
    uri, options = location
    storage = _fresh(location)
    common_bytes = io.BytesIO()
    torch.save([{"iteration": 9, "args": {"lr": 0.5}}], common_bytes)
    state = {"w": torch.arange(4.0), "common_state/shard_0_1": common_bytes}
    dcp_save(state, CloudStorageWriter(storage))
    storage.write(
        "metadata.json",
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}).encode(),
    )
    assert not storage.exists("common.pt")
    common = cloudckpt.load_common_state_dict(uri, storage_options=options)
    assert common == {"iteration": 9, "args": {"lr": 0.5}}
    out = cloudckpt.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))},
        uri,
        storage_options=options,
        strict="raise_all",
    )
    assert torch.equal(out["w"], torch.arange(4.0)) and out["iteration"] == 9
    metadata = cloudckpt.load_sharded_metadata(uri, storage_options=options)
    assert not any(key.startswith("common_state") for key in metadata)


def test_small_objects_pack_and_large_items_split(tmp_path):
    uri = str(tmp_path / "ckpt")
    state = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((64,), float(i)))
        for i in range(6)
    }
    buffer = io.BytesIO()
    torch.save(torch.full((64,), 0.0), buffer)
    estimate = 64 * 4 + ITEM_OVERHEAD  # what the writer assumes before serialising an item
    strategy = TorchDistSaveShardedStrategy(object_size=buffer.tell() + estimate)  # 2 per object
    cloudckpt.save(state, uri, sharded_strategy=strategy)
    files = sorted(f for f in os.listdir(uri) if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    out = cloudckpt.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty(64)) for k in state}, uri
    )
    assert all(torch.equal(out[f"t{i}"], torch.full((64,), float(i))) for i in range(6))
    assert verify(uri, deep=True).ok


def test_registry_and_compatibility():
    assert isinstance(
        get_default_strategy("save_sharded", "torch_dist", 1), TorchDistSaveShardedStrategy
    )
    loader = get_default_strategy("load_sharded", "torch_dist", 1)
    assert isinstance(loader, TorchDistLoadShardedStrategy) and loader.can_handle_sharded_objects
    with pytest.raises(cloudckpt.CheckpointingException, match="'torch_dist'"):
        loader.check_backend_compatibility("zarr")


# -- 4 ranks: TP=2 x DP=2 with distributed-optimizer (flattened) state ---------------

TP_KEYS = {"w_col": ((8, 6), 0), "w_row": ((6, 8), 1)}


def _tp_state(rank: int, tp: int, empty: bool = False) -> dict:
    tp_rank, dp_rank = rank % tp, rank // tp
    state = {}
    for key, (shape, axis) in TP_KEYS.items():
        local = reference(key, shape).chunk(tp, dim=axis)[tp_rank].clone()
        state[key] = ShardedTensor.from_rank_offsets(
            key,
            torch.empty_like(local) if empty else local,
            (axis, tp_rank, tp),
            replica_id=dp_rank,
        )
    return state


def _flat(key: str, full: torch.Tensor, tp_rank: int, tp: int, bounds: list[int], dp_rank: int):
    local = full.chunk(tp, dim=0)[tp_rank]
    rng = slice(bounds[dp_rank], bounds[dp_rank + 1])
    return ShardedTensor.from_rank_offsets_flat(
        key,
        local.reshape(-1)[rng].clone(),
        tuple(local.shape),
        (0, tp_rank, tp),
        flattened_range=rng,
    )


# (tp, flat bounds of a TP chunk over the rank // tp data-parallel ranks)
LOAD_LAYOUTS = [(4, [0, 15]), (1, [0, 7, 30, 41, 60]), (2, [0, 4, 30])]


def _scenario(rank: int, world: int, uri: str, options: dict[str, Any]) -> int:
    full = reference("exp_avg", (12, 5))
    state = _tp_state(rank, tp=2)
    state["exp_avg"] = _flat("exp_avg", full, rank % 2, 2, [0, 13, 30], rank // 2)
    state["rng"] = ShardedObject("rng", {"rank": rank}, (world,), (rank,))
    state["iteration"] = 5
    cloudckpt.save(state, uri, sharded_strategy=TORCH_DIST, storage_options=options)
    checked = 0
    for tp, bounds in LOAD_LAYOUTS:
        tp_rank, dp_rank = rank % tp, rank // tp
        request = _tp_state(rank, tp, empty=True)
        request["exp_avg"] = _flat("exp_avg", torch.zeros(12, 5), tp_rank, tp, bounds, dp_rank)
        loaded = cloudckpt.load(request, uri, storage_options=options)
        for key, (shape, axis) in TP_KEYS.items():
            assert torch.equal(loaded[key], reference(key, shape).chunk(tp, dim=axis)[tp_rank])
        local = full.chunk(tp, dim=0)[tp_rank].reshape(-1)
        assert torch.equal(loaded["exp_avg"], local[bounds[dp_rank] : bounds[dp_rank + 1]])
        checked += 1
    exact = _tp_state(rank, 2, empty=True)
    exact["exp_avg"] = _flat("exp_avg", torch.zeros(12, 5), rank % 2, 2, [0, 13, 30], rank // 2)
    exact["rng"] = ShardedObject("rng", None, (world,), ((rank + 1) % world,))
    loaded = cloudckpt.load(exact, uri, strict="raise_all", storage_options=options)
    assert loaded["rng"] == {"rank": (rank + 1) % world} and loaded["iteration"] == 5
    assert torch.equal(loaded["w_row"], reference("w_row", (6, 8)).chunk(2, dim=1)[rank % 2])
    return checked + 1


def _run(rank_pool, uri: str, options: dict[str, Any]) -> None:
    assert rank_pool.run(_scenario, uri, options) == [len(LOAD_LAYOUTS) + 1] * 4


def test_four_ranks_tp2_dp2_flattened_local(rank_pool, tmp_path):
    uri = str(tmp_path / "ckpt")
    _run(rank_pool, uri, {})
    assert verify(uri, deep=True).ok
    files = os.listdir(uri)
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) >= 4
    plain = cloudckpt.load_plain_tensors(uri)
    # saved N-D flattened: listed and loaded as one flat range (as Megatron-Core)
    assert torch.equal(plain["exp_avg"], reference("exp_avg", (12, 5)).flatten())
    listed = cloudckpt.load_tensors_metadata(uri)["exp_avg"]
    assert (listed.global_shape, listed.flattened_range) == ((12, 5), slice(0, 60))
    assert listed.data is None


def test_four_ranks_tp2_dp2_flattened_s3(rank_pool, s3_bucket):
    bucket_uri, options = s3_bucket
    uri = f"{bucket_uri}/run/ckpt"
    _run(rank_pool, uri, options)
    assert verify(uri, deep=True, storage_options=options).ok


def _buffered(storage: CheckpointStorage) -> CheckpointStorage:
    """``storage`` (local) writing as to an object store: objects assembled in memory
    and written whole, in batches, instead of streamed into their files."""
    storage.transport.writes_in_place = False  # type: ignore[misc]
    assert not storage.writes_in_place
    return storage


def test_writer_uploads_in_bounded_batches(tmp_path):
    storage = _buffered(CheckpointStorage(str(tmp_path / "ckpt")))
    batches: list[list[int]] = []
    upload = storage.write_many

    def spy(items, **kwargs):
        items = list(items)
        if any(path.endswith(".distcp") for path, _ in items):
            batches.append([memoryview(data).nbytes for _, data in items])
        return upload(items, **kwargs)

    storage.write_many = spy  # type: ignore[method-assign]
    writer = CloudStorageWriter(storage, object_size=1500, batch_bytes=3000)
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    dcp_save(state, writer)
    assert len(batches) >= 3  # eight ~2.2 kB objects, uploaded a few at a time
    assert all(sum(sizes) < 3000 + max(sizes) for sizes in batches)
    assert sum(len(sizes) for sizes in batches) == 8
    assert {r.path for r in writer.results} == {f"__0_{i}.distcp" for i in range(8)} | {".metadata"}
    target = {k: torch.zeros(256) for k in state}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "ckpt"))
    assert all(torch.equal(target[k], state[k]) for k in state)


def test_a_batch_failing_in_the_background_stops_the_writer(tmp_path):
    """Batches upload in the background while the next is serialized: the first
    batch's failure stops the writer at the next batch (nothing more is serialized
    than the batch in hand) and fails the save with that error."""
    storage = _buffered(CheckpointStorage(str(tmp_path / "ckpt")))
    uploaded: list[int] = []
    serialized: list[str] = []
    upload = storage.write_many

    def failing(items, **kwargs):
        items = list(items)
        if any(path.endswith(".distcp") for path, _ in items):
            uploaded.append(len(items))
            raise StorageError("the store refused the batch")
        return upload(items, **kwargs)

    storage.write_many = failing  # type: ignore[method-assign]
    writer = CloudStorageWriter(storage, object_size=1500, batch_bytes=3000)
    resolve = _PackedObjectsSavePlanner.resolve_data

    def spying(planner, item):
        serialized.append(item.index.fqn)
        return resolve(planner, item)

    state = {f"t{i}": torch.full((256,), float(i)) for i in range(8)}
    refused = pytest.raises(CheckpointingException, match="the store refused the batch")
    with patch.object(_PackedObjectsSavePlanner, "resolve_data", spying), refused:
        dcp_save(state, writer)
    assert uploaded == [1]  # the first half batch (one ~2.2 kB object) only
    assert len(serialized) <= 3, serialized  # it, the next batch, and no more


def test_remove_sharded_tensors_keeps_the_manifest_consistent(location):
    uri, options = location
    cloudckpt.save(_state(), uri, sharded_strategy=TORCH_DIST, storage_options=options)
    cloudckpt.remove_sharded_tensors(uri, "em", storage_options=options)
    assert sorted(cloudckpt.load_tensors_metadata(uri, storage_options=options)) == ["scalar", "w"]
    manifest = Manifest.from_json(_fresh(location).read("manifest.json"))
    assert sorted(t.key for t in manifest.tensors) == ["scalar", "w"]
    assert verify(uri, deep=True, storage_options=options).ok
    out = cloudckpt.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, uri, storage_options=options
    )
    assert torch.equal(out["w"], reference("w", (8, 6)))


def test_items_skip_torchs_zip_crc32_and_torch_still_reads_them(tmp_path):
    """The writer serializes without torch's per-record zip CRC-32 (two thirds of the
    serialization time; PyTorch's reader never checks it, cloudckpt checks its own
    CRC-32Cs), restores torch's setting afterwards, and torch.load reads the items."""
    before = torch.serialization.get_crc32_options()
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    writer = CloudStorageWriter(storage, object_size=1 << 20)
    state = {"w": torch.arange(1000.0)}
    dcp_save(state, writer)
    assert torch.serialization.get_crc32_options() == before
    info = next(
        iter(dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().storage_data.values())
    )
    raw = (tmp_path / "ckpt" / info.relative_path).read_bytes()[
        info.offset : info.offset + info.length
    ]
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        assert {i.CRC for i in archive.infolist()} == {0}
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), state["w"])
