"""A tiny GPT-like model sharded as tensor-parallel (TP) x data-parallel (DP).

The model exists in two forms:

* *full* parameters, a ``dict[str, torch.Tensor]`` keyed by Megatron-style names
  (``decoder.layers.0.self_attention.linear_qkv.weight``), used for the forward pass
  and as the reference when checking a reload;
* *local* shards, what one rank holds for a given :class:`Layout`.

:class:`ParamSpec` says how each parameter is split over TP: along ``axis`` (vocab- and
column-parallel weights split dim 0, row-parallel weights dim 1) or replicated
(``axis=None``). The fused QKV weight and bias are split per part: TP rank ``t``
holds ``cat(q_t, k_t, v_t)``, as Megatron does. Their sharded state dict goes through a
:class:`~cloudckpt.mapping.ShardedTensorFactory` that stores q, k and v as three
separate tensors, so a checkpoint can be reloaded under any TP size.

Optimizer state is sharded like Megatron's distributed optimizer: the flattened local
TP shard of each parameter is cut into contiguous, uneven ranges, one per DP rank
(:func:`dp_range`), saved with ``ShardedTensor.from_rank_offsets_flat``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as nnf

from cloudckpt.mapping import ReplicaId, ShardedStateDict, ShardedTensor, ShardedTensorFactory

QKV_PARTS = ("q", "k", "v")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the demo model.

    Attributes:
        vocab_size: tokens in the vocabulary (divisible by every TP size used).
        hidden_size: model width (divisible by ``num_heads`` and every TP size).
        num_layers: transformer layers.
        num_heads: attention heads.
        ffn_hidden_size: width of the MLP (divisible by every TP size).
        max_seq_len: rows of the learned position embedding.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int = 512
    max_seq_len: int = 64


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is shaped and split over tensor-parallel ranks.

    Attributes:
        key: global name, also the checkpoint key of the model weight.
        shape: global (full) shape.
        axis: TP split axis, or None for a parameter replicated on every TP rank.
        parts: names of equal fused parts along dim 0, each split over TP on its own
            (``("q", "k", "v")`` for the fused QKV projection); empty when not fused.
        init: ``"normal"``, ``"ones"`` or ``"zeros"``.
    """

    key: str
    shape: tuple[int, ...]
    axis: int | None
    parts: tuple[str, ...] = ()
    init: str = "normal"

    def local_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of the shard one TP rank holds."""
        if self.axis is None:
            return self.shape
        shape = list(self.shape)
        shape[self.axis] //= tp_size
        return tuple(shape)

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """One rank's place in a TP x DP grid; TP ranks are adjacent (rank = dp * tp_size + tp).

    Attributes:
        tp_size: tensor-parallel size.
        dp_size: data-parallel size.
        rank: global rank, ``0 <= rank < tp_size * dp_size``.
    """

    tp_size: int
    dp_size: int
    rank: int

    @property
    def tp_rank(self) -> int:
        """Rank within the TP group."""
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        """Rank within the DP group."""
        return self.rank // self.tp_size

    def describe(self) -> str:
        """``"TP=2 x DP=2"``."""
        return f"TP={self.tp_size} x DP={self.dp_size}"


def param_specs(cfg: GPTConfig) -> list[ParamSpec]:
    """All parameters of the model, in a fixed order."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    specs = [
        ParamSpec("embedding.word_embeddings.weight", (v, h), 0),
        ParamSpec("embedding.position_embeddings.weight", (cfg.max_seq_len, h), None),
    ]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        specs += [
            ParamSpec(p + "input_layernorm.weight", (h,), None, init="ones"),
            ParamSpec(p + "input_layernorm.bias", (h,), None, init="zeros"),
            ParamSpec(p + "self_attention.linear_qkv.weight", (3 * h, h), 0, QKV_PARTS),
            ParamSpec(p + "self_attention.linear_qkv.bias", (3 * h,), 0, QKV_PARTS, "zeros"),
            ParamSpec(p + "self_attention.linear_proj.weight", (h, h), 1),
            ParamSpec(p + "self_attention.linear_proj.bias", (h,), None, init="zeros"),
            ParamSpec(p + "pre_mlp_layernorm.weight", (h,), None, init="ones"),
            ParamSpec(p + "pre_mlp_layernorm.bias", (h,), None, init="zeros"),
            ParamSpec(p + "mlp.linear_fc1.weight", (f, h), 0),
            ParamSpec(p + "mlp.linear_fc1.bias", (f,), 0, init="zeros"),
            ParamSpec(p + "mlp.linear_fc2.weight", (h, f), 1),
            ParamSpec(p + "mlp.linear_fc2.bias", (h,), None, init="zeros"),
        ]
    specs += [
        ParamSpec("decoder.final_layernorm.weight", (h,), None, init="ones"),
        ParamSpec("decoder.final_layernorm.bias", (h,), None, init="zeros"),
        ParamSpec("output_layer.weight", (v, h), 0),
    ]
    return specs


def init_full_params(specs: Sequence[ParamSpec], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic full fp32 parameters (identical on every rank for one ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    params: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.init == "ones":
            params[spec.key] = torch.ones(spec.shape)
        elif spec.init == "zeros":
            params[spec.key] = torch.zeros(spec.shape)
        else:
            params[spec.key] = torch.randn(spec.shape, generator=gen) * 0.02
    return params


def local_shard(full: torch.Tensor, spec: ParamSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The (contiguous, copied) shard of the full tensor that TP rank ``tp_rank`` holds."""
    if spec.axis is None:
        return full.clone()
    if spec.parts:
        parts = full.chunk(len(spec.parts), dim=0)
        return torch.cat([p.chunk(tp_size, dim=0)[tp_rank] for p in parts], dim=0).contiguous()
    return full.chunk(tp_size, dim=spec.axis)[tp_rank].contiguous()


def gather_full(local: torch.Tensor, spec: ParamSpec, tp_size: int, group: Any) -> torch.Tensor:
    """Collective over the TP ``group``: rebuild the full tensor from every rank's shard.

    A replicated parameter is returned as a copy of the local one.
    """
    if spec.axis is None or tp_size == 1:
        return local.detach().clone()
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    torch_dist.all_gather(shards, local.detach().contiguous(), group=group)
    if spec.parts:
        per_rank = [s.chunk(len(spec.parts), dim=0) for s in shards]
        parts = [torch.cat([r[i] for r in per_rank], dim=0) for i in range(len(spec.parts))]
        return torch.cat(parts, dim=0)
    return torch.cat(shards, dim=spec.axis)


def dp_range(numel: int, dp_rank: int, dp_size: int) -> slice:
    """The contiguous range of a flattened shard that DP rank ``dp_rank`` owns.

    Ranges are deliberately uneven (rank ``d`` gets a share proportional to ``d + 1``),
    as a distributed optimizer's bucket boundaries make them; they tile ``[0, numel)``.
    """
    total = dp_size * (dp_size + 1) // 2

    def bound(d: int) -> int:
        return numel * (d * (d + 1) // 2) // total

    return slice(bound(dp_rank), bound(dp_rank + 1))


def local_state(
    full: Mapping[str, torch.Tensor], spec: ParamSpec, layout: Layout, flat: bool = False
) -> torch.Tensor:
    """What ``layout``'s rank holds of the full tensor ``full[spec.key]``.

    Args:
        full: full tensors by parameter key (weights, or one optimizer state).
        spec: the parameter.
        layout: the rank.
        flat: return the rank's :func:`dp_range` of the flattened TP shard (optimizer
            state) instead of the whole TP shard (weights).
    """
    shard = local_shard(full[spec.key], spec, layout.tp_rank, layout.tp_size)
    if not flat:
        return shard
    return shard.flatten()[dp_range(shard.numel(), layout.dp_rank, layout.dp_size)].clone()


def forward_loss(
    params: Mapping[str, torch.Tensor], tokens: torch.Tensor, cfg: GPTConfig
) -> torch.Tensor:
    """Next-token cross-entropy of the full model on ``tokens`` of shape (batch, seq + 1)."""
    inp, target = tokens[:, :-1], tokens[:, 1:]
    h = cfg.hidden_size
    x = nnf.embedding(inp, params["embedding.word_embeddings.weight"])
    x = x + params["embedding.position_embeddings.weight"][: inp.shape[1]]
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."
        y = nnf.layer_norm(
            x, (h,), params[p + "input_layernorm.weight"], params[p + "input_layernorm.bias"]
        )
        x = x + _attention(y, params, p + "self_attention.", cfg)
        y = nnf.layer_norm(
            x, (h,), params[p + "pre_mlp_layernorm.weight"], params[p + "pre_mlp_layernorm.bias"]
        )
        y = nnf.gelu(
            nnf.linear(y, params[p + "mlp.linear_fc1.weight"], params[p + "mlp.linear_fc1.bias"])
        )
        x = x + nnf.linear(
            y, params[p + "mlp.linear_fc2.weight"], params[p + "mlp.linear_fc2.bias"]
        )
    x = nnf.layer_norm(
        x, (h,), params["decoder.final_layernorm.weight"], params["decoder.final_layernorm.bias"]
    )
    logits = nnf.linear(x, params["output_layer.weight"])
    return nnf.cross_entropy(logits.reshape(-1, cfg.vocab_size), target.reshape(-1))


def _attention(
    x: torch.Tensor, params: Mapping[str, torch.Tensor], prefix: str, cfg: GPTConfig
) -> torch.Tensor:
    batch, seq, h = x.shape
    qkv = nnf.linear(x, params[prefix + "linear_qkv.weight"], params[prefix + "linear_qkv.bias"])
    q, k, v = (
        t.reshape(batch, seq, cfg.num_heads, h // cfg.num_heads).transpose(1, 2)
        for t in qkv.chunk(3, dim=-1)
    )
    out = nnf.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.transpose(1, 2).reshape(batch, seq, h)
    return nnf.linear(
        out, params[prefix + "linear_proj.weight"], params[prefix + "linear_proj.bias"]
    )


# -- sharded state dicts ------------------------------------------------------------


def _rank_offsets(spec: ParamSpec, layout: Layout) -> tuple[tuple[int, int, int], ...]:
    if spec.axis is None:
        return ()
    return ((spec.axis, layout.tp_rank, layout.tp_size),)


def _build_fused(
    key: str,
    data: torch.Tensor,
    replica_id: ReplicaId,
    flattened_range: slice | None,
    *,
    spec: ParamSpec,
    layout: Layout,
) -> ShardedStateDict:
    """Factory build_fn: split a fused local shard (or a flat range of it) into its parts."""
    local_shape = spec.local_shape(layout.tp_size)
    part_shape = (local_shape[0] // len(spec.parts), *local_shape[1:])
    offsets = ((0, layout.tp_rank, layout.tp_size),)
    if flattened_range is None:
        pieces = data.chunk(len(spec.parts), dim=0)
        return {
            name: ShardedTensor.from_rank_offsets(
                f"{key}.{name}", piece, *offsets, replica_id=replica_id
            )
            for name, piece in zip(spec.parts, pieces, strict=True)
        }
    part_numel = math.prod(part_shape)
    start, stop = flattened_range.start, flattened_range.stop
    built: ShardedStateDict = {}
    for i, name in enumerate(spec.parts):
        lo, hi = max(start, i * part_numel), min(stop, (i + 1) * part_numel)
        if lo < hi:
            built[name] = ShardedTensor.from_rank_offsets_flat(
                f"{key}.{name}",
                data[lo - start : hi - start],
                part_shape,
                *offsets,
                flattened_range=slice(lo - i * part_numel, hi - i * part_numel),
                replica_id=replica_id,
            )
    return built


def _merge_fused(parts: tuple[str, ...], loaded: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Factory merge_fn: concatenate the loaded parts back into the fused layout."""
    return torch.cat([loaded[name] for name in parts if name in loaded], dim=0)


def _fused_factory(
    spec: ParamSpec,
    layout: Layout,
    key: str,
    data: torch.Tensor,
    *,
    replica_id: ReplicaId,
    flattened_range: slice | None = None,
) -> ShardedTensorFactory:
    return ShardedTensorFactory(
        key=key,
        data=data,
        build_fn=functools.partial(_build_fused, spec=spec, layout=layout),
        merge_fn=functools.partial(_merge_fused, spec.parts),
        replica_id=replica_id,
        flattened_range=flattened_range,
    )


def model_sharded_state_dict(
    local: Mapping[str, torch.Tensor], specs: Sequence[ParamSpec], layout: Layout
) -> ShardedStateDict:
    """Sharded state dict of the model weights of one rank.

    DP ranks hold replicas (replica id ``(0, 0, dp_rank)``); a TP-replicated parameter
    is also replicated over TP (``(0, tp_rank, dp_rank)``). Exactly one rank holds the
    main replica of every shard.
    """
    out: ShardedStateDict = {}
    for spec in specs:
        tp_replica = layout.tp_rank if spec.axis is None else 0
        replica_id = (0, tp_replica, layout.dp_rank)
        if spec.parts:
            out[spec.key] = _fused_factory(
                spec, layout, spec.key, local[spec.key], replica_id=replica_id
            )
        else:
            out[spec.key] = ShardedTensor.from_rank_offsets(
                spec.key, local[spec.key], *_rank_offsets(spec, layout), replica_id=replica_id
            )
    return out


def optimizer_sharded_state_dict(
    states: Mapping[str, Mapping[str, torch.Tensor]], specs: Sequence[ParamSpec], layout: Layout
) -> ShardedStateDict:
    """Sharded state dict of the distributed-optimizer state of one rank.

    Args:
        states: ``param key -> state name ("exp_avg", ...) -> 1-D tensor``, the range
            :func:`dp_range` of the flattened local TP shard this DP rank owns.
        specs: the model's parameters.
        layout: this rank's place in the TP x DP grid.

    Returns:
        ``{param key: {state name: ShardedTensor | ShardedTensorFactory}}`` with keys
        ``optimizer.state.<state name>.<param key>``. DP ranks own disjoint ranges, so
        only TP-replicated parameters have non-main replicas.
    """
    out: ShardedStateDict = {}
    for spec in specs:
        local_shape = spec.local_shape(layout.tp_size)
        rng = dp_range(math.prod(local_shape), layout.dp_rank, layout.dp_size)
        replica_id = (0, layout.tp_rank if spec.axis is None else 0, 0)
        entry: ShardedStateDict = {}
        for name, flat in states[spec.key].items():
            key = f"optimizer.state.{name}.{spec.key}"
            if spec.parts:
                entry[name] = _fused_factory(
                    spec, layout, key, flat, replica_id=replica_id, flattened_range=rng
                )
            else:
                entry[name] = ShardedTensor.from_rank_offsets_flat(
                    key,
                    flat,
                    local_shape,
                    *_rank_offsets(spec, layout),
                    flattened_range=rng,
                    replica_id=replica_id,
                )
        out[spec.key] = entry
    return out


def checkpoint_tensor_keys(specs: Sequence[ParamSpec], state_names: Sequence[str]) -> list[str]:
    """Keys of the global tensors a checkpoint of model + optimizer state holds."""
    keys: list[str] = []
    for prefix in ["", *(f"optimizer.state.{n}." for n in state_names)]:
        for spec in specs:
            base = prefix + spec.key
            keys += [f"{base}.{p}" for p in spec.parts] if spec.parts else [base]
    return keys
