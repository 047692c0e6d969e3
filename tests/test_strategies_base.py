"""Tests for cloudckpt.strategies.base: the registry, base classes and helpers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from cloudckpt.errors import (
    CheckpointingException,
    IncompatibleCheckpointError,
    StrategyNotFoundError,
)
from cloudckpt.strategies import base
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from cloudckpt.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    StrategyAction,
    check_compatibility,
    checkpoint_uri,
    default_strategies,
    get_default_strategy,
    register_default_strategy,
)


@pytest.fixture(autouse=True)
def _restore_registry() -> Iterator[None]:
    """Leave ``default_strategies`` exactly as the test found it."""
    saved = {action: dict(entries) for action, entries in default_strategies.items()}
    yield
    default_strategies.clear()
    for action, entries in saved.items():
        default_strategies[action] = entries


class _Save(SaveShardedStrategy):
    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        pass


class _Load(LoadShardedStrategy):
    """Reads backend "fake" at versions 1 and 2, as a concrete strategy would check."""

    def __init__(self, handles_objects: bool = False) -> None:
        self._handles_objects = handles_objects

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self._handles_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != "fake":
            raise IncompatibleCheckpointError(f"backend {loaded_backend!r} is not 'fake'")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version not in (1, 2):
            raise IncompatibleCheckpointError(f"version {loaded_version} not in (1, 2)")

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        return {"w": ("meta", checkpoint_dir)}

    def remove_sharded_tensors(self, checkpoint_dir: Any, key_prefix: str) -> None:
        pass


class _LoadCommon(LoadCommonStrategy):
    def __init__(self, handles_objects: bool = False) -> None:
        self._handles_objects = handles_objects

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self._handles_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        pass

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass

    def load_common(self, checkpoint_dir: Any) -> Any:
        return {}

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
        return {}


class _AsyncSave(AsyncSaveShardedStrategy):
    def __init__(self, fail: bool = False) -> None:
        super().__init__("fake", 1)
        self.events: list[tuple[str, Any]] = []
        self.fail = fail

    def _write(self, sd: Any, uri: str) -> None:
        self.events.append(("write", (sd, uri, threading.get_ident())))
        if self.fail:
            raise OSError("bucket gone")

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        self.events.append(("async_save", checkpoint_dir))
        return AsyncRequest(
            self._write,
            (sharded_state_dict, checkpoint_dir),
            [
                lambda: self.events.append(("fin1", None)),
                lambda: self.events.append(("fin2", None)),
            ],
        )


# --- registry -----------------------------------------------------------------------


def test_strategy_action_values() -> None:
    assert [a.value for a in StrategyAction] == [
        "load_common",
        "load_sharded",
        "save_common",
        "save_sharded",
    ]


def test_register_then_get_returns_same_instance() -> None:
    strategy = _Save("fake", 7)
    register_default_strategy(StrategyAction.SAVE_SHARDED, "fake", 7, strategy)
    assert default_strategies["save_sharded"][("fake", 7)] is strategy
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "fake", 7) is strategy
    assert get_default_strategy("save_sharded", "fake", 7) is strategy


def test_register_replaces_previous_default() -> None:
    first, second = _Save("fake", 1), _Save("fake", 1)
    register_default_strategy("save_sharded", "fake", 1, first)
    register_default_strategy("save_sharded", "fake", 1, second)
    assert get_default_strategy("save_sharded", "fake", 1) is second


def test_unregistered_triple_lists_what_is_registered() -> None:
    register_default_strategy("load_sharded", "fake", 1, _Load())
    register_default_strategy("load_sharded", "other", 3, _Load())
    with pytest.raises(StrategyNotFoundError) as info:
        get_default_strategy(StrategyAction.LOAD_SHARDED, "fake", 9)
    message = str(info.value)
    assert "('load_sharded', 'fake', 9)" in message
    assert "'fake' v1" in message and "'other' v3" in message
    assert isinstance(info.value, KeyError)  # catchable as a KeyError too


def test_unregistered_triple_with_empty_action_says_nothing() -> None:
    default_strategies.pop("save_common", None)
    with pytest.raises(StrategyNotFoundError, match="registered for 'save_common': nothing"):
        get_default_strategy(StrategyAction.SAVE_COMMON, "nobackend", 1)


def test_unknown_action_is_rejected() -> None:
    with pytest.raises(StrategyNotFoundError, match="unknown strategy action 'save_everything'"):
        get_default_strategy("save_everything", "fake", 1)
    with pytest.raises(StrategyNotFoundError, match="expected one of"):
        register_default_strategy("nope", "fake", 1, _Save("fake", 1))


def test_lazy_backend_import_failure_names_missing_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(base._BACKEND_MODULES, "ghost", "cloudckpt.strategies._no_such_backend")
    with pytest.raises(StrategyNotFoundError) as info:
        get_default_strategy(StrategyAction.LOAD_SHARDED, "ghost", 1)
    assert "cloudckpt.strategies._no_such_backend" in str(info.value)
    assert "('load_sharded', 'ghost', 1)" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


@pytest.fixture
def fake_backend_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that registers a "lazy" backend strategy when imported."""
    name = "_cloudckpt_test_lazy_backend"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
        from cloudckpt.strategies.base import register_default_strategy
        IMPORTED = object()
        register_default_strategy("load_common", "lazy", 2, IMPORTED)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(base._BACKEND_MODULES, "lazy", name)
    yield name
    sys.modules.pop(name, None)


def test_lazy_backend_import_registers_strategy(fake_backend_module: str) -> None:
    assert ("lazy", 2) not in default_strategies["load_common"]
    strategy = get_default_strategy(StrategyAction.LOAD_COMMON, "lazy", 2)
    assert strategy is sys.modules[fake_backend_module].IMPORTED


def test_lazy_backend_module_without_that_version(fake_backend_module: str) -> None:
    with pytest.raises(StrategyNotFoundError, match="'lazy' v2"):
        get_default_strategy(StrategyAction.LOAD_COMMON, "lazy", 5)
    assert fake_backend_module in sys.modules  # it was imported, but has no v5


def test_registered_backend_is_not_imported_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(base._BACKEND_MODULES, "ghost", "cloudckpt.strategies._no_such_backend")
    strategy = _Save("ghost", 1)
    register_default_strategy("save_sharded", "ghost", 1, strategy)
    assert get_default_strategy("save_sharded", "ghost", 1) is strategy


def test_known_backends_map_to_their_modules() -> None:
    assert base._BACKEND_MODULES == {
        "zarr": "cloudckpt.strategies.zarr",
        "torch": "cloudckpt.strategies.common",
        "torch_dist": "cloudckpt.strategies.torch",
    }


def test_import_starts_no_thread_and_no_process_group() -> None:
    code = (
        "import threading, torch.distributed as d\n"
        "import cloudckpt.strategies.base as b\n"
        "print(threading.active_count(), d.is_initialized(),"
        " type(b.async_calls).__name__, b.async_calls.get_num_unfinalized_calls())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        cwd=str(Path(__file__).resolve().parents[1]),
    ).stdout.split()
    assert out == ["1", "False", "AsyncCallsQueue", "0"]
    assert isinstance(base.async_calls, AsyncCallsQueue)


# --- base classes -------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [
        LoadStrategyBase,
        LoadCommonStrategy,
        LoadShardedStrategy,
        SaveCommonStrategy,
        SaveShardedStrategy,
        AsyncSaveShardedStrategy,
    ],
)
def test_abstract_classes_are_not_instantiable(cls: Any) -> None:
    with pytest.raises(TypeError, match="abstract"):
        cls() if issubclass(cls, LoadStrategyBase) else cls("fake", 1)


def test_save_strategy_base_stores_backend_and_version() -> None:
    strategy = _Save("zarr", 1)
    assert (strategy.backend, strategy.version) == ("zarr", 1)
    assert strategy.can_handle_sharded_objects is False
    assert str(strategy) == "_Save(zarr, 1)"
    assert str(SaveStrategyBase("torch", 3)) == "SaveStrategyBase(torch, 3)"


def test_load_strategy_defaults_cannot_handle_sharded_objects() -> None:
    assert _Load().can_handle_sharded_objects is False
    assert _LoadCommon().can_handle_sharded_objects is False


def test_load_common_sharded_metadata_default() -> None:
    assert _LoadCommon().load_sharded_metadata("s3://b/ckpt") == {}
    with pytest.raises(NotImplementedError, match="_LoadCommon"):
        _LoadCommon(handles_objects=True).load_sharded_metadata("s3://b/ckpt")


def test_load_sharded_metadata_defaults_to_tensors_metadata() -> None:
    assert _Load().load_sharded_metadata("s3://b/ckpt") == {"w": ("meta", "s3://b/ckpt")}
    with pytest.raises(NotImplementedError, match="_Load handles sharded objects"):
        _Load(handles_objects=True).load_sharded_metadata("s3://b/ckpt")


def test_async_strategy_save_runs_async_save_then_finalizes(tmp_path: Path) -> None:
    strategy = _AsyncSave()
    strategy.save({"w": 1}, tmp_path)  # type: ignore[arg-type]  # PathLike accepted
    kinds = [kind for kind, _ in strategy.events]
    assert kinds == ["async_save", "write", "fin1", "fin2"]
    assert strategy.events[0][1] == str(tmp_path)  # PathLike converted to str
    sd, uri, thread_id = strategy.events[1][1]
    assert (sd, uri, thread_id) == ({"w": 1}, str(tmp_path), threading.get_ident())


def test_async_strategy_save_propagates_write_error_without_finalizing() -> None:
    strategy = _AsyncSave(fail=True)
    with pytest.raises(OSError, match="bucket gone"):
        strategy.save({}, "s3://b/ckpt")
    assert [kind for kind, _ in strategy.events] == ["async_save", "write"]


# --- helpers ------------------------------------------------------------------------


def test_checkpoint_uri_keeps_uris_and_converts_paths(tmp_path: Path) -> None:
    assert checkpoint_uri("s3://bucket/run/step_1") == "s3://bucket/run/step_1"
    assert checkpoint_uri(tmp_path) == str(tmp_path)
    assert isinstance(checkpoint_uri(tmp_path), str)


@pytest.mark.parametrize("bad", [PurePosixPath("s3://b/k"), Path("gs://b/k"), b"/tmp/x", 42])
def test_checkpoint_uri_rejects_mangled_or_non_text(bad: Any) -> None:
    with pytest.raises(CheckpointingException, match="checkpoint location"):
        checkpoint_uri(bad)


def test_check_compatibility_accepts_matching_checkpoint() -> None:
    check_compatibility(_Load(), "fake", 2, "s3://b/ckpt")  # does not raise


@pytest.mark.parametrize(
    ("backend", "version", "reason"),
    [("zarr", 1, "backend 'zarr' is not 'fake'"), ("fake", 3, "version 3 not in")],
)
def test_check_compatibility_names_uri_stored_format_and_strategy(
    backend: str, version: int, reason: str
) -> None:
    with pytest.raises(IncompatibleCheckpointError) as info:
        check_compatibility(_Load(), backend, version, "gs://bucket/step_5")
    message = str(info.value)
    assert "gs://bucket/step_5" in message
    assert f"backend {backend!r} version {version}" in message
    assert "_Load" in message and reason in message
    assert isinstance(info.value.__cause__, IncompatibleCheckpointError)


def test_a_load_strategy_need_not_remove_tensors() -> None:
    """As Megatron-Core: remove_sharded_tensors is not abstract (its own tests define load
    strategies without it); calling the default raises NotImplementedError."""

    class LoadOnly(_Load):
        remove_sharded_tensors = LoadShardedStrategy.remove_sharded_tensors

    with pytest.raises(NotImplementedError, match="LoadOnly cannot remove tensors from 'x'"):
        LoadOnly().remove_sharded_tensors("x", "prefix")
