"""Load a GPT checkpoint into a hybrid (Mamba / attention / MLP) model's run
(Megatron-Core 0.19's ``gpt_checkpoint_interop``).

A GPT checkpoint stores each transformer layer's attention and MLP under one
homogeneous key, ``decoder.layers.<sub-module>``, with the layer as a prepended sharding
axis. A hybrid model gives every sub-block its own layer index, from a layer pattern
such as ``"M*-M*-"`` (``M`` Mamba, ``*`` attention, ``-`` dense MLP, ``E`` MoE MLP, ``|``
pipeline-stage boundaries, ``/`` then multi-token-prediction depths). Nothing is
rewritten in storage: the hybrid run's sharded state dict is pointed at the GPT keys
before an ordinary :func:`cloudckpt.load`, which then reshards as usual.

* :func:`gpt_compatible_layer_maps`: the i-th attention and the i-th MLP position of
  the pattern come from GPT layer i; Mamba positions keep their fresh initialisation.
* :func:`retarget_sharded_state_dict_to_gpt_checkpoint` (torch_dist): in place, each
  entry of a GPT-sourced layer gets the GPT key and the GPT layer as a new leading
  sharding axis; entries of fresh layers, and the hybrid model's
  ``output_layer._extra_state`` (which GPT checkpoints leave out), become
  :class:`~cloudckpt.mapping.LocalNonpersistentObject` (kept, never read);
  ``decoder.final_norm.`` is GPT's ``decoder.final_layernorm.``. The optimizer's
  model-space sharded state dict embeds the same keys and is retargeted the same way.
* :func:`retarget_fsdp_state_dict_to_gpt_checkpoint` (fsdp_dtensor): a new nested
  state dict whose parameter-name keys are GPT's (the layer index renumbered), fresh
  entries left out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cloudckpt.dict_utils import dict_list_map_inplace
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
_PIPE, _MTP = "|", "/"
#: Layer symbols a GPT checkpoint can fill (attention, dense or MoE MLP) or that start fresh.
_TRANSLATABLE = frozenset({MAMBA, ATTENTION, MLP, MOE})
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.")
_FINAL_NORM = ("decoder.final_norm.", "decoder.final_layernorm.")
_GPT_OMITS = ("output_layer._extra_state",)


@dataclass(frozen=True)
class GPTCompatLayerMaps:
    """Which GPT layer each layer of a hybrid pattern loads from.

    Attributes:
        attention_to_gpt: hybrid layer index of the i-th attention position -> i.
        mlp_to_gpt: hybrid layer index of the i-th MLP position ('-' or 'E') -> i.
        fresh_init: hybrid layer indices with no GPT counterpart (Mamba).
        num_gpt_layers: the layers the GPT checkpoint must have.
    """

    attention_to_gpt: Mapping[int, int]
    mlp_to_gpt: Mapping[int, int]
    fresh_init: frozenset[int]
    num_gpt_layers: int

    def gpt_layer(self, hybrid_idx: int, what: str) -> int | None:
        """The GPT layer of hybrid layer ``hybrid_idx``; None for a fresh layer.

        Raises:
            ValueError: the layer is not in the pattern (``what`` names the entry).
        """
        if hybrid_idx in self.fresh_init:
            return None
        for mapping in (self.attention_to_gpt, self.mlp_to_gpt):
            if hybrid_idx in mapping:
                return mapping[hybrid_idx]
        raise ValueError(
            f"{what} refers to hybrid layer {hybrid_idx}, which the hybrid layer pattern "
            "the GPT layer maps were made from does not have: the pattern and the model "
            "do not match"
        )


def _positions(layers: str, symbol: str) -> dict[int, int]:
    """{index in ``layers`` of the i-th ``symbol``: i}."""
    found = [i for i, s in enumerate(layers) if s == symbol]
    return {hybrid: gpt for gpt, hybrid in enumerate(found)}


def gpt_compatible_layer_maps(hybrid_layer_pattern: str) -> GPTCompatLayerMaps:
    """The hybrid -> GPT layer maps of a hybrid layer pattern.

    Raises:
        ValueError: the pattern cannot be paired one to one with a GPT checkpoint's
            layers: it is empty, has multi-token-prediction depths (no GPT weights for
            them), a layer type other than M * - E, both dense and MoE MLPs, or not as
            many attention as MLP positions (or none).
    """
    main, *mtp = hybrid_layer_pattern.split(_MTP)
    if any(mtp):
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r} has multi-token-prediction "
            f"layers ({_MTP}{_MTP.join(mtp)}), which a GPT checkpoint has no weights for: "
            "leave them out of the pattern to load a GPT checkpoint"
        )
    layers = main.replace(_PIPE, "")
    if not layers:
        raise ValueError("the hybrid layer pattern is empty: set --hybrid-layer-pattern")
    unknown = sorted(set(layers) - _TRANSLATABLE)
    if unknown:
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r} has layer types {unknown} "
            f"that a GPT checkpoint cannot fill: only {sorted(_TRANSLATABLE)} ('M' layers "
            "keep their fresh initialisation)"
        )
    dense, moe = _positions(layers, MLP), _positions(layers, MOE)
    if dense and moe:
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r} has both dense ('-') and MoE "
            "('E') MLPs; a GPT checkpoint has one kind of MLP in every layer"
        )
    attention, mlp = _positions(layers, ATTENTION), moe or dense
    if not attention or len(attention) != len(mlp):
        raise ValueError(
            f"hybrid layer pattern {hybrid_layer_pattern!r} has {len(attention)} attention "
            f"('*') and {len(mlp)} MLP ('-'/'E') layers; each GPT layer gives one of each, "
            "so the pattern needs as many of both, and at least one"
        )
    return GPTCompatLayerMaps(
        attention_to_gpt=attention,
        mlp_to_gpt=mlp,
        fresh_init=frozenset(_positions(layers, MAMBA)),
        num_gpt_layers=len(attention),
    )


def _with_layer_axis(entry: Any, gpt_idx: int, layers: int) -> Any:
    """``entry`` sharded along a new leading axis of ``layers`` GPT layers, at ``gpt_idx``
    (what a GPT model's homogeneous layers give their entries)."""
    if isinstance(entry, ShardedTensor):
        entry.global_shape = (layers, *entry.global_shape)
        entry.global_offset = (gpt_idx, *entry.global_offset)
        if entry.axis_fragmentations is not None:  # None: no regular grid, still none
            entry.axis_fragmentations = (layers, *entry.axis_fragmentations)
        entry.prepend_axis_num += 1
    elif isinstance(entry, ShardedObject):
        if (entry.global_shape, entry.global_offset) == ((1,), (0,)):  # no axis of its own
            entry.global_shape, entry.global_offset = (layers,), (gpt_idx,)
        else:
            entry.global_shape = (layers, *entry.global_shape)
            entry.global_offset = (gpt_idx, *entry.global_offset)
    elif isinstance(entry, ShardedTensorFactory):
        build = entry.build_fn

        def build_with_axis(key: str, data: Any, replica_id: Any, flattened_range: Any) -> Any:
            built = build(key, data, replica_id, flattened_range)
            dict_list_map_inplace(lambda sub: _with_layer_axis(sub, gpt_idx, layers), built)
            return built

        entry.build_fn = build_with_axis
    return entry


def _final_norm(key: str) -> str:
    hybrid, gpt = _FINAL_NORM
    return key.replace(hybrid, gpt, 1)


def retarget_sharded_state_dict_to_gpt_checkpoint(
    sharded_state_dict: ShardedStateDict, layer_maps: GPTCompatLayerMaps
) -> None:
    """Point a hybrid model's (or its distributed optimizer's) sharded state dict at a
    GPT checkpoint, in place: only the entries' keys and sharding axes change, the
    nesting (what ``load_state_dict`` reads afterwards) stays the hybrid model's."""

    def retarget(entry: Any) -> Any:
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_GPT_OMITS):
            return LocalNonpersistentObject(entry.data)
        match = _LAYER_KEY.search(entry.key)
        if match is None:
            entry.key = _final_norm(entry.key)
            return entry
        gpt_idx = layer_maps.gpt_layer(int(match.group(1)), f"sharded entry {entry.key!r}")
        if gpt_idx is None:
            return LocalNonpersistentObject(entry.data)
        entry.key = f"{entry.key[: match.start()]}decoder.layers.{entry.key[match.end() :]}"
        return _with_layer_axis(entry, gpt_idx, layer_maps.num_gpt_layers)

    dict_list_map_inplace(retarget, sharded_state_dict)


def _gpt_key(key: Any, layer_maps: GPTCompatLayerMaps, stored: frozenset[str] | None) -> Any:
    """The GPT checkpoint's name for one fsdp_dtensor parameter key; None: left out."""
    if not isinstance(key, str):
        return key
    if key.endswith(_GPT_OMITS):
        return None
    match = _LAYER_KEY.search(key)
    if match is not None:
        gpt_idx = layer_maps.gpt_layer(int(match.group(1)), f"FSDP state dict entry {key!r}")
        if gpt_idx is None:
            return None
        key = f"{key[: match.start()]}decoder.layers.{gpt_idx}.{key[match.end() :]}"
    key = _final_norm(key)
    if stored is not None:
        # the two models may wrap their modules to different depths ("module.module.");
        # the checkpoint's own key names the depth, when exactly one matches
        bare = re.sub(r"^(?:module\.)+", "", key)
        pattern = re.compile(rf"(?<![A-Za-z0-9_])((?:module\.)*{re.escape(bare)})(?:\.|$)")
        found = {m.group(1) for k in stored if (m := pattern.search(k)) is not None}
        if len(found) == 1:
            key = found.pop()
    return key


def retarget_fsdp_state_dict_to_gpt_checkpoint(
    state_dict: Mapping[Any, Any],
    layer_maps: GPTCompatLayerMaps,
    checkpoint_keys: Iterable[str] | None = None,
    checkpoint_prefix: str = "",
) -> dict[Any, Any]:
    """A new fsdp_dtensor model or optimizer state dict under the GPT checkpoint's keys.

    Every mapping key that names a parameter is translated, at any depth (the
    optimizer's ``state`` and ``param_to_group_meta``); the leaves (DTensors) are the
    same objects. With ``checkpoint_keys`` (the checkpoint's flattened keys, under
    ``checkpoint_prefix``), a leaf the checkpoint does not hold is left out.
    """
    stored = None if checkpoint_keys is None else frozenset(checkpoint_keys)

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            out: dict[Any, Any] = {}
            for key, child in value.items():
                new_key = _gpt_key(key, layer_maps, stored)
                if new_key is None:
                    continue
                child_path = f"{path}.{new_key}" if path else str(new_key)
                nested = isinstance(child, (Mapping, list, tuple))
                if stored is None or nested or child_path in stored:
                    out[new_key] = walk(child, child_path)
            return out
        if isinstance(value, (list, tuple)):
            walked = [walk(child, f"{path}.{i}") for i, child in enumerate(value)]
            return walked if isinstance(value, list) else tuple(walked)
        return value

    result: dict[Any, Any] = walk(state_dict, checkpoint_prefix)
    return result


__all__: list[str] = [
    "GPTCompatLayerMaps",
    "gpt_compatible_layer_maps",
    "retarget_fsdp_state_dict_to_gpt_checkpoint",
    "retarget_sharded_state_dict_to_gpt_checkpoint",
]
