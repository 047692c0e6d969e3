"""cloudckpt's ``gpt_checkpoint_interop`` against Megatron-Core 0.19's own, on the same
inputs (run in the ``mcore-0.19`` environment, cloudckpt from ``PYTHONPATH``).

    python tests/compat/interop_check.py --out RESULT.json

For each hybrid layer pattern: the layer maps (or the error: ``ValueError`` both), a
model-like sharded state dict retargeted in place (each entry's type, key, global
shape and offset, axis fragmentations, prepended axes), and an fsdp_dtensor state dict
retargeted with and without checkpoint keys. Built once with each library's own
mapping classes; the JSON holds both sides for the test to compare.
"""

from __future__ import annotations

import argparse
import importlib
import json
import warnings
from typing import Any

import torch

PATTERNS = ["*-*-", "M*-M*-", "M*E|M*E", "*-|*-|*-", "M*-/M*", "M*G-", "*-E*", "**-", "", "MM"]


def _describe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    name = type(value).__name__
    if name == "LocalNonpersistentObject":
        return [name]
    fields = ("key", "global_shape", "global_offset", "axis_fragmentations", "prepend_axis_num")
    return [name, *[list(getattr(value, f)) if isinstance(getattr(value, f, None), tuple)
                    else getattr(value, f, None) for f in fields]]  # fmt: skip


def _state(mapping: Any, layers: str) -> dict[str, Any]:
    tensor, obj = mapping.ShardedTensor, mapping.ShardedObject
    out: dict[str, Any] = {}
    for i, symbol in enumerate(layers):
        sub = {"attn": "self_attention.linear_qkv.weight", "mlp": "mlp.linear_fc1.weight"}
        name = sub["attn"] if symbol == "*" else sub["mlp"] if symbol in "-E" else "mixer.A_log"
        out[f"l{i}"] = tensor.from_rank_offsets(
            f"decoder.layers.{i}.{name}", torch.zeros(4, 2), (1, 0, 2), replica_id=(0, 0, 0)
        )
        out[f"x{i}"] = obj(f"decoder.layers.{i}.{name}._extra_state", None, (1,), (0,))
    out["norm"] = tensor.from_rank_offsets("decoder.final_norm.weight", torch.zeros(3))
    out["extra"] = obj("output_layer._extra_state", None, (1,), (0,))
    out["opt"] = tensor.from_rank_offsets(
        "optimizer.state.exp_avg.decoder.layers.0.mixer.A_log", torch.zeros(2)
    )
    return out


def _fsdp(layers: str) -> dict[str, Any]:
    model = {f"module.decoder.layers.{i}.w": i for i in range(len(layers))}
    model["module.decoder.final_norm.weight"] = -1
    model["module.output_layer._extra_state"] = -2
    return {"model": model, "optimizer": {"state": {k: {"exp_avg": v} for k, v in model.items()}}}


def _run(prefix: str, pattern: str) -> dict[str, Any]:
    interop = importlib.import_module(f"{prefix}.gpt_checkpoint_interop")
    mapping = importlib.import_module(f"{prefix}.mapping")
    try:
        maps = interop.gpt_compatible_layer_maps(pattern)
    except ValueError as exc:
        return {"error": type(exc).__name__}
    layers = pattern.split("/", maxsplit=1)[0].replace("|", "")
    state = _state(mapping, layers)
    interop.retarget_sharded_state_dict_to_gpt_checkpoint(state, maps)
    fsdp = _fsdp(layers)
    stored = ["model.module.decoder.layers.0.w", "model.decoder.final_layernorm.weight"]
    return {
        "maps": [
            sorted(maps.attention_to_gpt.items()),
            sorted(maps.mlp_to_gpt.items()),
            sorted(maps.fresh_init),
            maps.num_gpt_layers,
        ],
        "sharded": _describe(state),
        "fsdp": _describe(interop.retarget_fsdp_state_dict_to_gpt_checkpoint(fsdp, maps)),
        "fsdp_keys": _describe(
            interop.retarget_fsdp_state_dict_to_gpt_checkpoint(
                fsdp["model"], maps, stored, checkpoint_prefix="model"
            )
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = parser.parse_args().out
    warnings.filterwarnings("ignore")
    sides = {"megatron": "megatron.core.dist_checkpointing", "cloudckpt": "cloudckpt"}
    result = {side: {p: _run(prefix, p) for p in PATTERNS} for side, prefix in sides.items()}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
