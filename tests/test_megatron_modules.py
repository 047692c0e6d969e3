"""Megatron-Core 0.15's dist_checkpointing module set in cloudckpt: names, signatures
and behaviour of utils, optimizer, exchange_utils (4 real gloo ranks), resharding,
the strategies.torch names, async_utils, filesystem_async + state_dict_saver, core
and validation.

The signature spec below lists, per name, Megatron-Core's parameter names (from its
source); cloudckpt's must contain them in the same order and positions, and any
parameter of its own must have a default (so Megatron's calls bind the same way).
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import importlib
import inspect
import io
import itertools
import logging
import os
import pickle
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

import cloudckpt
from cloudckpt import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    core,
    optimizer,
    utils,
)
from cloudckpt import exchange_utils as ex
from cloudckpt.errors import CheckpointingException
from cloudckpt.exchange_utils import distribute_shards_to_ranks, exchange_by_distribution
from cloudckpt.storage import open_checkpoint
from cloudckpt.strategies import resharding
from cloudckpt.strategies import torch as torch_strategies
from cloudckpt.strategies.async_utils import (
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
    _disable_gc,
)
from cloudckpt.strategies.base import AsyncSaveShardedStrategy
from cloudckpt.strategies.filesystem_async import FileSystemWriterAsync
from cloudckpt.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from cloudckpt.strategies.torch import (
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    to_dcp_state_dict,
)
from cloudckpt.utils import _sharded_tensor_shard_id
from cloudckpt.validation import determine_global_metadata

# module -> {qualified name: Megatron-Core 0.15's parameter names ("self" left out)}
SPEC: dict[str, dict[str, list[str]]] = {
    "cloudckpt.utils": {
        "zip_strict": ["args"],
        "_sharded_tensor_shard_id": ["sharded_tensor"],
        "_sharded_object_id": ["sharded_object"],
        "extract_sharded_tensors": ["sharded_state_dict"],
        "extract_sharded_tensors_and_factories": ["sharded_state_dict"],
        "extract_sharded_tensors_or_nonpersistent": ["sharded_state_dict"],
        "extract_sharded_base": ["sharded_state_dict"],
        "extract_nonpersistent": ["sharded_state_dict"],
        "add_prefix_for_sharding": ["sharded_state_dict", "prefix"],
        "replace_prefix_for_sharding": ["sharded_state_dict", "old_prefix", "new_prefix"],
        "apply_prefix_mapping": ["sharded_state_dict", "prefix_map"],
        "force_all_tensors_to_non_fp8": ["sharded_state_dict"],
        "logger_stack": ["name", "current_logger"],
        "debug_time": ["name", "logger", "threshold", "level"],
        "debug_msg": ["msg"],
    },
    "cloudckpt.optimizer": {
        "get_optim_param_to_id_map": ["optim_params_iter"],
        "get_param_id_to_sharded_param_map": ["model_sharded_state_dict", "optim_params_iter"],
        "make_sharded_optimizer_tensor": ["model_param", "optim_param", "prefix"],
        "optim_state_to_sharding_state": [
            "optim_state_dict",
            "id_to_sharded_param_map",
            "exclude_keys",
        ],
    },
    "cloudckpt.exchange_utils": {
        "distribute_shards_to_ranks": [
            "shard_to_ranks",
            "shard_to_size",
            "num_ranks",
            "cross_parallelization_group_loads",
        ],
        "determine_main_replica_uniform_distribution": [
            "sharded_state_dict",
            "parallelization_group",
            "ignore_groups",
        ],
        "exchange_loaded_tensors_gather_rounds": [
            "loaded_tensors",
            "unloaded_shards",
            "shard_distribution",
            "parallelization_group",
        ],
        "exchange_loaded_tensors_gather_object": [
            "loaded_tensors",
            "unloaded_shards",
            "shard_distribution",
            "parallelization_group",
        ],
        "exchange_loaded_objects_gather_object": ["loaded_objects"],
        "exchange_loaded_tensors_broadcast": [
            "loaded_tensors",
            "unloaded_shards",
            "shard_distribution",
            "parallelization_group",
        ],
        "exchange_by_distribution": [
            "loaded_tensors",
            "unloaded_shards",
            "shard_distribution",
            "parallelization_group",
            "exchange_algo",
        ],
    },
    "cloudckpt.strategies.resharding": {
        "TensorReformulationMetadata": ["ckpt_orig_global_shape", "ckpt_reform_global_shape"],
        "nd_flattened_tensor_reformulated_global_shape": ["sh_ten"],
        "is_nd_flattened_tensor": ["sh_ten"],
        "apply_nd_flattened_tensors_reformulation": [
            "sharded_state_dict",
            "reformulation_metadata",
        ],
        "restore_nd_flattened_tensors_formulation": [
            "state_dict",
            "formulation_restore_metadata",
        ],
        "reformulate_single_nd_flattened_tensor": ["sh_ten", "reformulation_metadata"],
        "get_reformulation_metadata": ["sharded_state_dict", "checkpoint_dir"],
    },
    "cloudckpt.strategies.torch": {
        "register_default_torch_strategies": [],
        "flatten_state_dict": ["state_dict"],
        "sharded_tensor_to_torch_sharded_tensor": [
            "sh_tens",
            "rank",
            "load_legacy_1d_flatten_tensors",
        ],
        "mcore_to_pyt_state_dict": [
            "state_dict",
            "is_loading",
            "init_device",
            "load_legacy_1d_flatten_tensors",
        ],
        "MCoreSavePlanner": [
            "args",
            "dedup_replicated_tensors",
            "nd_flattened_global_shapes",
            "can_run_decentralized_global_plan",
            "kwargs",
        ],
        # subclasses of PyTorch's dataclasses: PyTorch's fields, then Megatron's one
        "MCoreMetadata": [f.name for f in dataclasses.fields(Metadata)] + ["mcore_data"],
        "MCoreSavePlan": [f.name for f in dataclasses.fields(SavePlan)] + ["mcore_data"],
        "MCoreLoadPlanner": [
            "args",
            "shapes_validation_sharded_tensors",
            "allow_shape_mismatch_sharded_tensors",
            "kwargs",
        ],
        "TorchDistSaveShardedStrategy": [
            "backend",
            "version",
            "keep_only_main_replica",
            "thread_count",
            "cached_metadata",
            "separation_hint",
        ],
        "TorchDistLoadShardedStrategy": [],
        "TorchDistLoadShardedStrategy.load": ["sharded_state_dict", "checkpoint_dir"],
        "TorchDistLoadShardedStrategy.load_tensors_metadata": ["checkpoint_dir", "metadata"],
        "get_reformulation_metadata": ["sharded_state_dict", "checkpoint_dir"],
    },
    "cloudckpt.strategies.filesystem_async": {
        "FileSystemWriterAsync": ["path", "args", "separation_hint", "use_msc", "kwargs"],
        "FileSystemWriterAsync.prepare_write_data": ["plan", "planner"],
        "FileSystemWriterAsync.get_save_function_and_args": [],
        "FileSystemWriterAsync.retrieve_write_results": [],
    },
    "cloudckpt.strategies.state_dict_saver": {
        "save_state_dict_async_plan": [
            "state_dict",
            "storage_writer",
            "process_group",
            "coordinator_rank",
            "planner",
            "cached_ckpt_structure",
            "loaded_all_plans",
        ],
        "verify_global_md_reuse": ["loaded_all_plans", "local_plan", "rank", "dist_wrapper"],
        "save_state_dict_async_finalize": ["storage_writer", "global_metadata", "dist_wrapper"],
    },
    "cloudckpt.strategies.async_utils": {
        "_disable_gc": [],
        "AsyncRequest": [
            "async_fn",
            "async_fn_args",
            "finalize_fns",
            "async_fn_kwargs",
            "preload_fn",
            "is_frozen",
            "call_idx",
        ],
        "AsyncRequest.add_finalize_fn": ["fn"],
        "AsyncRequest.execute_sync": [],
        "AsyncRequest.freeze": [],
        "AsyncCallsQueue": ["persistent"],
        "AsyncCallsQueue.schedule_async_request": ["async_request"],
        "AsyncCallsQueue.maybe_finalize_async_calls": ["blocking", "no_dist"],
        "AsyncCallsQueue.get_num_unfinalized_calls": [],
        "AsyncCallsQueue.close": ["abort"],
        "TemporalAsyncCaller": [],
        "PersistentAsyncCaller": [],
        "AsyncCaller.schedule_async_call": ["async_req"],
        "AsyncCaller.is_current_async_call_done": ["blocking", "no_dist"],
        "AsyncCaller.sync_all_async_calls": ["is_alive"],
        "AsyncCaller.close": ["abort"],
    },
    "cloudckpt.validation": {"determine_global_metadata": ["sharded_state_dict"]},
    "cloudckpt.core": {
        "maybe_load_config": ["checkpoint_dir"],
        "save_config": ["config", "checkpoint_dir"],
        "check_is_distributed_checkpoint": ["checkpoint_dir"],
    },
}

_VAR = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    ("module", "qualname"), [(m, q) for m, names in SPEC.items() for q in names]
)
def test_name_exists_with_megatron_parameters(module: str, qualname: str) -> None:
    expected = SPEC[module][qualname]
    params = [p for p in inspect.signature(_resolve(module, qualname)).parameters.values()]
    params = [p for p in params if p.name != "self"]
    names = [p.name for p in params]
    leading = []
    for name in expected:  # Megatron's positional prefix keeps its positions
        if any(p.name == name and p.kind in _VAR for p in params):
            break
        leading.append(name)
    assert names[: len(leading)] == leading, (names, expected)
    remaining = iter(names)
    assert all(name in remaining for name in expected), (names, expected)  # same order
    for p in params:
        if p.name not in expected:
            assert p.kind in _VAR or p.default is not inspect.Parameter.empty, (p, names)


# -- utils ----------------------------------------------------------------------------


def _mixed_state() -> dict[str, Any]:
    ten = ShardedTensor.from_rank_offsets("model.w", torch.arange(4.0))
    factory = ShardedTensorFactory(
        "model.f",
        torch.ones(2),
        lambda k, d, r, f: {"x": ShardedTensor.from_rank_offsets(k, d)},
        lambda sd: sd["x"],
    )
    obj = ShardedObject("model.rng", {"seed": 1}, (1,), (0,))
    return {
        "a": ten,
        "nested": {"f": factory, "o": obj, "plain": 3},
        "list": [LocalNonpersistentObject("np"), "text"],
    }


def test_extract_functions_split_by_kind() -> None:
    sd = _mixed_state()
    tensors, rest = utils.extract_sharded_tensors(sd)
    assert tensors == {"a": sd["a"]}
    assert rest["nested"]["plain"] == 3 and "a" not in rest
    with_factories, _ = utils.extract_sharded_tensors_and_factories(sd)
    assert with_factories == {"a": sd["a"], "nested": {"f": sd["nested"]["f"]}}
    nonpersistent, rest = utils.extract_nonpersistent(sd)
    assert nonpersistent == {"list": [sd["list"][0]]} and rest["list"] == ["text"]
    or_np, _ = utils.extract_sharded_tensors_or_nonpersistent(sd)
    assert set(or_np) == {"a", "nested", "list"} and "o" not in or_np["nested"]
    base, common = utils.extract_sharded_base(sd)
    assert set(base["nested"]) == {"f", "o"} and common == {
        "nested": {"plain": 3},
        "list": [sd["list"][0], "text"],
    }


def test_prefix_functions_rename_in_place() -> None:
    sd = _mixed_state()
    assert utils.add_prefix_for_sharding(sd, "pre.") is None
    assert [sd["a"].key, sd["nested"]["f"].key, sd["nested"]["o"].key] == [
        "pre.model.w",
        "pre.model.f",
        "pre.model.rng",
    ]
    utils.replace_prefix_for_sharding(sd, "pre.model.", "decoder.")
    assert sd["a"].key == "decoder.w" and sd["nested"]["o"].unique_key == "decoder.rng/shard_0_1"
    with pytest.raises(ValueError, match=r"Expected decoder\.w to begin with prefix enc\."):
        utils.replace_prefix_for_sharding(sd, "enc.", "x.")
    utils.apply_prefix_mapping(sd, {"decoder.r": "other.", "decoder.": "model.", "model.": "no."})
    assert [sd["a"].key, sd["nested"]["f"].key, sd["nested"]["o"].key] == [
        "model.w",
        "model.f",
        "other.ng",
    ]


def test_shard_ids_zip_strict_and_fp8() -> None:
    flat = ShardedTensor.from_rank_offsets_flat(
        "k", torch.ones(3), (2, 4), (0, 1, 2), flattened_range=slice(2, 5)
    )
    assert utils._sharded_tensor_shard_id(flat) == ("k", (2, 0), (2, 5))
    obj = ShardedObject("o", 1, (2, 2), (1, 0))
    assert utils._sharded_object_id(obj) == ("o", (1, 0), (2, 2))
    assert list(utils.zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(ValueError, match=r"unequal lengths: \[2, 1\]"):
        utils.zip_strict([1, 2], [3])

    class Float8Tensor(torch.Tensor):  # the shape of Transformer Engine's FP8 tensor
        def dequantize(self) -> torch.Tensor:
            return torch.Tensor(self).to(torch.float32) * 2

    fp8 = torch.Tensor._make_subclass(Float8Tensor, torch.ones(2, dtype=torch.bfloat16))
    sd = {"q": ShardedTensor.from_rank_offsets("q", torch.zeros(2))}
    sd["q"].data = fp8
    plain = ShardedTensor.from_rank_offsets("p", torch.full((2,), 5.0))
    sd["p"] = plain
    utils.force_all_tensors_to_non_fp8(sd)
    assert type(sd["q"].data) is torch.Tensor and torch.equal(sd["q"].data, torch.full((2,), 2.0))
    assert sd["p"].data is plain.data


def test_debug_time_and_debug_msg_log_with_the_name_stack(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.megatron.debug")
    with caplog.at_level(logging.DEBUG, logger="test.megatron.debug"):
        with utils.debug_time("outer", log), utils.debug_time("inner"):
            utils.debug_msg("hello")

        @utils.debug_time("decorated", log, threshold=0.0)
        def work() -> int:
            return 7

        assert work() == 7
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == log.name]
    assert records[0] == (logging.DEBUG, "outer.inner hello")
    assert records[1][0] == logging.DEBUG and records[1][1].startswith("outer.inner took ")
    assert records[2][1].startswith("outer took ")
    assert records[3][0] == logging.WARNING and records[3][1].startswith("decorated took ")
    assert len(records) == 4


# -- optimizer ------------------------------------------------------------------------


def test_optimizer_state_sharded_like_the_model_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    model_sd = {
        name: ShardedTensor.from_rank_offsets(f"model.{name}", param)
        for name, param in model.state_dict(keep_vars=True).items()
    }
    params = [p for group in optim.param_groups for p in group["params"]]
    assert optimizer.get_optim_param_to_id_map(params + params[:1]) == {
        id(params[0]): 0,
        id(params[1]): 1,
    }
    id_map = optimizer.get_param_id_to_sharded_param_map(model_sd, params)
    assert {k: v.key for k, v in id_map.items()} == {0: "model.weight", 1: "model.bias"}
    optim_sd = optim.state_dict()
    expected = {pid: {k: v.clone() for k, v in st.items()} for pid, st in optim_sd["state"].items()}
    optimizer.optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
    state = optim_sd["state"]
    assert state[0]["exp_avg"].key == "optimizer.state.exp_avg.model.weight"
    assert set(state[1]) == {"exp_avg", "exp_avg_sq"}
    assert isinstance(optim_sd["param_groups"][0]["params"], LocalNonpersistentObject)
    uri = str(tmp_path / "ckpt")
    cloudckpt.save({"optim": optim_sd}, uri, ("torch_dist", 1))
    request = {
        "optim": {
            "state": {
                pid: {
                    k: optimizer.make_sharded_optimizer_tensor(
                        id_map[pid], torch.empty_like(v), f"optimizer.state.{k}"
                    )
                    for k, v in st.items()
                    if k != "step"
                }
                for pid, st in expected.items()
            }
        }
    }
    loaded = cloudckpt.load(request, uri)
    for pid, st in expected.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded["optim"]["state"][pid][k], st[k]), (pid, k)


def test_optimizer_errors_and_empty_mapping(caplog: pytest.LogCaptureFixture) -> None:
    model_param = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), (0, 0, 2))
    with pytest.raises(
        CheckpointingException, match=r"Optimizer shape \(\(3, 2\)\) does not match"
    ):
        optimizer.make_sharded_optimizer_tensor(model_param, torch.zeros(3, 2), "optimizer.state.x")
    made = optimizer.make_sharded_optimizer_tensor(
        model_param, torch.zeros(4, 2, dtype=torch.float64), "p"
    )
    assert made.key == "p.w" and made.dtype == torch.float64 and made.global_shape == (8, 2)
    with pytest.raises(ValueError, match="Param id 5 does not match any model sharded param"):
        optimizer.optim_state_to_sharding_state(
            {"state": {5: {"m": torch.zeros(1)}}, "param_groups": []}, {}
        )
    with caplog.at_level(logging.WARNING, logger="cloudckpt.optimizer"):
        assert (
            optimizer.get_param_id_to_sharded_param_map(
                {"w": model_param}, [torch.nn.Parameter(torch.zeros(1))]
            )
            == {}
        )
    assert "keep_vars=True" in caplog.text


# -- resharding -----------------------------------------------------------------------


def _flat_shards(full: torch.Tensor, tp: int, pieces: int, key: str = "opt") -> list[ShardedTensor]:
    """Every shard of ``full`` cut into ``tp`` row chunks, each flattened into ``pieces``."""
    out = []
    for t, chunk in enumerate(full.chunk(tp, dim=0)):
        numel = chunk.numel()
        bounds = [numel * i // pieces for i in range(pieces + 1)]
        for lo, hi in itertools.pairwise(bounds):
            out.append(
                ShardedTensor.from_rank_offsets_flat(
                    key,
                    chunk.flatten()[lo:hi].clone(),
                    tuple(chunk.shape),
                    (0, t, tp),
                    flattened_range=slice(lo, hi),
                )
            )
    return out


def test_nd_flattened_reformulation_loads_another_grid(tmp_path: Path) -> None:
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    uri = str(tmp_path / "ckpt")
    saved = _flat_shards(full, tp=2, pieces=2)
    cloudckpt.save({f"s{i}": sh for i, sh in enumerate(saved)}, uri, ("torch_dist", 1))
    request = {f"r{i}": sh for i, sh in enumerate(_flat_shards(torch.zeros(8, 6), tp=4, pieces=3))}
    assert all(resharding.is_nd_flattened_tensor(v) for v in request.values())
    assert not resharding.is_nd_flattened_tensor(
        ShardedTensor.from_rank_offsets("x", torch.ones(2))
    )
    assert resharding.nd_flattened_tensor_reformulated_global_shape(request["r0"]) == (4, 1, 12)
    metadata = resharding.get_reformulation_metadata(request, Path(uri))
    assert metadata == {"opt": resharding.TensorReformulationMetadata((8, 6), (2, 1, 24))}
    expected = {
        k: full.chunk(4, dim=0)[i // 3].flatten()[v.flattened_range].clone()
        for i, (k, v) in enumerate(request.items())
    }
    reformulated, restore = resharding.apply_nd_flattened_tensors_reformulation(request, metadata)
    rows = [v for sub in reformulated.values() for v in sub.values()]
    assert {
        (r.global_offset, r.local_shape, r.flattened_range.start, r.flattened_range.stop)
        for r in rows
    } == {
        ((0, 0), (4, 6), 0, 24),
        ((4, 0), (4, 6), 0, 24),
    }
    loaded = TorchDistLoadShardedStrategy().load(reformulated, uri)
    restored = resharding.restore_nd_flattened_tensors_formulation(loaded, restore)
    assert set(restored) == set(expected)
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
    same = {"same": _flat_shards(torch.zeros(8, 6), tp=2, pieces=1)[0]}
    _, nothing = resharding.apply_nd_flattened_tensors_reformulation(same, metadata)
    assert nothing == {} and isinstance(same["same"], ShardedTensor)
    with pytest.raises(CheckpointingException, match="Missing reformulation metadata"):
        resharding.apply_nd_flattened_tensors_reformulation(same, {})


# -- torch names, filesystem_async, state_dict_saver -----------------------------------


def test_torch_dist_separation_hint_and_planner_names(tmp_path: Path) -> None:
    strategy = torch_strategies.TorchDistSaveShardedStrategy(
        "torch_dist", 1, True, 4, False, "optimizer."
    )
    assert (strategy.thread_count, strategy.separation_hint) == (4, "optimizer.")
    assert isinstance(strategy, AsyncSaveShardedStrategy)  # as Megatron-Core's
    state = {
        "w": ShardedTensor.from_rank_offsets("model.w", torch.ones(4)),
        "m": ShardedTensor.from_rank_offsets("optimizer.state.m", torch.zeros(4)),
        "v": ShardedTensor.from_rank_offsets("model.v", torch.full((2,), 3.0)),
    }
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(state, uri, strategy)
    md = FileSystemReader(uri).read_metadata()
    files: dict[bool, set[str]] = {True: set(), False: set()}
    for index, info in md.storage_data.items():
        files[index.fqn.startswith("optimizer.")].add(info.relative_path)
    assert files[True] and files[False] and not files[True] & files[False]
    # the separated objects are named after the hint, as Megatron-Core's files
    assert all(p.startswith("optimizer.__0_") for p in files[True]), files
    assert not any(p.startswith("optimizer.") for p in files[False]), files
    flat, paths = torch_strategies.flatten_state_dict({"a": {"b": [1, 2]}, "c": state["w"]})
    assert flat == {"a.b.0": 1, "a.b.1": 2, "c": state["w"]} and paths["a.b.1"] == ("a", "b", 1)
    pyt = torch_strategies.mcore_to_pyt_state_dict(
        {"model.w": [state["w"]], "o": [ShardedObject("o", 5, (1,), (0,))]}
    )
    assert isinstance(pyt["model.w"], torch_strategies.CheckpointableShardedTensor)
    assert torch.load(io.BytesIO(pyt["o"].getvalue()), weights_only=False) == [5]
    with pytest.raises(CheckpointingException, match="decentralized"):
        torch_strategies.MCoreSavePlanner(flatten_state_dict=True)


def test_filesystem_writer_async_and_state_dict_saver_in_a_queue(tmp_path: Path) -> None:
    weights = torch.arange(6.0)
    sharded = {"w": ShardedTensor.from_rank_offsets("w", weights.clone())}
    state, extra = to_dcp_state_dict(sharded)
    uri = str(tmp_path / "async")
    writer = FileSystemWriterAsync(Path(uri), thread_count=2)
    writer.mcore_data = extra
    planner = MCoreSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    args, central, _, reused, _ = save_state_dict_async_plan(state, writer, planner=planner)
    assert not reused and central.items
    sharded["w"].data.zero_()  # staged: training may change its tensors now
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    assert save_fn is not None and preload_fn is None
    queue = AsyncCallsQueue(persistent=True)
    queue.schedule_async_request(
        AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*args)])
    )
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    queue.close()
    loaded = TorchDistLoadShardedStrategy().load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}, uri
    )
    assert torch.equal(loaded["w"], weights)
    assert {r.path for r in writer.results} >= {".metadata"}
    assert type(FileSystemReader(uri).read_metadata()) is Metadata  # MCoreMetadata unwrapped
    with pytest.raises(TypeError, match="unexpected arguments"):
        FileSystemWriterAsync(uri, no_such_option=1)
    failing = FileSystemWriterAsync(str(tmp_path / "never"))
    failing.write_buckets = []
    with pytest.raises(CheckpointException):
        save_state_dict_async_finalize(failing, None, args[2])


# -- async_utils ------------------------------------------------------------------------


def test_persistent_queue_runs_requests_in_one_worker_with_preload() -> None:
    seen: list[tuple[str, Any, str]] = []

    def write(tag: str, payload: Any) -> None:
        seen.append((tag, payload, threading.current_thread().name))

    queue = AsyncCallsQueue(persistent=True)
    first = AsyncRequest(write, ("a", "unstaged"), [], preload_fn=lambda: "staged")
    assert queue.schedule_async_request(first) == 0
    assert queue.schedule_async_request(AsyncRequest(write, ("b", 2))) == 1
    assert queue.maybe_finalize_async_calls(blocking=True) == [0, 1]
    assert seen == [("a", "staged", "cloudckpt-async-worker"), ("b", 2, "cloudckpt-async-worker")]
    queue.close()
    assert not any(t.name == "cloudckpt-async-worker" for t in threading.enumerate())
    frozen = first._replace(is_frozen=True, call_idx=3)
    assert frozen._asdict()["call_idx"] == 3 and AsyncRequest._fields[4] == "preload_fn"

    with _disable_gc():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_async_callers_report_done_and_errors() -> None:
    for caller in (TemporalAsyncCaller(), PersistentAsyncCaller()):
        gate = threading.Event()
        caller.schedule_async_call(AsyncRequest(gate.wait, ()))
        assert caller.is_current_async_call_done(no_dist=True) is False
        gate.set()
        assert caller.is_current_async_call_done(blocking=True) is True

        def boom() -> None:
            raise OSError("disk full")

        caller.schedule_async_call(AsyncRequest(boom, ()))
        with pytest.raises(CheckpointingException, match="disk full"):
            caller.is_current_async_call_done(blocking=True, no_dist=True)
        caller.close()


# -- core -------------------------------------------------------------------------------


def test_maybe_load_config_takes_a_directory_or_storage(tmp_path: Path) -> None:
    uri = tmp_path / "ckpt"
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, str(uri), ("torch_dist", 1)
    )
    for where in (uri, str(uri), open_checkpoint(str(uri))):
        config = core.maybe_load_config(where)
        assert config is not None and config.sharded_backend == "torch_dist"
    assert core.check_is_distributed_checkpoint(uri)
    assert core.maybe_load_config("") is None
    assert core.maybe_load_config(tmp_path) is None and not core.check_is_distributed_checkpoint(
        tmp_path
    )
    with pytest.raises(CheckpointingException, match="lost its '//'"):
        core.maybe_load_config(Path("s3://bucket/ckpt"))


# -- exchange_utils and determine_global_metadata on 4 ranks ------------------------------


def test_distribute_shards_is_balanced_and_deterministic() -> None:
    shards = {"a": [0, 1], "b": [0, 1], "c": [1], "d": [0, 1, 2]}
    sizes = {"a": 10, "b": 10, "c": 5, "d": 1}
    assert distribute_shards_to_ranks(shards, sizes, 3) == {"c": 1, "a": 0, "b": 1, "d": 2}
    # a shard whose main replica is in another group is placed last
    pair, even = {"x": [0, 1], "y": [0, 1]}, {"x": 5, "y": 5}
    assert distribute_shards_to_ranks(pair, even, 2) == {"x": 0, "y": 1}
    assert distribute_shards_to_ranks(pair, even, 2, {"x"}) == {"y": 0, "x": 1}
    with pytest.raises(CheckpointingException, match="Expecting distribution"):
        exchange_by_distribution({}, {}, None)


def _reference(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=gen).to(dtype)


def _replicated_state(rank: int) -> dict[str, ShardedTensor]:
    """'a': 2 row chunks, each on 2 ranks; 'b': bfloat16, on every rank; 'c': flat ranges."""
    a = _reference("a", (8, 4), torch.float32).chunk(2)[rank % 2]
    b = _reference("b", (5,), torch.bfloat16)
    lo, hi = (0, 7) if rank < 2 else (7, 12)
    return {
        "a": ShardedTensor.from_rank_offsets(
            "a", torch.zeros_like(a), (0, rank % 2, 2), replica_id=rank // 2
        ),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros_like(b), replica_id=rank),
        "c": ShardedTensor.from_rank_offsets_flat(
            "c",
            torch.zeros(hi - lo, dtype=torch.float64),
            (12,),
            flattened_range=slice(lo, hi),
            replica_id=rank % 2,
        ),
    }


def _truth(sh: ShardedTensor) -> torch.Tensor:
    full = _reference(sh.key, tuple(sh.global_shape), sh.dtype)
    if sh.flattened_range is not None:
        return full.flatten()[sh.flattened_range]
    return full[sh.global_slice()]


def _exchange_scenario(rank: int, world: int) -> list[Any]:
    local, everyone = determine_global_metadata(_replicated_state(rank))
    assert len(everyone) == world and all(v.data is None for v in local)
    assert [sh.replica_id for sh in everyone[3]] == [1, 3, 1]
    results = []
    for algo in ("broadcast", "gather_rounds", "gather_object"):
        state = _replicated_state(rank)
        dist_ = ex.determine_main_replica_uniform_distribution(state, None, ignore_groups=True)
        assert dist_ is not None
        mine = {sid for sid, r in dist_.main_rank_for_shard.items() if r == rank}
        shards = {_sharded_tensor_shard_id(sh): sh for sh in state.values()}
        loaded = {sid: _truth(shards[sid]) for sid in mine}
        unloaded = {sid: sh for sid, sh in shards.items() if sid not in mine}
        out = ex.exchange_by_distribution(loaded, unloaded, dist_, None, exchange_algo=algo)
        for sid, sh in shards.items():
            assert torch.equal(out[sid], _truth(sh)), (algo, sid)
            if sid in unloaded and algo != "gather_object":
                assert out[sid] is sh.data  # received into the requested tensor
        results.append(sorted((str(sid), r) for sid, r in dist_.main_rank_for_shard.items()))
    group = torch.distributed.new_group([1, 3])
    if rank in (1, 3):
        state = _replicated_state(rank)
        dist_ = ex.determine_main_replica_uniform_distribution(state, group, ignore_groups=True)
        assert dist_ is not None
        shards = {_sharded_tensor_shard_id(sh): sh for sh in state.values()}
        g_rank = torch.distributed.get_rank(group)
        loaded = {s: _truth(shards[s]) for s, r in dist_.main_rank_for_shard.items() if r == g_rank}
        out = ex.exchange_loaded_tensors_broadcast(
            loaded, {s: v for s, v in shards.items() if s not in loaded}, dist_, group
        )
        assert all(torch.equal(out[s], _truth(v)) for s, v in shards.items())
    objects = ex.exchange_loaded_objects_gather_object({("obj", (rank,), (world,)): rank * 10})
    assert objects == {("obj", (r,), (world,)): r * 10 for r in range(world)}
    try:
        ex.exchange_loaded_objects_gather_object({("same", (0,), (1,)): rank})
    except CheckpointingException as exc:
        assert "Duplicate shard ids" in str(exc)
        results.append("duplicates refused")
    return results


def test_exchange_utils_on_four_gloo_ranks(rank_pool) -> None:
    results = rank_pool.run(_exchange_scenario)
    assert all(r == results[0] for r in results)  # the same distribution on every rank
    assert results[0][-1] == "duplicates refused"
    main_ranks = {rank for _, rank in results[0][0]}
    assert len(results[0][0]) == 5 and len(main_ranks) >= 3  # the reads are spread


def _async_dcp_scenario(rank: int, world: int, uri: str) -> list[str]:
    """Every rank stages with FileSystemWriterAsync, uploads in a queue, finalizes together;
    then a failed upload on rank 2 is raised by the finalize on every rank."""
    full = _reference("w", (8, 4), torch.float32)
    sharded = {
        "w": ShardedTensor.from_rank_offsets(
            "w", full.chunk(world)[rank].clone(), (0, rank, world)
        ),
        "o": ShardedObject("rng", {"rank": rank}, (world,), (rank,)),
    }
    outcome = []
    for attempt in ("ok", "fail"):
        state, extra = to_dcp_state_dict(sharded)
        writer = FileSystemWriterAsync(f"{uri}/{attempt}")
        writer.mcore_data = extra
        planner = MCoreSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        args, *_ = save_state_dict_async_plan(state, writer, planner=planner)
        save_fn, _, save_args = writer.get_save_function_and_args()
        assert save_fn is not None
        if attempt == "ok":
            queue = AsyncCallsQueue()
            finalize = [lambda args=args: save_state_dict_async_finalize(*args)]
            queue.schedule_async_request(AsyncRequest(save_fn, save_args, finalize))
            assert queue.maybe_finalize_async_calls(blocking=True) == [0]
            request = {
                "w": ShardedTensor.from_rank_offsets(
                    "w", torch.empty(8, 2), (1, rank % 2, 2), replica_id=rank // 2
                ),
                "o": ShardedObject("rng", None, (world,), ((rank + 1) % world,)),
            }
            loaded = TorchDistLoadShardedStrategy().load(request, f"{uri}/ok")
            assert torch.equal(loaded["w"], full.chunk(2, dim=1)[rank % 2])
            assert loaded["o"] == {"rank": (rank + 1) % world}
            outcome.append("saved and resharded")
            continue
        if rank == 2:
            save_args[1][0] = ("../outside", save_args[1][0][1])  # an invalid object path
        try:
            save_fn(*save_args)
        except CheckpointingException:
            assert rank == 2
        try:
            save_state_dict_async_finalize(*args)
        except CheckpointException as exc:
            outcome.append(f"failed ranks {sorted(exc.failures)}" if rank == 0 else "failed")
    return outcome


def test_async_dcp_save_on_four_gloo_ranks(rank_pool, tmp_path: Path) -> None:
    results = rank_pool.run(_async_dcp_scenario, str(tmp_path / "ckpt"))
    assert results[0] == ["saved and resharded", "failed ranks [2]"]
    assert results[1:] == [["saved and resharded", "failed"]] * 3
    assert not (tmp_path / "ckpt" / "fail" / ".metadata").exists()


def test_megatron_015_metadata_class_is_read_without_megatron(tmp_path: Path) -> None:
    """Megatron-Core 0.15 pickles ``.metadata`` as its MCoreMetadata: such a file loads
    through cloudckpt's class when Megatron-Core is not installed (as here)."""
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(
        {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, uri, ("torch_dist", 1)
    )
    plain = FileSystemReader(uri).read_metadata()
    assert type(plain) is Metadata  # cloudckpt writes no class of its own into .metadata
    listed = TorchDistLoadShardedStrategy().load_tensors_metadata(Path(uri), plain)
    assert listed["w"].global_shape == (4,) and listed["w"].data is None  # as Megatron
    fields = {k: v for k, v in vars(plain).items() if k != "mcore_data"}  # cloudckpt's records
    mcore = torch_strategies.MCoreMetadata(mcore_data={"w": {}}, **fields)
    raw = pickle.dumps(mcore, protocol=2).replace(
        b"ccloudckpt.formats.dcp.storage\nMCoreMetadata",
        b"cmegatron.core.dist_checkpointing.strategies.torch\nMCoreMetadata",
    )
    assert b"megatron.core" in raw
    (tmp_path / "ckpt" / ".metadata").write_bytes(raw)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}
    loaded = TorchDistLoadShardedStrategy().load(request, uri)
    assert torch.equal(loaded["w"], torch.arange(4.0))


def _strategy_async_save_scenario(rank: int, world: int, uri: str) -> list[bool]:
    """TorchDistSaveShardedStrategy.async_save three times with cached_metadata=True: the
    third save skips planning and reuses the coordinator's metadata; all load back."""
    strategy = torch_strategies.TorchDistSaveShardedStrategy(
        "torch_dist", 1, cached_metadata=True, separation_hint="optimizer."
    )
    queue = AsyncCallsQueue()
    reuse = []
    for step in range(3):
        value = _reference(f"step{step}", (world * 2, 3), torch.float32)
        sharded = {
            "w": ShardedTensor.from_rank_offsets(
                "w", value.chunk(world)[rank].clone(), (0, rank, world)
            ),
            "optimizer.m": ShardedTensor.from_rank_offsets(
                "optimizer.m", value.chunk(world)[rank] * 2, (0, rank, world)
            ),
        }
        queue.schedule_async_request(strategy.async_save(sharded, f"{uri}/{step}"))
        reuse.append(strategy.validated_cache_reuse)
        assert queue.maybe_finalize_async_calls(blocking=True) == [step]
        request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(world * 2, 3))}
        loaded = TorchDistLoadShardedStrategy().load(request, f"{uri}/{step}")
        assert torch.equal(loaded["w"], value)
    return reuse


def test_torch_dist_async_save_with_cached_plans_on_four_gloo_ranks(
    rank_pool, tmp_path: Path
) -> None:
    results = rank_pool.run(_strategy_async_save_scenario, str(tmp_path / "ckpt"))
    assert results == [[False, True, True]] * 4
    md = FileSystemReader(str(tmp_path / "ckpt" / "2")).read_metadata()
    paths = {fqn_is_opt: set() for fqn_is_opt in (True, False)}
    for index, info in md.storage_data.items():
        paths[index.fqn.startswith("optimizer.")].add(info.relative_path)
    assert paths[True] and paths[False] and not paths[True] & paths[False]


# -- against the Megatron-Core 0.15.3 package itself (the compat environment) --------------

# module of Megatron-Core 0.15's dist_checkpointing -> cloudckpt's
MCORE_MODULES = {
    "utils": "cloudckpt.utils",
    "optimizer": "cloudckpt.optimizer",
    "exchange_utils": "cloudckpt.exchange_utils",
    "core": "cloudckpt.core",
    "validation": "cloudckpt.validation",
    "strategies/resharding": "cloudckpt.strategies.resharding",
    "strategies/torch": "cloudckpt.strategies.torch",
    "strategies/filesystem_async": "cloudckpt.strategies.filesystem_async",
    "strategies/state_dict_saver": "cloudckpt.strategies.state_dict_saver",
    "strategies/async_utils": "cloudckpt.strategies.async_utils",
    "strategies/fully_parallel": "cloudckpt.strategies.fully_parallel",
    "serialization": "cloudckpt.serialization",
}
# names docs/megatron-compat.md lists as "no" (with the reason there), or owned elsewhere
NOT_PROVIDED = {
    "cloudckpt.utils": {"__LOGGER_NAME_STACK", "__LOGGER_STACK"},
    "cloudckpt.validation": {
        "validate_integrity_and_strict_load",
        "verify_checkpoint_and_load_strategy",
        "adjust_non_strict_load",
        "_determine_missing_and_unexpected_keys",
        "maybe_report_missing_and_unexpected_keys",
        "_validate_common_state_dict",
        "_validate_sharding_for_key",
        "_compute_shards_access",
        "_validate_sharding_for_key_flattened",
        "_validate_objects_for_key",
        "validate_sharded_objects_handling",
    },
    "cloudckpt.strategies.torch": {
        "MSC_PREFIX",
        "_metadata_fn",
        "_unwrap_pyt_sharded_tensor",
        "_replace_state_dict_keys_with_sharded_keys",
        "_replace_sharded_keys_with_state_dict_keys",
        "_restore_dict_types",
        "_get_filesystem_reader",
    },
    "cloudckpt.strategies.filesystem_async": {
        "WriteBucket",
        "_get_write_results_queue",
        "FileSystemWriterAsync.preload_tensors",
        "FileSystemWriterAsync.write_preloaded_data_multiproc",
        "FileSystemWriterAsync.write_preloaded_data",
        "FileSystemWriterAsync.prepare_decentralized_global_plan",
        "_split_by_size_and_type",
        "_split_by_separation_hint",
        "_item_size",
        "_process_memory",
    },
    "cloudckpt.strategies.async_utils": {"PersistentAsyncCaller.async_loop", "_ActiveAsyncRequest"},
}
# parameters named differently (called positionally by Megatron-Core), see the doc
RENAMED = {
    "TorchDistLoadShardedStrategy.check_backend_compatibility",
    "FullyParallelLoadStrategyWrapper.check_backend_compatibility",
    "validate_sharding_integrity",
}


def _mcore_names(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | None]]:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            yield node.name, None
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name):
                yield target.id, None


def _mcore_params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
    return [n for n in names if n not in ("self", "cls")]


@pytest.fixture(scope="module")
def mcore15_package() -> Path:
    from tests.test_megatron_compat import megatron_package  # noqa: PLC0415 - builds the env

    return megatron_package("mcore-0.15") / "core" / "dist_checkpointing"


@pytest.mark.compat
@pytest.mark.parametrize("mcore_module", sorted(MCORE_MODULES))
def test_every_megatron_015_name_is_provided(mcore15_package: Path, mcore_module: str) -> None:
    ours_name = MCORE_MODULES[mcore_module]
    tree = ast.parse((mcore15_package / f"{mcore_module}.py").read_text())
    missing, mismatched, checked = [], [], 0
    for name, fn in _mcore_names(tree):
        if name in NOT_PROVIDED.get(ours_name, set()):
            continue
        try:
            obj = _resolve(ours_name, name)
        except AttributeError:
            missing.append(name)
            continue
        checked += 1
        if fn is None or name in RENAMED or not callable(obj):
            continue  # data, a renamed parameter, or a property
        ours_params = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
        remaining = iter(ours_params)
        if not all(p in remaining for p in _mcore_params(fn)):
            mismatched.append((name, _mcore_params(fn), ours_params))
    assert not missing and not mismatched, (missing, mismatched)
    assert checked >= 3


@pytest.mark.compat
def test_megatron_core_015_imports_with_cloudckpt_in_place(
    mcore15_package: Path, tmp_path: Path
) -> None:
    script = tmp_path / "redirect.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib, importlib.abc, importlib.util, sys
            PREFIX = "megatron.core.dist_checkpointing"

            class Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
                def find_spec(self, name, path=None, target=None):
                    if name == PREFIX or name.startswith(PREFIX + "."):
                        return importlib.util.spec_from_loader(name, self)
                    return None
                def create_module(self, spec):
                    return importlib.import_module("cloudckpt" + spec.name[len(PREFIX):])
                def exec_module(self, module):
                    pass

            sys.meta_path.insert(0, Redirect())
            import megatron.core
            from megatron.core.transformer.transformer_layer import TransformerLayer
            from megatron.core.optimizer import distrib_optimizer
            from megatron.core.models.gpt import GPTModel
            from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
            import cloudckpt.utils
            assert replace_prefix_for_sharding is cloudckpt.utils.replace_prefix_for_sharding
            print("IMPORTED", megatron.core.__version__)
            """
        )
    )
    python = mcore15_package.parents[5] / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        [str(python), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert proc.stdout.strip().splitlines()[-1:] == ["IMPORTED 0.15.3"], proc.stderr[-4000:]


def test_get_empty_tensor_for_exchange_as_megatron() -> None:
    """A needed shard is received into its own data (recorded as loaded); an unneeded
    one into a fresh empty tensor of its shape and dtype, with no original device."""
    from cloudckpt.exchange_utils import _get_empty_tensor_for_exchange  # noqa: PLC0415

    needed = ShardedTensor.from_rank_offsets("a", torch.zeros(3))
    other = ShardedTensor.from_rank_offsets("b", torch.zeros(2, 2, dtype=torch.float64))
    loaded: dict[Any, torch.Tensor] = {}
    got, device = _get_empty_tensor_for_exchange("a", {"a": needed}, {}, loaded)
    assert got is needed.data and device == torch.device("cpu") and loaded["a"] is got
    empty, none = _get_empty_tensor_for_exchange("b", {}, {"b": other.without_data()}, loaded)
    assert none is None and empty.shape == (2, 2) and empty.dtype == torch.float64
    assert set(loaded) == {"a"}
