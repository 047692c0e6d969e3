"""cloudckpt.dcp: PyTorch DCP's ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` with
cloudckpt's storage writer and reader, on real gloo ranks, to local disk and SeaweedFS.

The model is FSDP2's (``fully_shard`` over a CPU device mesh) with AdamW, its state as
``get_state_dict`` gives it (DTensors); every comparison is bit for bit against the full
state the saving ranks gathered just before the save.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

import cloudckpt
from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter
from cloudckpt.launch import RankPool
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME
from cloudckpt.storage import CheckpointStorage
from cloudckpt.tracker import collect_garbage, latest, list_checkpoints
from tests.fixtures_object_stores import S3_CASES, StoreLocation, bucket_location

STEPS = 3

# DCP's own note for a save or load in one process (no process group): expected here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _location(request: pytest.FixtureRequest, tmp_path: Any) -> StoreLocation:
    """A parent prefix for a run's checkpoints: ``(uri, storage_options)``."""
    if request.param == "local":
        return str(tmp_path / "run"), {}
    bucket, options = bucket_location(request, request.param)
    return f"{bucket}/run", options


@pytest.fixture(params=["local", S3_CASES[-1]])  # a local directory, SeaweedFS
def run_location(request: pytest.FixtureRequest, tmp_path: Any) -> StoreLocation:
    return _location(request, tmp_path)


@pytest.fixture(params=[S3_CASES[-1]])  # SeaweedFS: the multi-rank tests beyond the first
def s3_run(request: pytest.FixtureRequest, tmp_path: Any) -> StoreLocation:
    return _location(request, tmp_path)


# -- the model and its training ------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 12), nn.Linear(12, 6))


def _train(model: nn.Module, optim: torch.optim.Optimizer, first: int, last: int) -> None:
    """Steps ``first`` to ``last`` (inclusive), each on its own batch (the same on
    every rank and layout, so that any run of the same steps ends with the same state)."""
    for step in range(first, last + 1):
        generator = torch.Generator().manual_seed(step)
        batch = torch.randn(8, 24, generator=generator)
        model(batch).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def _fsdp(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model sharded over ``world`` ranks (FSDP2) and its AdamW; plain on one rank."""
    model = _model()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state as plain tensors by flat name (every rank)."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, state in osd["state"].items():
        for key, value in state.items():
            flat[f"optim.{name}.{key}"] = torch.as_tensor(value).detach().clone()
    return flat


def _state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": step}


def _restore(model: nn.Module, optim: torch.optim.Optimizer, uri: str, options: dict) -> int:
    """Load the checkpoint into ``model`` and ``optim``; returns its step."""
    state = _state(model, optim, -1)
    dcp.load(state, storage_reader=CloudStorageReader(uri, storage_options=options))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


# -- rank functions -----------------------------------------------------------------------


def _save_rank(rank: int, world: int, uri: str, options: dict, how: str) -> dict:
    """Train, save (``how``: sync, async, async-staged), return the full state as saved."""
    model, optim = _fsdp(world)
    _train(model, optim, 1, STEPS)
    saved = _full(model, optim)
    state = _state(model, optim, STEPS)
    writer = CloudStorageWriter(uri, storage_options=options)
    if how == "sync":
        dcp.save(state, storage_writer=writer)
    else:
        # the upload's collectives in a group of their own, the training's in the default
        group = torch.distributed.new_group(backend="gloo")
        if how == "async-staged":
            from torch.distributed.checkpoint.staging import (  # noqa: PLC0415
                DefaultStager,
                StagingOptions,
            )

            pinned = torch.cuda.is_available()  # pinned host memory needs CUDA
            stager = DefaultStager(StagingOptions(pinned, False, True, False))
            response = dcp.async_save(
                state, storage_writer=writer, async_stager=stager, process_group=group
            )
            response.staging_completion.result()
            upload = response.upload_completion
        else:
            upload = dcp.async_save(state, storage_writer=writer, process_group=group)
        # the training goes on at once: the checkpoint must hold the state as it was
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-3.0)
        _train(model, optim, STEPS + 1, STEPS + 2)
        upload.result()
        if how == "async-staged":
            stager.close()
    return {"full": saved}


def _load_rank(rank: int, world: int, uri: str, options: dict) -> dict:
    """A fresh model sharded over ``world`` ranks, loaded; its full state."""
    model, optim = _fsdp(world)
    step = _restore(model, optim, uri, options)
    return {"step": step, "full": _full(model, optim)}


def _failing_save_rank(rank: int, world: int, uri: str, options: dict, victim: int) -> dict:
    """Every rank saves; ``victim``'s state holds an object that fails to serialize."""
    model, optim = _fsdp(world)
    state: dict[str, Any] = {**_state(model, optim, 1), f"extra_{rank}": [rank]}
    if rank == victim:
        state[f"extra_{rank}"] = _Unpicklable()
    try:
        dcp.save(state, storage_writer=CloudStorageWriter(uri, storage_options=options))
    except CheckpointException as exc:
        return {"raised": True, "failed_ranks": sorted(exc.failures), "message": str(exc)}
    return {"raised": False}


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("this object cannot be saved")


class _Trainer(Stateful):
    """A torchtitan-style checkpointed part: the model and optimizer as one Stateful."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


class _Steps(Stateful):
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def _loop_rank(
    rank: int, world: int, run: str, options: dict, last: int, every: int, crash_at: int | None
) -> dict:
    """A torchtitan-style loop: resume from ``cloudckpt.latest(run)``, train to ``last``
    saving every ``every`` steps to ``{run}/step-{n}``; stop after step ``crash_at``
    (as a job that dies there: its last save is the one before)."""
    model, optim = _fsdp(world)
    steps = _Steps()
    states = {"trainer": _Trainer(model, optim), "progress": steps}
    resumed = latest(run, storage_options=options, collective=True)
    if resumed is not None:
        dcp.load(states, storage_reader=CloudStorageReader(resumed, storage_options=options))
    start = steps.step
    for step in range(start + 1, last + 1):
        _train(model, optim, step, step)
        steps.step = step
        if step % every == 0:
            writer = CloudStorageWriter(f"{run}/step-{step}", storage_options=options)
            dcp.save(states, storage_writer=writer)
        if step == crash_at:
            break
    return {"resumed_from": resumed, "start": start, "full": _full(model, optim)}


# -- tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool4() -> Iterator[RankPool]:
    with RankPool(4, timeout_s=180) as pool:
        yield pool


@pytest.fixture(scope="module")
def pools() -> Iterator[dict[int, RankPool]]:
    """The loading jobs' ranks: 2 and 1 (started once for the module)."""
    with RankPool(2, timeout_s=180) as two, RankPool(1, timeout_s=180) as one:
        yield {2: two, 1: one}


def test_fsdp2_save_at_4_ranks_loads_at_2_and_1_bit_for_bit(
    pool4: RankPool, pools: dict[int, RankPool], run_location: StoreLocation
) -> None:
    run, options = run_location
    uri = f"{run}/step-{STEPS}"
    saved = pool4.run(_save_rank, uri, options, "sync")
    reference = saved[0]["full"]
    assert all(_same(out["full"], reference) for out in saved)  # one state on every rank
    assert any(k.endswith("exp_avg_sq") for k in reference)  # AdamW's state is in it
    for world in (2, 1):
        loaded = pools[world].run(_load_rank, uri, options)
        for out in loaded:
            assert out["step"] == STEPS
            assert _same(out["full"], reference), world
    storage = CheckpointStorage(uri, storage_options=options)
    assert {MANIFEST_FNAME, "metadata.json", ".metadata", CLAIM_FNAME} <= set(storage.list_sizes())
    assert json.loads(storage.read("metadata.json"))["sharded_backend"] == "torch_dist"
    report = cloudckpt.verify(uri, deep=True, storage_options=options)
    assert report.ok, report
    assert latest(run, storage_options=options) == uri


@pytest.mark.parametrize("how", ["async", "async-staged"])
def test_async_save_holds_the_state_as_it_was_when_it_returned(
    pool4: RankPool, pools: dict[int, RankPool], s3_run: StoreLocation, how: str
) -> None:
    run, options = s3_run
    uri = f"{run}/step-{STEPS}"
    saved = pool4.run(_save_rank, uri, options, how)
    loaded = pools[2].run(_load_rank, uri, options)
    for out in loaded:
        assert _same(out["full"], saved[0]["full"])
    assert cloudckpt.verify(uri, storage_options=options).ok


def test_a_rank_failing_mid_save_fails_every_rank_and_commits_nothing(
    pool4: RankPool, run_location: StoreLocation
) -> None:
    run, options = run_location
    uri = f"{run}/step-1"
    outcomes = pool4.run(_failing_save_rank, uri, options, 2)
    for out in outcomes:
        assert out["raised"], out
        assert out["failed_ranks"] == [2], out
        assert "this object cannot be saved" in out["message"], out
    assert latest(run, storage_options=options) is None
    left = set(CheckpointStorage(uri, storage_options=options).list_sizes())
    assert CLAIM_FNAME in left and MANIFEST_FNAME not in left, left
    [info] = list_checkpoints(run, storage_options=options)
    assert not info.committed
    removed = collect_garbage(run, 1, grace_s=0, storage_options=options).actions
    assert [a.uri for a in removed] == [uri]


def test_a_torchtitan_style_loop_resumes_from_latest(
    pool4: RankPool, pools: dict[int, RankPool], s3_run: StoreLocation
) -> None:
    """Steps 1-5 saving every 2 and dying after 5; a new job resumes from step 4 and
    runs to 8: it ends with the state of a job that ran 1-8 without stopping."""
    run, options = s3_run
    first = pool4.run(_loop_rank, run, options, 8, 2, 5)
    assert [out["resumed_from"] for out in first] == [None] * 4
    second = pools[2].run(_loop_rank, run, options, 8, 2, None)  # the new job: fewer ranks
    assert [(out["resumed_from"], out["start"]) for out in second] == [(f"{run}/step-4", 4)] * 2
    straight = pool4.run(_loop_rank, f"{run}-straight", options, 8, 100, None)
    assert _same(second[0]["full"], straight[0]["full"])
    assert latest(run, storage_options=options) == f"{run}/step-8"


# -- one process: stock DCP both ways, the CLI ------------------------------------------


def _plain_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=generator),
        "b": torch.randn(70, generator=generator).to(torch.bfloat16),
        "step": 12,
        "nested": {"lr": torch.tensor(0.5), "name": "run-1"},
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "w": torch.zeros_like(state["w"]),
        "b": torch.zeros_like(state["b"]),
        "step": 0,
        "nested": {"lr": torch.tensor(0.0), "name": ""},
    }


def _assert_loaded(out: dict[str, Any], state: dict[str, Any]) -> None:
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["step"] == 12 and out["nested"]["name"] == "run-1"
    assert torch.equal(out["nested"]["lr"], state["nested"]["lr"])


def test_stock_dcp_load_reads_what_the_plugin_wrote(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    state = _plain_state(1)
    dcp.save(state, storage_writer=CloudStorageWriter(uri))
    out = _zeros(state)
    dcp.load(out, checkpoint_id=uri)  # DCP's own FileSystemReader
    _assert_loaded(out, state)


def test_stock_fsspec_reader_reads_what_the_plugin_wrote(
    run_location: StoreLocation,
) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: PLC0415

    run, options = run_location
    uri = f"{run}/ckpt"
    state = _plain_state(2)
    dcp.save(state, storage_writer=CloudStorageWriter(uri, storage_options=options))
    out = _zeros(state)
    dcp.load(out, storage_reader=FsspecReader(uri, **options))
    _assert_loaded(out, state)


def test_the_reader_reads_what_stock_dcp_wrote_and_says_it_is_unchecked(
    run_location: StoreLocation, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # noqa: PLC0415

    run, options = run_location
    uri = f"{run}/stock"
    state = _plain_state(3)
    if options:
        dcp.save(state, storage_writer=FsspecWriter(uri, **options))
    else:
        dcp.save(state, checkpoint_id=uri)
    out = _zeros(state)
    with caplog.at_level(logging.WARNING, logger="cloudckpt.dcp"):
        dcp.load(out, storage_reader=CloudStorageReader(uri, storage_options=options))
    _assert_loaded(out, state)
    assert "has no manifest" in caplog.text and "not checked" in caplog.text, caplog.text


def test_a_damaged_object_fails_the_load_naming_it(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    state = _plain_state(4)
    dcp.save(state, storage_writer=CloudStorageWriter(uri))
    [data] = [p for p in os.listdir(uri) if p.endswith(".distcp")]
    path = os.path.join(uri, data)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointException, match=data):
        dcp.load(_zeros(state), storage_reader=CloudStorageReader(uri))


def test_a_second_save_to_a_committed_uri_is_refused(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    dcp.save(_plain_state(5), storage_writer=CloudStorageWriter(uri))
    with pytest.raises(CheckpointException, match="committed checkpoint"):
        dcp.save(_plain_state(6), storage_writer=CloudStorageWriter(uri))
    out = _zeros(_plain_state(5))
    dcp.load(out, storage_reader=CloudStorageReader(uri))
    _assert_loaded(out, _plain_state(5))  # the first one, untouched


def test_the_cli_lists_inspects_and_verifies_a_plugin_checkpoint(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from cloudckpt import cli  # noqa: PLC0415

    run = tmp_path / "run"
    uri = str(run / "step-7")
    dcp.save(_plain_state(7), storage_writer=CloudStorageWriter(uri))
    capsys.readouterr()
    assert latest(str(run)) == uri
    assert cli.main(["ls", str(run)]) == 0
    listed = capsys.readouterr().out
    assert "step-7" in listed and "committed" in listed, listed
    assert cli.main(["inspect", uri]) == 0
    shown = capsys.readouterr().out
    assert "w" in shown and "300" in shown and "70" in shown, shown
    assert cli.main(["verify", "--deep", uri]) == 0
    [data] = [p for p in os.listdir(uri) if p.endswith(".distcp")]
    with open(os.path.join(uri, data), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert cli.main(["verify", "--deep", uri]) != 0
    assert cli.main(["gc", "--keep-last", "1", str(run)]) == 0  # the latest is kept
    assert latest(str(run)) == uri


class _Into:
    """The two calls of a load planner that ``read_data`` makes for tensor items."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.committed = 0

    def resolve_tensor(self, item: Any) -> torch.Tensor:
        return self.target

    def commit_tensor(self, item: Any, tensor: torch.Tensor) -> None:
        self.committed += 1


def test_a_region_of_a_chunk_reads_only_its_bytes(tmp_path: Any) -> None:
    """Rows 100-109 of a 4 MiB tensor: its blocks are read, not the item (what a rank of
    another layout asks of a chunk it shares with others)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: PLC0415
    from torch.distributed.checkpoint.planner import (  # noqa: PLC0415
        LoadItemType,
        LoadPlan,
        ReadItem,
    )

    uri = str(tmp_path / "ckpt")
    w = torch.randn(4096, 256, generator=torch.Generator().manual_seed(8))
    dcp.save({"w": w}, storage_writer=CloudStorageWriter(uri))
    reader = CloudStorageReader(uri)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    index = MetadataIndex("w", torch.Size([0, 0]))
    item = ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex("w", torch.Size([100, 0])),
        torch.Size([0, 0]),
        index,
        torch.Size([100, 0]),
        torch.Size([10, 256]),
    )
    into = _Into(torch.zeros(10, 256))
    before = reader.storage.transport.counters.snapshot()
    reader.read_data(LoadPlan([item]), into).wait()  # type: ignore[arg-type]
    read = reader.storage.transport.counters.snapshot() - before
    assert into.committed == 1 and torch.equal(into.target, w[100:110])
    assert read.bytes_read <= 2 * 1024 * 1024, read  # at most two 1 MiB blocks of 4 MiB


def test_checkpoint_id_names_the_save_and_the_writer_pickles(tmp_path: Any) -> None:
    """``dcp.save(checkpoint_id=...)`` saves there (DCP's reset); a writer that went
    through pickle (DCP's process-based async executor) opens its storage again."""
    import pickle  # noqa: PLC0415

    first, other = str(tmp_path / "first"), str(tmp_path / "other")
    writer = CloudStorageWriter(first)
    dcp.save(_plain_state(9), checkpoint_id=other, storage_writer=writer)
    assert cloudckpt.verify(other).ok and not os.path.exists(first)
    copied = pickle.loads(pickle.dumps(CloudStorageWriter(first)))
    dcp.save(_plain_state(9), storage_writer=copied)
    out = _zeros(_plain_state(9))
    dcp.load(out, storage_reader=pickle.loads(pickle.dumps(CloudStorageReader(first))))
    _assert_loaded(out, _plain_state(9))
    assert cloudckpt.verify(first).ok
