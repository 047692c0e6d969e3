"""Untrusted checkpoints: a pickle that would run code (``__reduce__`` -> ``os.system``)
is refused by default, on every path that unpickles (``common.pt``, ShardedObjects on
zarr and torch_dist, DCP ``.metadata``, ``cloudckpt inspect``), and never runs; the
allow-list, ``add_safe_globals`` and the opt-outs (argument, strategy, environment)
let trusted state through; stock DCP checkpoints still read.

Every refusal is checked against the same checkpoint loaded with the opt-out, which
does create the marker file: the payload is live, so its absence is meaningful.
"""

from __future__ import annotations

import datetime
import enum
import io
import json
import os
import pickle
import shlex
import subprocess
import sys
import threading
import types
import uuid
import warnings
from argparse import Namespace
from collections import Counter, OrderedDict
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.commit_state import amend_manifest
from cloudckpt.errors import CheckpointingException, UnsafePickleError
from cloudckpt.formats.dcp.storage import CloudStorageWriter, read_metadata
from cloudckpt.formats.dcp.storage_reader import CloudStorageReader
from cloudckpt.launch import RankPool
from cloudckpt.safe_pickle import TRUST_ENV, allowed_globals
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.common import TorchCommonLoadStrategy
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, dcp_save

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ["zarr", "torch_dist"]
FORBIDDEN = f"{os.system.__module__}.system"  # posix.system


class Evil:
    """Pickles as ``os.system("touch <marker>")``: loading it unrestricted creates the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


class Opaque:
    """A harmless class outside the allow-list (needs the opt-out)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]


class Allowed:
    """A class only this module's add_safe_globals test allows."""

    def __init__(self, value: int) -> None:
        self.value = value


@pytest.fixture(autouse=True)
def _no_trust_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRUST_ENV, raising=False)


def _weight() -> ShardedTensor:
    return ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3))


def _request() -> dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3))}


def _save(uri: str, backend: str, **values: Any) -> None:
    cloudckpt.save({"w": _weight(), **values}, uri, sharded_strategy=(backend, 1))


def _save_object(uri: str, backend: str, payload: Any) -> None:
    obj = ShardedObject("obj", payload, (1,), (0,), replica_id=0)
    cloudckpt.save({"w": _weight(), "obj": obj}, uri, sharded_strategy=(backend, 1))


def _object_request() -> dict[str, Any]:
    return {**_request(), "obj": ShardedObject("obj", None, (1,), (0,), replica_id=0)}


def _check_refusal(exc: UnsafePickleError, uri: str, what: str) -> None:
    message = str(exc)
    assert exc.forbidden == FORBIDDEN
    assert isinstance(exc, pickle.UnpicklingError) and isinstance(exc, CheckpointingException)
    assert uri in message and what in message and FORBIDDEN in message
    assert "rank 0" in message
    assert f"cloudckpt.add_safe_globals([{FORBIDDEN}])" in message
    assert "weights_only=False" in message and f"{TRUST_ENV}=1" in message


# -- common.pt ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_malicious_common_state_is_refused_by_load_and_load_common_state_dict(
    tmp_path: Path, backend: str
) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save(uri, backend, evil=Evil(marker), iteration=3)
    assert not marker.exists()  # saving pickles, it does not run the payload

    with pytest.raises(UnsafePickleError) as load_error:
        cloudckpt.load(_request(), uri)
    _check_refusal(load_error.value, f"{uri}/common.pt", "common state")
    with pytest.raises(UnsafePickleError) as common_error:
        cloudckpt.load_common_state_dict(uri)
    _check_refusal(common_error.value, f"{uri}/common.pt", "common state")
    with pytest.raises(UnsafePickleError):
        cloudckpt.load_plain_tensors(uri)
    strategy = TorchCommonLoadStrategy(weights_only=True)
    with pytest.raises(UnsafePickleError):
        cloudckpt.load(_request(), uri, common_strategy=strategy, weights_only=False)
    assert not marker.exists()

    # the payload is live: the opt-out runs it
    state = cloudckpt.load_common_state_dict(uri, weights_only=False)
    assert marker.exists() and state["iteration"] == 3 and state["evil"] == 0


def test_opt_outs_load_a_trusted_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, "zarr", custom=Opaque(7))
    with pytest.raises(UnsafePickleError, match=r"'tests\.test_untrusted\.Opaque'"):
        cloudckpt.load(_request(), uri)

    loaded = cloudckpt.load(_request(), uri, weights_only=False)
    assert loaded["custom"] == Opaque(7)
    assert torch.equal(loaded["w"], _weight().data)
    assert cloudckpt.load_common_state_dict(uri, weights_only=False)["custom"] == Opaque(7)
    trusting = TorchCommonLoadStrategy(weights_only=False)
    assert cloudckpt.load(_request(), uri, common_strategy=trusting)["custom"] == Opaque(7)

    monkeypatch.setenv(TRUST_ENV, "1")
    assert cloudckpt.load(_request(), uri)["custom"] == Opaque(7)
    assert cloudckpt.load_common_state_dict(uri)["custom"] == Opaque(7)
    with pytest.raises(UnsafePickleError):  # an explicit True wins over the environment
        cloudckpt.load_common_state_dict(uri, weights_only=True)


def test_concurrent_loads_keep_their_own_setting(tmp_path: Path) -> None:
    """``weights_only`` is per call (a context variable): a trusting load in one thread
    never widens a restricted load running at the same time in another."""
    uri = str(tmp_path / "ckpt")
    _save(uri, "zarr", custom=Opaque(3))
    rounds, barrier = 8, threading.Barrier(2)
    outcomes: dict[str, list[str]] = {"trusting": [], "default": []}

    def run(name: str, weights_only: bool | None) -> None:
        for _ in range(rounds):
            barrier.wait()
            try:
                state = cloudckpt.load_common_state_dict(uri, weights_only=weights_only)
                outcomes[name].append(f"loaded {state['custom'].value}")
            except UnsafePickleError as exc:
                outcomes[name].append(f"refused {exc.forbidden}")

    threads = [
        threading.Thread(target=run, args=("trusting", False)),
        threading.Thread(target=run, args=("default", None)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes["trusting"] == ["loaded 3"] * rounds
    assert outcomes["default"] == ["refused tests.test_untrusted.Opaque"] * rounds


def test_allow_listed_training_state_round_trips_restricted(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    rng = np.random.RandomState(5).get_state()
    common = {
        "args": Namespace(lr=0.1, save=Path("/ckpt/run"), tags=["a"], dtype=torch.bfloat16),
        "mode": Color.RED,
        "modes": [Color.BLUE, Color.RED],
        "paths": (PurePosixPath("a/b"), Path("rel")),
        "when": datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC),
        "span": datetime.timedelta(hours=2),
        "id": uuid.UUID(int=12345),
        "ordered": OrderedDict(b=1, a=2),
        "counts": Counter("aab"),
        "frozen": frozenset({1, 2}),
        "window": range(2, 9, 3),
        "cut": slice(1, 5),
        "simple": SimpleNamespace(x=1),
        "np_scalar": np.float64(1.5),
        "np_int": np.int32(-3),
        "np_dtype": np.dtype("float16"),
        "np_array": np.arange(6, dtype=np.int64).reshape(2, 3),
        "np_rng": rng,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }
    _save(uri, "zarr", **common)
    state = cloudckpt.load_common_state_dict(uri)
    for key in ("args", "mode", "modes", "paths", "when", "span", "id", "ordered", "counts"):
        assert state[key] == common[key], key
    assert state["mode"] is Color.RED and type(state["np_scalar"]) is np.float64
    for key in ("frozen", "window", "cut", "simple", "np_scalar", "np_int", "np_dtype"):
        assert state[key] == common[key], key
    assert np.array_equal(state["np_array"], common["np_array"])
    assert state["np_rng"][0] == rng[0] and np.array_equal(state["np_rng"][1], rng[1])
    assert state["device"] == common["device"] and state["size"] == common["size"]


def test_an_enum_is_allowed_only_when_its_module_is_already_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is imported to resolve a global: an enum whose module is not loaded is
    refused, the same enum loads once its module is."""
    module = types.ModuleType("cloudckpt_test_enums")
    module.Phase = enum.Enum("Phase", {"WARMUP": 1}, module=module.__name__)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    uri = str(tmp_path / "ckpt")
    _save(uri, "zarr", phase=module.Phase.WARMUP)

    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.raises(UnsafePickleError) as refused:
        cloudckpt.load_common_state_dict(uri)
    assert refused.value.forbidden == "cloudckpt_test_enums.Phase"
    assert module.__name__ not in sys.modules

    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert cloudckpt.load_common_state_dict(uri)["phase"] is module.Phase.WARMUP


def test_add_safe_globals_lets_a_custom_class_through(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, "torch_dist", custom=Allowed(4), obj=ShardedObject("o", Allowed(5), (1,), (0,)))
    request = {**_request(), "obj": ShardedObject("o", None, (1,), (0,))}
    with pytest.raises(UnsafePickleError) as refused:
        cloudckpt.load(request, uri)
    assert refused.value.forbidden == "tests.test_untrusted.Allowed"
    assert "cloudckpt.add_safe_globals([tests.test_untrusted.Allowed])" in str(refused.value)

    cloudckpt.add_safe_globals([Allowed])
    loaded = cloudckpt.load(request, uri)
    assert loaded["custom"].value == 4 and loaded["obj"].value == 5
    assert allowed_globals()["tests.test_untrusted.Allowed"] is Allowed
    assert Allowed in torch.serialization.get_safe_globals()


def test_add_safe_globals_from_many_threads_keeps_every_entry() -> None:
    classes = [type(f"Threaded{i}", (), {"__module__": __name__}) for i in range(16)]
    barrier = threading.Barrier(len(classes))

    def add(cls: type) -> None:
        barrier.wait()
        cloudckpt.add_safe_globals([cls])

    threads = [threading.Thread(target=add, args=(cls,)) for cls in classes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    allowed, torch_list = allowed_globals(), torch.serialization.get_safe_globals()
    for cls in classes:
        assert allowed[f"{__name__}.{cls.__qualname__}"] is cls and cls in torch_list
    with pytest.raises(TypeError, match=r"dotted\.name"):
        cloudckpt.add_safe_globals([(Allowed, 3)])


# -- ShardedObjects -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_malicious_sharded_object_is_refused(tmp_path: Path, backend: str) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save_object(uri, backend, Evil(marker))
    with pytest.raises(UnsafePickleError) as refused:
        cloudckpt.load(_object_request(), uri)
    _check_refusal(refused.value, uri, "sharded object")
    assert "obj/shard_0_1" in str(refused.value)
    assert not marker.exists()

    loaded = cloudckpt.load(_object_request(), uri, weights_only=False)
    assert marker.exists() and loaded["obj"] == 0


def test_torch_dist_strategy_weights_only_argument(tmp_path: Path) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save_object(uri, "torch_dist", Evil(marker))
    strict = TorchDistLoadShardedStrategy(weights_only=True)
    with pytest.raises(UnsafePickleError):
        cloudckpt.load(_object_request(), uri, sharded_strategy=strict, weights_only=False)
    assert not marker.exists()
    trusting = TorchDistLoadShardedStrategy(weights_only=False)
    assert cloudckpt.load(_object_request(), uri, sharded_strategy=trusting)["obj"] == 0
    assert marker.exists()


def test_malicious_common_state_item_of_a_megatron_019_checkpoint(tmp_path: Path) -> None:
    """Megatron-Core 0.19 keeps the common state as the DCP item ``common_state/shard_0_1``."""
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    storage = CheckpointStorage(uri)
    common = io.BytesIO()
    torch.save([{"iteration": 9, "evil": Evil(marker)}], common)
    state = {"w": torch.arange(4.0), "common_state/shard_0_1": common}
    dcp_save(state, CloudStorageWriter(storage))
    metadata_json = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    storage.write("metadata.json", json.dumps(metadata_json).encode())
    with pytest.raises(UnsafePickleError) as refused:
        cloudckpt.load_common_state_dict(uri)
    _check_refusal(refused.value, uri, "common state")
    assert "(item 'common_state/shard_0_1')" in str(refused.value)
    assert not marker.exists()
    assert cloudckpt.load_common_state_dict(uri, weights_only=False)["iteration"] == 9
    assert marker.exists()


# -- DCP .metadata ------------------------------------------------------------------------


def _plant_metadata(uri: str, payload: bytes) -> None:
    """Replace ``.metadata`` and record it in the manifest, as a forger would."""
    storage = CheckpointStorage(uri)
    amend_manifest(storage, rewritten=[storage.write(".metadata", payload)])


def test_planted_dcp_metadata_is_refused(tmp_path: Path) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save(uri, "torch_dist", iteration=1)
    metadata = read_metadata(CheckpointStorage(uri))
    metadata.planner_data = Evil(marker)  # a real Metadata, with a payload inside
    _plant_metadata(uri, pickle.dumps(metadata))

    strict_common = TorchCommonLoadStrategy(weights_only=True)
    calls = [
        lambda: cloudckpt.load(_request(), uri),
        lambda: cloudckpt.load_tensors_metadata(uri),
        lambda: cloudckpt.load_sharded_metadata(uri),
        lambda: cloudckpt.load_plain_tensors(uri),
        lambda: cloudckpt.load(_request(), uri, common_strategy=strict_common),
    ]
    for call in calls:
        with pytest.raises(UnsafePickleError) as refused:
            call()
        _check_refusal(refused.value, f"{uri}/.metadata", "DCP metadata")
    assert not marker.exists()

    assert "w" in cloudckpt.load_tensors_metadata(uri, weights_only=False)
    assert marker.exists()


def test_malformed_dcp_metadata_is_a_checkpointing_error_not_an_unsafe_pickle(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, "torch_dist")
    _plant_metadata(uri, b"\x80\x04not a pickle")
    with pytest.raises(CheckpointingException, match="is not a PyTorch DCP metadata file") as err:
        cloudckpt.load_tensors_metadata(uri)
    assert not isinstance(err.value, UnsafePickleError)
    _plant_metadata(uri, pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointingException, match="holds a dict, not Metadata"):
        cloudckpt.load_tensors_metadata(uri)


def test_stock_dcp_checkpoint_reads_restricted(tmp_path: Path) -> None:
    """``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (one process):
    its ``.metadata`` passes the restricted unpickler and its items load."""
    path = tmp_path / "dcp"
    state = {
        "w": torch.arange(12.0).reshape(3, 4),
        "h": torch.ones(5, dtype=torch.bfloat16),
        "blob": io.BytesIO(b"raw bytes"),
        "extra": {"step": 9, "name": "run"},
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    metadata = read_metadata(CheckpointStorage(str(path)), weights_only=True)
    assert isinstance(metadata, Metadata)
    assert metadata.state_dict_metadata["w"].size == torch.Size([3, 4])
    assert metadata.state_dict_metadata["h"].properties.dtype == torch.bfloat16

    target = {
        "w": torch.zeros(3, 4),
        "h": torch.zeros(5, dtype=torch.bfloat16),
        "blob": io.BytesIO(),
        "extra": {"step": 0, "name": ""},
    }
    reader = CloudStorageReader(CheckpointStorage(str(path)))
    stock = {"w": torch.zeros(3, 4)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=reader, no_dist=True)
        dcp.load(stock, storage_reader=FileSystemReader(str(path)), no_dist=True)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["h"], state["h"])
    assert target["extra"] == {"step": 9, "name": "run"}
    assert torch.equal(stock["w"], state["w"])


# -- cloudckpt inspect --------------------------------------------------------------------


def _inspect(uri: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", "inspect", uri],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **env},
        stdin=subprocess.DEVNULL,
    )


def _make_foreign(uri: str) -> None:
    """Megatron-Core's layout: no manifest, no claim; inspect reads the pickles."""
    (Path(uri) / "manifest.json").unlink()
    (Path(uri) / ".cloudckpt-claim.json").unlink()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inspect_never_runs_a_checkpoints_pickles(tmp_path: Path, backend: str) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save(uri, backend, evil=Evil(marker))
    described = _inspect(uri)  # a cloudckpt checkpoint: its manifest alone
    assert described.returncode == 0, described.stderr
    assert "evil" in described.stdout

    _make_foreign(uri)
    for env in ({}, {TRUST_ENV: "1"}):
        refused = _inspect(uri, **env)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert FORBIDDEN in refused.stderr and "common state" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert not marker.exists()


def test_inspect_refuses_a_planted_dcp_metadata(tmp_path: Path) -> None:
    uri, marker = str(tmp_path / "ckpt"), tmp_path / "pwned"
    _save(uri, "torch_dist", iteration=1)
    _make_foreign(uri)
    (Path(uri) / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    refused = _inspect(uri, **{TRUST_ENV: "1"})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert FORBIDDEN in refused.stderr and "DCP metadata" in refused.stderr
    assert not marker.exists()


# -- several ranks ------------------------------------------------------------------------


def _rank_state(rank: int, world: int, common: Any, empty: bool = False) -> dict[str, Any]:
    data = torch.empty(2) if empty else torch.full((2,), float(rank))
    state: dict[str, Any] = {
        "w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world)),
        "obj": ShardedObject("obj", None if empty else {"rank": rank}, (world,), (rank,)),
    }
    if not empty:
        state["common"] = common
    return state


def _multirank_scenario(rank: int, world: int, root: str) -> list[tuple[str, bool, bool]]:
    """Per backend: a checkpoint whose common state holds a payload (every rank must
    refuse it) and one holding a harmless unlisted object (loads with the opt-out)."""
    marker = Path(root) / "pwned"
    refusals = []
    for backend in BACKENDS:
        for name, common in (("evil", Evil(marker)), ("trusted", Opaque(7))):
            state = _rank_state(rank, world, common)
            # the checkpoint is the untrusted input here: save without the common-state
            # consistency check, which (as Megatron-Core's) unpickles rank 0's own common
            # state on the other ranks
            cloudckpt.save(
                state,
                f"{root}/{backend}-{name}",
                sharded_strategy=(backend, 1),
                validate_access_integrity=False,
            )
        try:
            cloudckpt.load(_rank_state(rank, world, None, True), f"{root}/{backend}-evil")
        except UnsafePickleError as exc:
            refusals.append((backend, FORBIDDEN in str(exc), marker.exists()))
        uri = f"{root}/{backend}-trusted"
        loaded = cloudckpt.load(_rank_state(rank, world, None, True), uri, weights_only=False)
        assert loaded["common"] == Opaque(7) and loaded["obj"] == {"rank": rank}
        assert torch.equal(loaded["w"], torch.full((2,), float(rank)))
    return refusals


@pytest.fixture(scope="module")
def two_ranks() -> Any:
    with RankPool(2, timeout_s=120) as pool:
        yield pool


@pytest.mark.multirank
def test_every_rank_refuses_a_malicious_checkpoint(two_ranks: RankPool, tmp_path: Path) -> None:
    results = two_ranks.run(_multirank_scenario, str(tmp_path))
    assert results == [[(backend, True, False) for backend in BACKENDS]] * 2
    assert not (tmp_path / "pwned").exists()
