"""``cloudckpt.gpt_checkpoint_interop`` (Megatron-Core 0.19's): a GPT checkpoint loaded
into a hybrid model's run, and the same answers as Megatron-Core's own module."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt.gpt_checkpoint_interop import (
    GPTCompatLayerMaps,
    gpt_compatible_layer_maps,
    retarget_fsdp_state_dict_to_gpt_checkpoint,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)
from cloudckpt.mapping import LocalNonpersistentObject, ShardedTensor

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_layer_maps_pair_the_ith_attention_and_mlp_with_gpt_layer_i() -> None:
    maps = gpt_compatible_layer_maps("M*-|M*-")
    assert maps == GPTCompatLayerMaps({1: 0, 4: 1}, {2: 0, 5: 1}, frozenset({0, 3}), 2)
    assert gpt_compatible_layer_maps("*E*E").mlp_to_gpt == {1: 0, 3: 1}


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("", "empty"),
        ("M*-/M*", "multi-token-prediction"),
        ("M*G-", "['G']"),
        ("*-E*", "both dense"),
        ("**-", "2 attention"),
        ("MM", "0 attention"),
    ],
)
def test_patterns_a_gpt_checkpoint_cannot_fill_are_refused(pattern: str, words: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        gpt_compatible_layer_maps(pattern)
    assert words in str(info.value)


def _gpt_state(fill: float) -> dict[str, ShardedTensor]:
    """What a 2-layer GPT saves: each sub-module's layers stacked along a layer axis."""
    out = {}
    for layer in range(2):
        for name in ("self_attention.w", "mlp.w"):
            value = torch.full((3, 2), fill + layer + (0.5 if name == "mlp.w" else 0.0))
            out[f"{layer}.{name}"] = ShardedTensor.from_rank_offsets(
                f"decoder.layers.{name}", value, (0, layer, 2), prepend_axis_num=1
            )
    out["norm"] = ShardedTensor.from_rank_offsets(
        "decoder.final_layernorm.weight", torch.full((3,), fill)
    )
    return out


def test_a_hybrid_run_loads_a_gpt_checkpoint_through_the_retargeted_state_dict(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "gpt")
    cloudckpt.save(_gpt_state(10.0), uri)
    # hybrid "M*-M*-": layers 1, 2 from GPT layer 0; 4, 5 from GPT layer 1; 0, 3 fresh
    names = {1: "self_attention.w", 2: "mlp.w", 4: "self_attention.w", 5: "mlp.w"}
    hybrid = {
        f"decoder.layers.{i}": ShardedTensor.from_rank_offsets(
            f"decoder.layers.{i}.{names.get(i, 'mixer.w')}", torch.zeros(3, 2)
        )
        for i in range(6)
    }
    hybrid["decoder.final_norm"] = ShardedTensor.from_rank_offsets(
        "decoder.final_norm.weight", torch.zeros(3)
    )
    fresh = torch.full((3, 2), -1.0)
    hybrid["decoder.layers.0"].data = fresh
    retarget_sharded_state_dict_to_gpt_checkpoint(hybrid, gpt_compatible_layer_maps("M*-M*-"))
    assert isinstance(hybrid["decoder.layers.0"], LocalNonpersistentObject)
    loaded = cloudckpt.load(hybrid, uri)
    assert loaded["decoder.layers.0"] is fresh  # kept, never read
    for index, value in {1: 10.0, 2: 10.5, 4: 11.0, 5: 11.5}.items():
        assert torch.equal(loaded[f"decoder.layers.{index}"], torch.full((3, 2), value)), index
    assert torch.equal(loaded["decoder.final_norm"], torch.full((3,), 10.0))


def test_fsdp_keys_are_renumbered_and_fresh_ones_left_out() -> None:
    maps = gpt_compatible_layer_maps("M*-M*-")
    state = {
        "module.decoder.layers.4.self_attention.q": 1,
        "module.decoder.layers.3.mixer.A": 2,
        "module.output_layer._extra_state": 3,
        "optimizer": {"state": {"decoder.layers.5.mlp.w": {"exp_avg": 4}}},
    }
    assert retarget_fsdp_state_dict_to_gpt_checkpoint(state, maps) == {
        "module.decoder.layers.1.self_attention.q": 1,
        "optimizer": {"state": {"decoder.layers.1.mlp.w": {"exp_avg": 4}}},
    }
    # the checkpoint's own keys name the wrapper depth; a key it lacks is left out
    stored = ["m.module.module.decoder.layers.1.self_attention.q"]
    out = retarget_fsdp_state_dict_to_gpt_checkpoint(
        {"module.decoder.layers.4.self_attention.q": 1, "decoder.final_norm.weight": 2},
        maps,
        stored,
        checkpoint_prefix="m",
    )
    assert out == {"module.module.decoder.layers.1.self_attention.q": 1}


def test_a_layer_outside_the_pattern_is_an_error_naming_the_entry() -> None:
    state = {"x": ShardedTensor.from_rank_offsets("decoder.layers.9.mlp.w", torch.zeros(2))}
    with pytest.raises(ValueError, match=r"decoder\.layers\.9\.mlp\.w.*hybrid layer 9"):
        retarget_sharded_state_dict_to_gpt_checkpoint(state, gpt_compatible_layer_maps("*-"))


@pytest.mark.compat
@pytest.mark.timeout(1200)
def test_the_same_answers_as_megatron_cores_own(tmp_path: Path) -> None:
    from tests.test_megatron_compat import _build  # noqa: PLC0415 - builds the env

    env = _build("mcore-0.19")
    out = tmp_path / "interop.json"
    script = REPO_ROOT / "tests" / "compat" / "interop_check.py"
    proc = subprocess.run(
        [str(env.python), str(script), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())
    megatron, ours = result["megatron"], result["cloudckpt"]
    assert megatron.keys() == ours.keys() and len(megatron) >= 10
    for pattern, answer in megatron.items():
        assert ours[pattern] == answer, pattern
    accepted = [p for p, a in megatron.items() if "error" not in a]
    assert len(accepted) >= 4 and len(megatron) - len(accepted) >= 5
