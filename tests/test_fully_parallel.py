"""Fully parallel save and load (cloudckpt.strategies.fully_parallel) on 4 real gloo ranks.

Every rank saves and loads through a local filesystem that counts, per object, the
bytes this process wrote and read (``_CountingFS``, passed to the wrapped strategy,
which the session then uses for every request). Layouts: 4 data-parallel replicas of
every tensor (``dp4``), and 2 tensor-parallel x 2 data-parallel ranks (``tp2dp2``).
The tests compare, with and without the wrappers, what each rank wrote and read and
the loaded tensors, bit for bit, for the zarr and torch_dist backends.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import CheckpointingException
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from cloudckpt.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy

BACKENDS = ["zarr", "torch_dist"]
# key -> (global shape, dtype); sizes differ so that balancing by bytes matters
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "embedding": ((64, 32), torch.float32),
    "w_qkv": ((32, 48), torch.bfloat16),
    "w_proj": ((32, 32), torch.float32),
    "w_fc1": ((48, 32), torch.float32),
    "w_fc2": ((32, 16), torch.float16),
    "norm": ((32,), torch.float32),
    "bias": ((16,), torch.float32),
    "step": ((4,), torch.int64),
}
NOT_DATA = {"common.pt", "metadata.json", "manifest.json", ".cloudckpt-claim.json", ".metadata"}


class _CountingFile:
    """A file object that adds the bytes written or read through it to its filesystem's
    counters (by the object's path relative to the filesystem's root)."""

    def __init__(self, inner: Any, fs: _CountingFS, path: str) -> None:
        self._inner, self._fs, self._path = inner, fs, path

    def write(self, data: Any) -> int:
        n = int(self._inner.write(data))
        self._fs.written[self._path] += n
        return n

    def read(self, *args: Any) -> bytes:
        data = bytes(self._inner.read(*args))
        self._fs.read[self._path] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = int(self._inner.readinto(buffer))
        self._fs.read[self._path] += n
        return n

    def __enter__(self) -> _CountingFile:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingFS(LocalFileSystem):
    """A local filesystem counting the bytes written and read per object (data objects
    only: zarr chunks and ``.distcp`` files, not metadata or commit records)."""

    def __init__(self, root: str) -> None:
        super().__init__(skip_instance_cache=True)
        self.root = root.rstrip("/")
        self.written: Counter[str] = Counter()
        self.read: Counter[str] = Counter()
        self.fail_reads = False  # reading a data object raises, as a lost store would

    def open(self, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        inner = super().open(path, mode, *args, **kwargs)
        relpath = posixpath.relpath(str(path), self.root)
        if posixpath.basename(relpath) in NOT_DATA or relpath.endswith(".zarray"):
            return inner
        if self.fail_reads and "r" in mode:
            inner.close()
            raise PermissionError(f"access denied reading {relpath}")
        return _CountingFile(inner, self, relpath)

    def reset(self) -> None:
        self.written.clear()
        self.read.clear()


@contextlib.contextmanager
def requested_ranges() -> Iterator[Counter[str]]:
    """Count the bytes each object is asked for through ``CheckpointStorage.read_many``
    (torch_dist's item reads), before the storage widens a range to the blocks whose
    CRC-32C checks it: an object of one block (<= 1 MiB) is fetched whole whatever range
    is asked for, so the filesystem's byte counts cannot show which items were read."""
    counts: Counter[str] = Counter()
    original, original_into = CheckpointStorage.read_many, CheckpointStorage.read_into_many

    def counting(self: CheckpointStorage, requests: Any, *args: Any, **kwargs: Any) -> Any:
        requests = list(requests)
        for req in requests:
            if posixpath.basename(req.path) not in NOT_DATA and req.end is not None:
                counts[req.path] += req.end - req.start  # DCP items: explicit ranges
        return original(self, requests, *args, **kwargs)

    def counting_into(self: CheckpointStorage, items: Any) -> Any:
        items = list(items)
        for req, buffer in items:  # an item's elements read straight into a tensor
            if posixpath.basename(req.path) not in NOT_DATA:
                counts[req.path] += memoryview(buffer).nbytes
        return original_into(self, items)

    CheckpointStorage.read_many = counting  # type: ignore[method-assign]
    CheckpointStorage.read_into_many = counting_into  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        CheckpointStorage.read_many = original  # type: ignore[method-assign]
        CheckpointStorage.read_into_many = original_into  # type: ignore[method-assign]


def reference(key: str) -> torch.Tensor:
    shape, dtype = TENSORS[key]
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if not dtype.is_floating_point:
        return torch.randint(0, 1000, shape, generator=gen).to(dtype)
    return torch.randn(shape, generator=gen).to(dtype)


def layout(rank: int, name: str) -> tuple[int, int]:
    """(tp, tp_rank) of ``rank`` in layout ``name``."""
    tp = {"dp4": 1, "tp2dp2": 2}[name]
    return tp, rank % tp


def build_state(rank: int, name: str, empty: bool = False, with_object: bool = True) -> dict:
    """Rank ``rank``'s state: tensors split along dim 0 over TP, replicated over DP;
    (``with_object``) one ShardedObject requested by every rank, saved by rank 0."""
    tp, tp_rank = layout(rank, name)
    dp_rank = rank // tp
    state: dict[str, Any] = {}
    for key in TENSORS:
        local = reference(key).chunk(tp, dim=0)[tp_rank].clone()
        if empty:
            local = torch.zeros_like(local)
        state[key] = ShardedTensor.from_rank_offsets(
            key, local, (0, tp_rank, tp), replica_id=dp_rank
        )
    if with_object:
        data = None if empty else {"seed": 7}
        state["rng"] = ShardedObject("rng", data, (1,), (0,), replica_id=rank)
    state["iteration"] = 11
    return state


def expected_tensors(rank: int, name: str) -> dict[str, torch.Tensor]:
    tp, tp_rank = layout(rank, name)
    return {key: reference(key).chunk(tp, dim=0)[tp_rank] for key in TENSORS}


def strategies(backend: str, fs: _CountingFS) -> tuple[Any, Any]:
    if backend == "zarr":
        return ZarrSaveShardedStrategy(fs=fs), ZarrLoadShardedStrategy(fs=fs)
    return TorchDistSaveShardedStrategy(fs=fs), TorchDistLoadShardedStrategy(fs=fs)


def _dp_group(rank: int, name: str) -> Any:
    """The data-parallel group of ``rank`` (every rank creates every group)."""
    tp, _ = layout(rank, name)
    groups = [torch.distributed.new_group([r for r in range(4) if r % tp == t]) for t in range(tp)]
    return groups[rank % tp]


def _check_loaded(loaded: dict, rank: int, name: str) -> None:
    for key, expected in expected_tensors(rank, name).items():
        got = loaded[key]
        assert got.dtype == expected.dtype and torch.equal(got, expected), (key, rank)
    if "rng" in loaded:
        assert loaded["rng"] == {"seed": 7}
    assert loaded["iteration"] == 11


def _scenario(rank: int, world: int, base: str, backend: str, name: str, algo: str) -> dict:
    """Save plain and fully parallel, load each both ways; what each rank wrote and read.
    (No ShardedObject: zarr reads those outside the sharded strategy, on every rank.)"""
    group = _dp_group(rank, name)
    out: dict[str, Any] = {}
    for mode in ("plain", "parallel"):
        uri = os.path.join(base, mode)
        fs = _CountingFS(uri)
        save, load = strategies(backend, fs)
        if mode == "parallel":
            save = FullyParallelSaveStrategyWrapper(save, group)
        cloudckpt.save(build_state(rank, name, with_object=False), uri, sharded_strategy=save)
        out[f"{mode}_written"] = dict(fs.written)
        for load_mode in ("plain", "parallel"):
            fs.reset()
            loader = load
            if load_mode == "parallel":
                loader = FullyParallelLoadStrategyWrapper(load, group, exchange_algo=algo)
            request = build_state(rank, name, empty=True, with_object=False)
            with requested_ranges() as requested:
                loaded = cloudckpt.load(request, uri, loader, strict="raise_all")
            _check_loaded(loaded, rank, name)
            read = fs.read if backend == "zarr" else requested  # see requested_ranges
            out[f"{mode}_{load_mode}_read"] = dict(read)
    return out


def _data_objects(uri: str) -> dict[str, int]:
    """Every data object in the checkpoint and its size."""
    found = {}
    for root, _, files in os.walk(uri):
        for fname in files:
            rel = os.path.relpath(os.path.join(root, fname), uri)
            if fname not in NOT_DATA and not fname.endswith(".zarray"):
                found[rel] = os.path.getsize(os.path.join(uri, rel))
    return found


def _per_rank_bytes(results: list[dict], field: str) -> list[int]:
    return [sum(r[field].values()) for r in results]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dp4", "tp2dp2"])
def test_fully_parallel_writes_and_reads_each_byte_once(
    rank_pool: Any, tmp_path: Any, backend: str, name: str
) -> None:
    results = rank_pool.run(_scenario, str(tmp_path), backend, name, "broadcast")
    dp = 4 if name == "dp4" else 2
    for mode in ("plain", "parallel"):
        objects = _data_objects(str(tmp_path / mode))
        written = [r[f"{mode}_written"] for r in results]
        # every data object written by exactly one rank, whole, once
        paths = [p for w in written for p in w]
        assert sorted(paths) == sorted(objects), mode
        for w in written:
            for path, n in w.items():
                assert n == objects[path], (mode, path)
    total = sum(_data_objects(str(tmp_path / "plain")).values())
    plain = _per_rank_bytes(results, "plain_written")
    parallel = _per_rank_bytes(results, "parallel_written")
    assert sum(parallel) == sum(plain) == total  # the same bytes, each once
    # plain: only data-parallel rank 0 writes; fully parallel: every rank writes a share
    assert [n > 0 for n in plain] == [r < 4 // dp for r in range(4)]
    assert all(n > 0 for n in parallel)
    assert max(parallel) < max(plain)
    # loading: without the wrapper every replica reads its shards; with it, each once
    for mode in ("plain", "parallel"):
        plain_read = _per_rank_bytes(results, f"{mode}_plain_read")
        parallel_read = _per_rank_bytes(results, f"{mode}_parallel_read")
        assert sum(plain_read) == dp * sum(parallel_read), (mode, plain_read, parallel_read)
        assert all(n > 0 for n in parallel_read), (mode, parallel_read)
        per_object: Counter[str] = Counter()
        for r in results:
            per_object.update(r[f"{mode}_parallel_read"])
        # what one data-parallel replica reads without the wrapper (every object:
        # zarr's whole, torch_dist's items' elements), read once across all ranks
        replica: Counter[str] = Counter()
        for r in results[: 4 // dp]:
            replica.update(r[f"{mode}_plain_read"])
        assert dict(per_object) == dict(replica), mode
        assert set(per_object) == set(_data_objects(str(tmp_path / mode))), mode
        if backend == "zarr":  # chunks are read whole
            assert dict(per_object) == _data_objects(str(tmp_path / mode)), mode


def _algo_scenario(rank: int, world: int, uri: str, algo: str) -> int:
    fs = _CountingFS(uri)
    save, load = strategies("torch_dist", fs)
    cloudckpt.save(
        build_state(rank, "dp4"), uri, sharded_strategy=FullyParallelSaveStrategyWrapper(save)
    )
    loader = FullyParallelLoadStrategyWrapper(load, exchange_algo=algo)
    with requested_ranges() as requested:  # torch_dist: see requested_ranges
        loaded = cloudckpt.load(build_state(rank, "dp4", empty=True), uri, loader)
    _check_loaded(loaded, rank, "dp4")
    with requested_ranges() as alone:  # what one rank reads without the wrapper
        cloudckpt.load(build_state(rank, "dp4", empty=True), uri, load)
    return sum(requested.values()), sum(alone.values())


def _small_buckets_scenario(rank: int, world: int, base: str) -> list[int]:
    """The broadcast exchange with buckets of at most 256 bytes (several shards per
    broadcast, and shards larger than a bucket alone); _scenario checks every tensor."""
    from cloudckpt import exchange_utils  # noqa: PLC0415

    exchange_utils.BROADCAST_BUCKET_BYTES = 256
    try:
        group = _dp_group(rank, "dp4")
        state = build_state(rank, "dp4", with_object=False)
        sizes = [
            len(bucket)
            for _, bucket in exchange_utils._broadcast_buckets(
                exchange_utils.determine_main_replica_uniform_distribution(state, group, True)
            )
        ]
        _scenario(rank, world, base, "torch_dist", "dp4", "broadcast")
    finally:
        exchange_utils.BROADCAST_BUCKET_BYTES = 64 * 2**20
    return sizes


def test_broadcast_exchange_in_buckets_of_several_shards(rank_pool: Any, tmp_path: Any) -> None:
    sizes = rank_pool.run(_small_buckets_scenario, str(tmp_path))
    assert all(s == sizes[0] for s in sizes)  # the same buckets on every rank
    assert max(sizes[0]) > 1 and min(sizes[0]) == 1
    assert sum(sizes[0]) == len(TENSORS)  # every tensor replicated on the 4 ranks


@pytest.mark.parametrize("algo", ["gather_object", "gather_rounds"])
def test_other_exchange_algorithms(rank_pool: Any, tmp_path: Any, algo: str) -> None:
    read = rank_pool.run(_algo_scenario, str(tmp_path / "ckpt"), algo)
    # the four data-parallel replicas together read what one reads alone: each byte once
    assert sum(parallel for parallel, _ in read) == read[0][1] > 0, read


def _cache_scenario(rank: int, world: int, base: str) -> dict:
    fs = _CountingFS(base)
    save, _ = strategies("zarr", fs)
    wrapper = FullyParallelSaveStrategyWrapper(save, do_cache_distribution=True)
    out: dict[str, Any] = {}
    for name in ("a", "b"):
        state = build_state(rank, "dp4", with_object=False)
        cloudckpt.save(state, os.path.join(base, name), sharded_strategy=wrapper)
        out[name] = sorted(p.removeprefix(f"{name}/") for p in fs.written)
        out[f"distribution_{name}"] = id(wrapper.cached_distribution)
        fs.reset()
    first = wrapper.cached_distribution
    # a structure change on one rank only (it holds one more tensor): recomputed everywhere
    state = build_state(rank, "dp4", with_object=False)
    if rank == 2:
        state["extra"] = ShardedTensor.from_rank_offsets("extra", torch.arange(8.0), replica_id=0)
    cloudckpt.save(state, os.path.join(base, "c"), sharded_strategy=wrapper)
    out["recomputed"] = wrapper.cached_distribution is not first
    out["c"] = sorted(p.removeprefix("c/") for p in fs.written)
    return out


def test_cached_distribution_is_reused_until_the_structure_changes(
    rank_pool: Any, tmp_path: Any
) -> None:
    results = rank_pool.run(_cache_scenario, str(tmp_path))
    for r in results:
        assert r["distribution_a"] == r["distribution_b"] and r["recomputed"]
        assert r["a"] and r["a"] == r["b"]  # the same rank wrote the same objects
    written_c = [p for r in results for p in r["c"]]
    assert sorted(written_c) == sorted(_data_objects(str(tmp_path / "c")))
    assert "extra/0" in written_c
    loaded = cloudckpt.load_plain_tensors(str(tmp_path / "c"))
    assert torch.equal(loaded["extra"], torch.arange(8.0))


def test_single_process_wrappers_call_the_wrapped_strategy(tmp_path: Any) -> None:
    """Without a process group (a world of one) the wrappers only delegate."""
    uri = str(tmp_path / "ckpt")
    fs = _CountingFS(uri)
    save, load = strategies("torch_dist", fs)
    cloudckpt.save(
        build_state(0, "dp4"), uri, sharded_strategy=FullyParallelSaveStrategyWrapper(save)
    )
    assert sum(fs.written.values()) == sum(_data_objects(uri).values()) > 0
    loaded = cloudckpt.load(
        build_state(0, "dp4", empty=True), uri, FullyParallelLoadStrategyWrapper(load)
    )
    _check_loaded(loaded, 0, "dp4")
    with pytest.raises(ValueError, match="exchange_algo"):
        FullyParallelLoadStrategyWrapper(load, exchange_algo="carrier_pigeon")


def _failing_read_scenario(rank: int, world: int, uri: str) -> str:
    fs = _CountingFS(uri)
    save, load = strategies("torch_dist", fs)
    state = build_state(rank, "dp4", with_object=False)
    cloudckpt.save(state, uri, sharded_strategy=FullyParallelSaveStrategyWrapper(save))
    fs.fail_reads = rank == 2
    request = build_state(rank, "dp4", empty=True, with_object=False)
    with pytest.raises(CheckpointingException) as caught:
        cloudckpt.load(request, uri, FullyParallelLoadStrategyWrapper(load))
    return str(caught.value)


def test_a_read_failing_on_one_rank_fails_the_load_on_every_rank(
    rank_pool: Any, tmp_path: Any
) -> None:
    """Rank 2 cannot read its share: every rank raises (none waits in the exchange)."""
    messages = rank_pool.run(_failing_read_scenario, str(tmp_path / "ckpt"))
    for message in messages:
        assert "rank 2" in message and "access denied" in message, message
