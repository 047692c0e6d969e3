"""Megatron-Core's own GPT model checkpointed by cloudckpt in its place (0.15.3, 0.19.2).

    PYTHONPATH=REPO python tests/compat/mcore_dropin.py save --uri s3://b/ckpt --world 4 \
        --tp 2 --out R
    PYTHONPATH=REPO python tests/compat/mcore_dropin.py load --uri s3://b/ckpt --world 4 \
        --tp 4 --out R

Runs in the ``mcore-0.15-dropin`` or ``mcore-0.19`` environment (Megatron-Core plus
cloudckpt's runtime dependencies; cloudckpt itself comes from the repository on
``PYTHONPATH``). Each rank
installs :func:`cloudckpt.megatron.install` first, so every ``megatron.core.
dist_checkpointing`` import - Megatron-Core's own, in ``megatron.core`` and in the model
code, and this script's - gets cloudckpt. Then, on gloo CPU ranks:

* ``save``: Megatron's parallel state with ``--tp`` tensor-parallel ranks (the rest
  data-parallel), a tiny :class:`GPTModel` with the local layer spec (CPU
  initialisation), one Adam step on deterministic gradients, and the sharded state dict
  of the model (``GPTModel.sharded_state_dict``) and of the optimizer in two forms:
  Megatron's regular optimizer form (``get_param_id_to_sharded_param_map`` +
  ``optim_state_to_sharding_state``, what ``FP32Optimizer.sharded_state_dict`` does) and
  the distributed optimizer's ``fully_sharded_model_space`` form (each data-parallel rank
  holds a flat range of every parameter's state, as
  ``DistributedOptimizer.sharded_param_state_fs_model_space`` builds it). It is saved
  with ``megatron.core.dist_checkpointing.save`` (that is, cloudckpt) to ``--uri``
  (with 0.19, also ``async_strategy="nvrx"`` and ``verify_integrity=True``, as its training
  loop passes them; the load then verifies integrity and uses ``TorchDistLoadShardedStrategy(
  cache_metadata=True, stream_ckpt_dequant=True)``).
  Every rank reports the digest of each of its shards.
* ``load``: the same in the ``--tp`` layout given (another TP x DP split), loaded with
  ``dist_checkpointing.load``, the model's loaded state put into the model with
  ``load_state_dict``, and every loaded shard's digest reported; the pytest side
  compares each with the slice of the saved tensors the shard's metadata names.

Megatron's own optimizers cannot be built on a CPU-only torch: ``get_megatron_optimizer``
with ``use_distributed_optimizer=True`` fails in ``MixedPrecisionOptimizer.__init__``
(``torch.tensor([0], dtype=torch.int, device='cuda')``, optimizer.py line 477 of 0.15.3;
``DistributedOptimizer`` would next refuse CPU parameters: "Wrapped parameters must be
one of torch.cuda.FloatTensor, ..."), and with ``False`` in ``FP32Optimizer.__init__``
(``torch.tensor([1.0], device='cuda')``, line 903); both raise "Torch not compiled with
CUDA enabled" (0.19.2's create the same CUDA tensors: optimizer.py lines 698 and
1249). Megatron's ``DistributedDataParallel`` wrapper itself builds on CPU. So
the optimizer here is ``torch.optim.Adam``, with the two sharded forms above built from
Megatron's own helpers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness
import spec
import torch

import cloudckpt.megatron

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 2
SEED = 1234


def _hook() -> Any:
    cloudckpt.megatron.install()  # a no-op when installed


def _init_megatron(tp: int) -> Any:
    _hook()
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state  # noqa: PLC0415

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return parallel_state


def _model() -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    torch.manual_seed(SEED)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        tensor_model_parallel_size=_tp_size(),
        params_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )


def _tp_size() -> int:
    from megatron.core import parallel_state  # noqa: PLC0415

    return int(parallel_state.get_tensor_model_parallel_world_size())


def _adam_step(model: Any, rank: int) -> torch.optim.Adam:
    """One Adam step on gradients that depend on the parameter and, for a parameter split
    over tensor-parallel ranks, the TP rank: replicas stay identical, as the gradient
    all-reduces of real training keep them."""
    from megatron.core import parallel_state  # noqa: PLC0415

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i, param in enumerate(model.parameters()):
        split = getattr(param, "tensor_model_parallel", False)
        gen = torch.Generator().manual_seed(SEED + 100 * i + (tp_rank if split else 0))
        param.grad = torch.randn(param.shape, generator=gen)
    optimizer.step()
    return optimizer


def _regular_optimizer_state(
    optimizer: torch.optim.Adam, model: Any, model_sd: dict[str, Any]
) -> dict[str, Any]:
    """What Megatron's FP32Optimizer.sharded_state_dict builds, with Megatron's helpers."""
    from megatron.core.dist_checkpointing.optimizer import (  # noqa: PLC0415
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys="step")
    return state


def _dist_optimizer_state(optimizer: torch.optim.Adam, model_sd: dict[str, Any]) -> dict:
    """The distributed optimizer's fully_sharded_model_space form: DP rank d holds the
    d-th flat range of each parameter's Adam state (as DistributedOptimizer's
    sharded_param_state_fs_model_space maps its buffer ranges onto model params)."""
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: PLC0415

    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    by_param = {
        id(sh.data): (name, sh) for name, sh in model_sd.items() if isinstance(sh, ShardedTensor)
    }
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_param:
                continue
            name, sh = by_param[id(param)]
            numel = param.numel()
            bounds = [numel * d // dp for d in range(dp + 1)]
            flat = slice(bounds[dp_rank], bounds[dp_rank + 1])
            if flat.stop == flat.start:
                continue
            replica_id = (*sh.replica_id[:2], 0)
            state = optimizer.state[param]
            for state_key in ("exp_avg", "exp_avg_sq"):
                data = state[state_key].detach().reshape(-1)[flat].clone()
                out.setdefault(name, {})[state_key] = replace(
                    sh, key=f"optimizer.distributed.{state_key}.{sh.key}", data=data,
                    dtype=data.dtype, flattened_range=flat, replica_id=replica_id,
                )  # fmt: skip
    return out


def _sharded_state(rank: int, empty: bool) -> tuple[dict[str, Any], Any]:
    model = _model()
    if empty:
        for param in model.parameters():
            torch.nn.init.zeros_(param)
    optimizer = _adam_step(model, rank)
    model_sd = model.sharded_state_dict()
    state = {
        "model": model_sd,
        "optimizer": _regular_optimizer_state(optimizer, model, model_sd),
        "dist_optimizer": _dist_optimizer_state(optimizer, model_sd),
        "iteration": 7,
    }
    if empty:
        _zero_sharded(state)
    return state, model


def _zero_sharded(state: dict[str, Any]) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: PLC0415
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: PLC0415

    for value in nested_values(state):
        if isinstance(value, ShardedTensor) and value.data is not None:
            value.data = torch.full_like(value.data, float("nan"))


def _walk(value: Any, path: tuple[Any, ...] = ()) -> Any:
    """(path, leaf) of every leaf of nested dicts and lists."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, (*path, i))
    else:
        yield path, value


def _at(value: Any, path: list[Any]) -> Any:
    for k in path:
        value = value[k]
    return value


def _describe_shards(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ShardedTensor: its path in the state dict, key, where it sits in the
    global tensor, its digest."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: PLC0415

    out = []
    for path, sh in _walk(state):
        if not isinstance(sh, ShardedTensor):
            continue
        flat = sh.flattened_range
        out.append({
            "path": [str(p) if not isinstance(p, int) else p for p in path],
            "key": sh.key,
            "global_shape": list(sh.global_shape),
            "global_offset": list(sh.global_offset),
            "local_shape": list(sh.local_shape),
            "axis_fragmentations": list(sh.axis_fragmentations),
            "prepend_axis_num": sh.prepend_axis_num,
            "flattened_range": None if flat is None else [flat.start, flat.stop],
            "digest": spec.digest(sh.data),
        })  # fmt: skip
    return out


def _save(rank: int, world: int, uri: str, tp: int, fully_parallel: bool) -> dict[str, Any]:
    ps = _init_megatron(tp)
    from megatron.core import dist_checkpointing, package_info  # noqa: PLC0415

    state, _ = _sharded_state(rank, empty=False)
    described = _describe_shards(state)
    kwargs: dict[str, Any] = {}
    if fully_parallel:  # as megatron/training/checkpointing.py sets it up for torch_dist
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: PLC0415
            FullyParallelSaveStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: PLC0415
            TorchDistSaveShardedStrategy,
        )

        kwargs["sharded_strategy"] = FullyParallelSaveStrategyWrapper(
            TorchDistSaveShardedStrategy("torch_dist", 1),
            ps.get_data_parallel_group(with_context_parallel=True),
            True,  # ckpt_assume_constant_structure
        )
    if _is_019(package_info.__version__):  # what 0.19's training loop passes as well
        kwargs.update(async_strategy="nvrx", verify_integrity=True)
    dist_checkpointing.save(state, uri, **kwargs)
    return {
        "rank": rank,
        "megatron_version": package_info.__version__,
        "dist_checkpointing": dist_checkpointing.__name__,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "shards": described,
    }


def _is_019(version: str) -> bool:
    """Megatron-Core 0.19 or later: its save and load take 0.19's parameters."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return (major, minor) >= (0, 19)


def _load(rank: int, world: int, uri: str, tp: int, fully_parallel: bool) -> dict[str, Any]:
    ps = _init_megatron(tp)
    from megatron.core import dist_checkpointing, package_info  # noqa: PLC0415

    request, model = _sharded_state(rank, empty=True)
    kwargs: dict[str, Any] = {}
    if fully_parallel:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (  # noqa: PLC0415
            FullyParallelLoadStrategyWrapper,
        )
        from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: PLC0415
            TorchDistLoadShardedStrategy,
        )

        kwargs["sharded_strategy"] = FullyParallelLoadStrategyWrapper(
            TorchDistLoadShardedStrategy(), ps.get_data_parallel_group(with_context_parallel=True)
        )
    elif _is_019(package_info.__version__):  # as 0.19's training loop builds it
        from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: PLC0415
            TorchDistLoadShardedStrategy,
        )

        kwargs["sharded_strategy"] = TorchDistLoadShardedStrategy(
            cache_metadata=True, stream_ckpt_dequant=True
        )
    if _is_019(package_info.__version__):
        kwargs["verify_integrity"] = True
    metadata = _describe_shards(request)  # where each requested shard sits (data: NaN)
    loaded = dist_checkpointing.load(request, uri, strict="raise_all", **kwargs)
    model.load_state_dict(loaded["model"], strict=False)
    shards = [{**meta, "digest": spec.digest(_at(loaded, meta["path"]))} for meta in metadata]
    params = {name: spec.digest(p) for name, p in model.named_parameters()}
    return {
        "rank": rank,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "iteration": loaded["iteration"],
        "shards": shards,
        "model_params_match": _params_match(model, loaded["model"]),
        "n_params": len(params),
    }


def _params_match(model: Any, loaded_model: dict[str, Any]) -> bool:
    """After ``load_state_dict``, every parameter is the loaded tensor."""
    state = model.state_dict()
    return all(
        torch.equal(state[k], v)
        for k, v in loaded_model.items()
        if isinstance(v, torch.Tensor) and k in state
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("--uri", required=True)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--fully-parallel", action="store_true")
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    fn = _save if args.action == "save" else _load
    results = harness.run_ranks(fn, args.world, args.uri, args.tp, args.fully_parallel)
    with open(args.out, "w") as f:
        json.dump({"action": args.action, "world": args.world, "ranks": results}, f, indent=1)
    harness.log(f"{args.action} on {args.world} rank(s) done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
