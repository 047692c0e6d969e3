"""Megatron-Core 0.19's parameters on cloudckpt's API: what 0.19's training loop passes
(``async_strategy``, ``verify_integrity``, ``process_group``, ``cpu_shm_mode``,
``cache_metadata``, ``stream_ckpt_dequant``) binds, and does what docs/megatron-compat.md
says; the parameter names are checked against 0.19.2's sources (``-m compat``)."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist

import cloudckpt
from cloudckpt import ShardedTensor, checker, serialization, tracker
from cloudckpt.checker import MEGATRON_INTEGRITY_FNAME
from cloudckpt.errors import (
    IntegrityCheckError,
    ShardingValidationError,
    UnknownAsyncStrategyError,
)
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME
from cloudckpt.storage import open_checkpoint
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from cloudckpt.validation import determine_global_metadata


def _state(value: float = 1.0) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), value)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(5, dtype=torch.float32)),
        "iteration": 3,
    }


def _target() -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3)),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5)),
    }


# -- async_strategy ---------------------------------------------------------------------


@pytest.mark.parametrize("async_strategy", ["nvrx", "mcore", None])
def test_save_accepts_megatron_019_async_strategies(tmp_path: Path, async_strategy: Any) -> None:
    """Either value (0.19's default is "nvrx", which needs NVRx installed there) runs
    cloudckpt's own async save; the checkpoint is committed after the request runs."""
    uri = str(tmp_path / "ckpt")
    request = cloudckpt.save(
        _state(2.0), uri, async_sharded_save=True, async_strategy=async_strategy
    )
    assert request is not None
    request.execute_sync()
    loaded = cloudckpt.load(_target(), uri)
    assert torch.equal(loaded["w"], torch.full((4, 3), 2.0)) and loaded["iteration"] == 3


def test_an_unknown_async_strategy_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    uri = tmp_path / "ckpt"
    with pytest.raises(UnknownAsyncStrategyError, match=r"'threads'.*nvrx, mcore") as err:
        cloudckpt.save(_state(), str(uri), async_sharded_save=True, async_strategy="threads")
    assert isinstance(err.value, TypeError)  # as Megatron-Core's get_async_strategy raises
    assert not uri.exists() or not any(uri.iterdir())


def test_strategies_take_async_strategy_as_megatron_019_passes_it(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    save_strategy = TorchDistSaveShardedStrategy(cpu_shm_mode=True)
    assert save_strategy.cpu_shm_mode is True  # recorded: cloudckpt's uploads are threads
    cloudckpt.save(_state(5.0), uri, save_strategy)
    load_strategy = TorchDistLoadShardedStrategy()
    loaded = load_strategy.load(_target(), uri, "mcore")
    assert torch.equal(loaded["w"], torch.full((4, 3), 5.0))
    with pytest.raises(UnknownAsyncStrategyError):
        load_strategy.load(_target(), uri, "posix")
    with pytest.raises(UnknownAsyncStrategyError):
        save_strategy.async_save(_state(), str(tmp_path / "other"), "posix")


def test_fully_parallel_load_wrapper_forwards_stream_ckpt_dequant() -> None:
    assert FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()).stream_ckpt_dequant
    off = TorchDistLoadShardedStrategy(stream_ckpt_dequant=False)
    assert FullyParallelLoadStrategyWrapper(off).stream_ckpt_dequant is False


# -- verify_integrity -------------------------------------------------------------------


def _flip_a_byte(uri: str) -> str:
    """Damage the largest data object in place (same size); its path."""
    store = open_checkpoint(uri)
    sizes = store.list_sizes()
    path = max((p for p in sizes if p.endswith(".distcp")), key=lambda p: sizes[p])
    data = bytearray(store.read(path))
    data[len(data) // 2] ^= 0xFF
    store.delete(path)
    store.write(path, bytes(data))
    return path


def test_load_with_verify_integrity_checks_every_object_first(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(7.0), uri, verify_integrity=True)  # the manifest is the record
    loaded = cloudckpt.load(_target(), uri, verify_integrity=True)
    assert torch.equal(loaded["w"], torch.full((4, 3), 7.0))
    open_checkpoint(uri).write("notes.txt", b"not part of the checkpoint")
    cloudckpt.load(_target(), uri, verify_integrity=True)  # an extra object: still intact
    damaged = _flip_a_byte(uri)
    with pytest.raises(IntegrityCheckError, match="failed its integrity check") as err:
        cloudckpt.load(_target(), uri, verify_integrity=True)
    assert damaged in str(err.value) and "checksum-mismatch" in str(err.value)


def _sha256_of_files(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MEGATRON_INTEGRITY_FNAME
    }


def test_save_with_verify_integrity_writes_megatrons_integrity_json(tmp_path: Path) -> None:
    """After the commit, as Megatron-Core 0.19 does after metadata.json: every object's
    SHA-256, so that its load(verify_integrity=True) checks cloudckpt's checkpoints too;
    the checkpoint stays consistent for cloudckpt verify."""
    directory = tmp_path / "ckpt"
    cloudckpt.save(_state(3.0), str(directory), verify_integrity=True)
    record = json.loads((directory / MEGATRON_INTEGRITY_FNAME).read_text())
    assert record == {"algorithm": "sha256", "files": _sha256_of_files(directory)}
    assert {"metadata.json", "manifest.json", ".metadata", "common.pt"} <= set(record["files"])
    report = checker.verify(str(directory), deep=True)
    assert report.ok, report.problems
    assert cloudckpt.load(_target(), str(directory), verify_integrity=True)["iteration"] == 3
    plain = tmp_path / "plain"
    cloudckpt.save(_state(), str(plain))
    assert not (plain / MEGATRON_INTEGRITY_FNAME).exists()


def test_async_save_writes_integrity_json_after_its_commit(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    request = cloudckpt.save(
        _state(8.0), str(directory), async_sharded_save=True, verify_integrity=True
    )
    assert request is not None
    assert not (directory / MEGATRON_INTEGRITY_FNAME).exists()
    request.execute_sync()
    record = json.loads((directory / MEGATRON_INTEGRITY_FNAME).read_text())
    assert record["files"] == _sha256_of_files(directory)
    assert "metadata.json" in record["files"]  # written after the commit


def test_verify_integrity_refuses_a_checkpoint_without_a_manifest(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(), uri)
    store = open_checkpoint(uri)
    for name in (MANIFEST_FNAME, CLAIM_FNAME):
        store.delete(name)  # what Megatron-Core's own save leaves: no cloudckpt records
    assert torch.equal(cloudckpt.load(_target(), uri)["b"], torch.arange(5.0))
    with pytest.raises(IntegrityCheckError, match="has no cloudckpt manifest"):
        cloudckpt.load(_target(), uri, verify_integrity=True)


def _megatron_integrity_json(directory: Path) -> None:
    """What Megatron-Core 0.19's save_integrity_manifest writes: every file's SHA-256."""
    payload = {"algorithm": "sha256", "files": _sha256_of_files(directory)}
    (directory / MEGATRON_INTEGRITY_FNAME).write_text(json.dumps(payload))


def test_verify_integrity_checks_megatrons_integrity_json_without_a_manifest(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    cloudckpt.save(_state(6.0), str(directory))
    for name in (MANIFEST_FNAME, CLAIM_FNAME):
        (directory / name).unlink()  # as Megatron-Core 0.19 leaves it, with its record
    _megatron_integrity_json(directory)
    loaded = cloudckpt.load(_target(), str(directory), verify_integrity=True)
    assert torch.equal(loaded["w"], torch.full((4, 3), 6.0))
    damaged = _flip_a_byte(str(directory))
    with pytest.raises(IntegrityCheckError, match=r"against its integrity\.json") as err:
        cloudckpt.load(_target(), str(directory), verify_integrity=True)
    assert f"checksum-mismatch {damaged}: SHA-256" in str(err.value)
    (directory / damaged).unlink()
    with pytest.raises(IntegrityCheckError, match=f"missing-object {damaged}"):
        cloudckpt.load(_target(), str(directory), verify_integrity=True)
    (directory / MEGATRON_INTEGRITY_FNAME).write_text('{"algorithm": "md5", "files": {}}')
    with pytest.raises(IntegrityCheckError, match=r"bad-manifest integrity\.json"):
        cloudckpt.load(_target(), str(directory), verify_integrity=True)


def _integrity_on_ranks(rank: int, world: int, uri: str, phase: str) -> dict[str, Any]:
    """4 ranks: save with integrity.json (every rank hashes a share), or load with
    verify_integrity (every rank checks a share); what each rank saw."""
    rows = torch.full((2, 3), float(rank))
    state = {"w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)), "it": 5}
    if phase == "save":
        cloudckpt.save(state, uri, verify_integrity=True)
        return {"ok": True}
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, world))}
    try:
        loaded = cloudckpt.load(target, uri, verify_integrity=True)
    except IntegrityCheckError as exc:
        return {"error": str(exc)}
    return {"rows": loaded["w"].tolist()}


@pytest.mark.multirank
def test_integrity_is_hashed_and_checked_by_every_rank(rank_pool: Any, tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    assert rank_pool.run(_integrity_on_ranks, str(directory), "save") == [{"ok": True}] * 4
    record = json.loads((directory / MEGATRON_INTEGRITY_FNAME).read_text())
    assert record == {"algorithm": "sha256", "files": _sha256_of_files(directory)}
    assert sum(name.endswith(".distcp") for name in record["files"]) == 4  # one per rank
    loads = rank_pool.run(_integrity_on_ranks, str(directory), "load")
    assert [out["rows"] for out in loads] == [[[float(r)] * 3] * 2 for r in range(4)]
    damaged = sorted(p for p in record["files"] if p.endswith(".distcp"))
    for name in damaged:  # equal sizes: consecutive in the plan, one per rank's share
        data = bytearray((directory / name).read_bytes())
        data[-1] ^= 0xFF
        (directory / name).write_bytes(bytes(data))
    loads = rank_pool.run(_integrity_on_ranks, str(directory), "load")
    for out in loads:  # every rank raises every rank's findings
        assert all(f"checksum-mismatch {name}" in out["error"] for name in damaged), out


def test_integrity_plan_shares_objects_by_size_across_ranks() -> None:
    entries = tuple((f"o{i}", 100 - i, "x") for i in range(10))
    plan = checker.IntegrityPlan("integrity.json", (), sha_entries=entries)
    shares = [plan.share(rank, 4) for rank in range(4)]
    assert [s.objects for s in shares] == [3, 3, 2, 2]
    assert sorted(e for s in shares for e in s.sha_entries) == sorted(entries)
    assert shares[1].sha_entries == (entries[1], entries[5], entries[9])


# -- cache_metadata ---------------------------------------------------------------------


def test_cache_metadata_reuses_the_same_checkpoints_metadata_only(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(1.0), uri)
    strategy = TorchDistLoadShardedStrategy(cache_metadata=True)
    cloudckpt.load(_target(), uri, strategy)
    first = strategy.cached_global_metadata
    assert first is not None
    loaded = cloudckpt.load(_target(), uri, strategy)
    assert strategy.cached_global_metadata is first  # not read again
    assert torch.equal(loaded["w"], torch.ones(4, 3))
    tracker.remove_checkpoint(uri)
    cloudckpt.save({**_state(4.0), "c": ShardedTensor.from_rank_offsets("c", torch.ones(2))}, uri)
    loaded = cloudckpt.load(_target(), uri, strategy)  # saved again: read afresh
    assert strategy.cached_global_metadata is not first
    assert "c" in strategy.cached_global_metadata.state_dict_metadata
    assert torch.equal(loaded["w"], torch.full((4, 3), 4.0))
    again = strategy.cached_global_metadata
    cloudckpt.load(_target(), uri, strategy, weights_only=False)  # trusted: not the same
    assert strategy.cached_global_metadata is not again
    uncached = TorchDistLoadShardedStrategy()
    cloudckpt.load(_target(), uri, uncached)
    assert uncached.cached_global_metadata is None


# -- process_group ----------------------------------------------------------------------


def test_determine_global_metadata_takes_a_process_group() -> None:
    local, gathered = determine_global_metadata(_state(), process_group=None)
    assert gathered == [local] and {sh.key for sh in local} == {"w", "b"}


def _two_instances(rank: int, world: int, uri: str) -> dict[str, Any]:
    """Ranks 0-1 and 2-3 each load one whole instance of the model (both instances'
    shards are main replicas): valid per group, duplicated across the world."""
    groups = [torch_dist.new_group([0, 1]), torch_dist.new_group([2, 3])]
    group = groups[rank // 2]
    half = rank % 2

    def request() -> dict[str, Any]:
        rows = torch.zeros(2, 3)
        return {"w": ShardedTensor.from_rank_offsets("w", rows, (0, half, 2))}

    out: dict[str, Any] = {}
    loaded = cloudckpt.load(request(), uri, process_group=group)
    out["rows"] = loaded["w"].tolist()
    try:
        cloudckpt.load(request(), uri)
    except ShardingValidationError as exc:
        out["world_error"] = str(exc)
    return out


@pytest.mark.multirank
def test_load_validates_within_its_process_group(rank_pool: Any, tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    whole = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", whole)}, uri)
    outcomes = rank_pool.run(_two_instances, uri)
    for rank, out in enumerate(outcomes):
        half = rank % 2
        assert out["rows"] == whole[2 * half : 2 * half + 2].tolist(), rank
        assert "w" in out["world_error"], (rank, out)


# -- the names, against Megatron-Core 0.19.2's sources -----------------------------------

# (0.19 module, qualified name) -> cloudckpt's object: every parameter 0.19 declares must
# bind by name here (cloudckpt keeps 0.15's positional order where 0.19 changed it)
CALLS = {
    ("serialization", "save"): serialization.save,
    ("serialization", "load"): serialization.load,
    ("validation", "determine_global_metadata"): determine_global_metadata,
    ("strategies/torch", "TorchDistSaveShardedStrategy.__init__"): TorchDistSaveShardedStrategy,
    ("strategies/torch", "TorchDistSaveShardedStrategy.async_save"): (
        TorchDistSaveShardedStrategy.async_save
    ),
    ("strategies/torch", "TorchDistLoadShardedStrategy.__init__"): TorchDistLoadShardedStrategy,
    ("strategies/torch", "TorchDistLoadShardedStrategy.load"): TorchDistLoadShardedStrategy.load,
    ("strategies/fully_parallel", "FullyParallelSaveStrategyWrapper.async_save"): (
        FullyParallelSaveStrategyWrapper.async_save
    ),
    ("strategies/fully_parallel", "FullyParallelLoadStrategyWrapper.load"): (
        FullyParallelLoadStrategyWrapper.load
    ),
}


def _megatron_params(tree: ast.Module, qualname: str) -> list[str]:
    node: Any = tree
    for part in qualname.split("."):
        node = next(
            n for n in node.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part
        )
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return [n for n in names if n not in ("self", "cls")]


@pytest.fixture(scope="module")
def mcore019_package() -> Path:
    from tests.test_megatron_compat import megatron_package  # noqa: PLC0415 - builds the env

    return megatron_package("mcore-0.19") / "core" / "dist_checkpointing"


@pytest.mark.compat
@pytest.mark.parametrize("call", sorted(CALLS), ids=lambda c: c[1])
def test_megatron_019_parameters_bind_by_name(
    mcore019_package: Path, call: tuple[str, str]
) -> None:
    module, qualname = call
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse((mcore019_package / f"{module}.py").read_text())
    theirs = _megatron_params(tree, qualname)
    ours = set(inspect.signature(CALLS[call]).parameters)
    assert theirs and set(theirs) <= ours, (sorted(set(theirs) - ours), theirs)


def test_cached_metadata_is_shared_by_new_strategies_until_cleared(tmp_path: Path) -> None:
    from cloudckpt.strategies.cached_metadata_filesystem_reader import (  # noqa: PLC0415
        CachedMetadataFileSystemReader,
    )

    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(1.0), uri)
    first = TorchDistLoadShardedStrategy(cache_metadata=True)
    cloudckpt.load(_target(), uri, first)
    second = TorchDistLoadShardedStrategy(cache_metadata=True)  # as the training loop
    cloudckpt.load(_target(), uri, second)
    assert second.cached_global_metadata is first.cached_global_metadata
    reader = CachedMetadataFileSystemReader(uri)
    assert reader.read_metadata() is first.cached_global_metadata
    CachedMetadataFileSystemReader.clear_metadata_cache()
    third = TorchDistLoadShardedStrategy(cache_metadata=True)
    loaded = cloudckpt.load(_target(), uri, third)
    assert third.cached_global_metadata is not first.cached_global_metadata
    assert torch.equal(loaded["w"], torch.ones(4, 3))
    assert CachedMetadataFileSystemReader(uri, cache_metadata=False).read_metadata() is not (
        third.cached_global_metadata
    )


# -- the names megatron.training 0.19 imports ----------------------------------------------


def test_get_async_strategy_gives_cloudckpts_machinery_for_either_name() -> None:
    from cloudckpt.errors import UnknownAsyncStrategyError  # noqa: PLC0415
    from cloudckpt.strategies import async_utils, filesystem_async  # noqa: PLC0415
    from cloudckpt.strategies.torch import get_async_strategy  # noqa: PLC0415

    for name in ("nvrx", "mcore"):
        used, modules = get_async_strategy(name)
        assert used == "mcore"
        assert modules["AsyncCallsQueue"] is async_utils.AsyncCallsQueue
        assert modules["get_write_results_queue"] is filesystem_async.get_write_results_queue
        assert modules["_results_queue"] is None
        assert len(modules) == 8
    assert get_async_strategy("nvrx", "AsyncRequest") == ("mcore", async_utils.AsyncRequest)
    with pytest.raises(UnknownAsyncStrategyError):
        get_async_strategy("torch")
    with pytest.raises(KeyError, match="CheckpointMetadataCache"):
        get_async_strategy("mcore", "CheckpointMetadataCache")


def test_nvrx_helpers_report_nvrx_and_build_the_request_class_given() -> None:
    from cloudckpt.strategies import nvrx  # noqa: PLC0415
    from cloudckpt.strategies.async_utils import AsyncRequest  # noqa: PLC0415

    assert nvrx.has_nvrx_async_support() is False  # not installed here
    assert nvrx.is_nvrx_min_version() is False
    assert nvrx._release("0.6.0rc1") == (0, 6, 0) >= nvrx._release(nvrx.NVRX_MIN_VERSION)
    calls: list[Any] = []
    request = nvrx.make_nvrx_async_request(
        AsyncRequest, lambda *a, **k: calls.append((a, k)), (1, 2), [lambda: calls.append("f")]
    )
    assert isinstance(request, AsyncRequest)
    request.execute_sync()
    assert calls == [((1, 2), {}), "f"]


def test_warmup_sets_the_priorities_the_persistent_worker_thread_takes(tmp_path: Path) -> None:
    import os  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from cloudckpt.strategies import _async_calls  # noqa: PLC0415
    from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest  # noqa: PLC0415
    from cloudckpt.strategies.filesystem_async import get_write_results_queue  # noqa: PLC0415

    with pytest.raises(ValueError, match="'thread'"):
        AsyncCallsQueue.warmup_persistent_caller(0, mp_mode="thread")
    before = _async_calls._persistent_qos
    try:
        queue = AsyncCallsQueue(persistent=True)  # made before the warmup, as 0.19 does
        AsyncCallsQueue.warmup_persistent_caller(0, mp_mode="forkserver", cpu_priority=19)
        seen: list[int] = []

        def job() -> None:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

        queue.schedule_async_request(AsyncRequest(job, (), []))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        queue.close()
        assert seen == [19]  # the worker thread's nice value
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19  # not ours
    finally:
        _async_calls.set_persistent_worker_qos(before)
    assert get_write_results_queue(mp_mode="fork") is get_write_results_queue()
