"""A synthetic GPT-like sharded state for the benchmarks, built on each rank.

The ranks form a tensor-parallel (TP) x data-parallel (DP) grid: TP is 2 for an even
world size, else 1. Every layer has the tensors of a transformer block, in bf16:
attention QKV and MLP FC1 split along dim 0 across TP, attention projection and FC2
split along dim 1, layer norms and biases whole; all replicated across DP
(``replica_id`` = the DP rank; layer norms also across TP). Every parameter has three
fp32 optimizer states (main copy, Adam's two moments), sharded across every rank like
Megatron's distributed optimizer: the TP shard cut further along dim 0 by DP. A few
ShardedObjects (per-rank RNG state, a per-DP-rank data iterator position) and plain
common values complete it.

The hidden size is a multiple of ``16 x world size`` (every split is even) picked from
the requested size, then the number of layers; the actual size is close to, not exactly,
the requested one (:attr:`WorkloadSpec.total_bytes` says it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.mapping import ShardedObject, ShardedTensor, StateDict

# (name, rows in units of hidden, columns in units of hidden, TP split axis or None)
_LAYER_TENSORS: tuple[tuple[str, int, int, int | None], ...] = (
    ("attn.qkv.weight", 3, 1, 0),
    ("attn.proj.weight", 1, 1, 1),
    ("mlp.fc1.weight", 4, 1, 0),
    ("mlp.fc2.weight", 1, 4, 1),
)
_LAYER_VECTORS: tuple[str, ...] = ("ln1.weight", "ln2.weight", "attn.proj.bias", "mlp.fc2.bias")
_OPTIMIZER_STATES: tuple[str, ...] = ("fp32_param", "exp_avg", "exp_avg_sq")
_PARAM_BYTES = 2  # bf16
_STATE_BYTES = 4 * len(_OPTIMIZER_STATES)  # fp32 each
_VOCAB_PER_HIDDEN = 4
_TARGET_LAYERS = 12


@dataclass(frozen=True)
class WorkloadSpec:
    """The shape of the synthetic model for a target size and world size."""

    world_size: int
    tp: int
    hidden: int
    layers: int

    @property
    def dp(self) -> int:
        """The data-parallel size."""
        return self.world_size // self.tp

    @property
    def params(self) -> int:
        """Parameters of the whole model."""
        per_layer = sum(r * c for _, r, c, _ in _LAYER_TENSORS) * self.hidden**2
        vectors = len(_LAYER_VECTORS) * self.hidden
        embedding = _VOCAB_PER_HIDDEN * self.hidden**2
        return self.layers * (per_layer + vectors) + embedding

    @property
    def total_bytes(self) -> int:
        """Bytes of the checkpoint's tensors (each replicated tensor counted once)."""
        return self.params * (_PARAM_BYTES + _STATE_BYTES)


def plan_workload(size_bytes: int, world_size: int) -> WorkloadSpec:
    """The model whose tensors come closest to ``size_bytes`` on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if size_bytes < 1:
        raise ValueError(f"size must be >= 1 byte, got {size_bytes}")
    tp = 2 if world_size % 2 == 0 else 1
    unit = 16 * world_size
    per_hidden_sq = (_TARGET_LAYERS * 12 + _VOCAB_PER_HIDDEN) * (_PARAM_BYTES + _STATE_BYTES)
    hidden = max(unit, round(math.sqrt(size_bytes / per_hidden_sq) / unit) * unit)
    layer_bytes = 12 * hidden**2 * (_PARAM_BYTES + _STATE_BYTES)
    embedding_bytes = _VOCAB_PER_HIDDEN * hidden**2 * (_PARAM_BYTES + _STATE_BYTES)
    layers = max(1, round((size_bytes - embedding_bytes) / layer_bytes))
    return WorkloadSpec(world_size, tp, hidden, layers)


@dataclass(frozen=True)
class _Param:
    key: str
    global_shape: tuple[int, ...]
    tp_axis: int | None  # None: whole on every TP rank


def _params(spec: WorkloadSpec) -> list[_Param]:
    h = spec.hidden
    found = [_Param("embedding.word_embeddings.weight", (_VOCAB_PER_HIDDEN * h, h), 0)]
    for layer in range(spec.layers):
        prefix = f"decoder.layers.{layer}."
        found += [_Param(prefix + n, (r * h, c * h), axis) for n, r, c, axis in _LAYER_TENSORS]
        found += [_Param(prefix + n, (h,), None) for n in _LAYER_VECTORS]
    return found


def _local_shape(param: _Param, tp: int) -> tuple[int, ...]:
    if param.tp_axis is None:
        return param.global_shape
    shape = list(param.global_shape)
    shape[param.tp_axis] //= tp
    return tuple(shape)


def _filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator).to(dtype)


def build_state(
    spec: WorkloadSpec,
    rank: int,
    empty: bool = False,
    *,
    tensor_cls: Any = ShardedTensor,
    object_cls: Any = ShardedObject,
) -> StateDict:
    """Rank ``rank``'s sharded state dict (``empty``: uninitialised tensors, to load into).

    ``tensor_cls`` / ``object_cls``: the ShardedTensor and ShardedObject classes to build
    it with (Megatron-Core's, to save it with Megatron-Core: the same constructors)."""
    tp_rank, dp_rank = rank % spec.tp, rank // spec.tp
    state: StateDict = {"iteration": 1000, "args": {"hidden": spec.hidden, "layers": spec.layers}}
    model: StateDict = {}
    optimizer: StateDict = {}
    for index, param in enumerate(_params(spec)):
        local = _local_shape(param, spec.tp)
        tp_split = param.tp_axis is not None
        data = torch.empty(local, dtype=torch.bfloat16)
        if not empty:  # replicas hold the same values: a TP-replicated vector too
            seed = index * spec.world_size + (tp_rank if tp_split else 0)
            data = _filled(local, torch.bfloat16, seed)
        offsets = [(param.tp_axis, tp_rank, spec.tp)] if param.tp_axis is not None else []
        replica = (0 if tp_split else tp_rank, dp_rank)
        model[param.key] = tensor_cls.from_rank_offsets(
            param.key, data, *offsets, replica_id=replica
        )
        optimizer.update(_optimizer_states(spec, param, local, rank, index, empty, tensor_cls))
    state["model"] = model
    state["optimizer"] = optimizer
    state["rng_state"] = object_cls(
        "rng_state", torch.arange(16, dtype=torch.int64) + rank, (spec.world_size,), (rank,)
    )
    state["data_iterator"] = object_cls(
        "data_iterator", {"consumed": 1000 * dp_rank}, (spec.dp,), (dp_rank,), replica_id=tp_rank
    )
    return state


def load_target(
    spec: WorkloadSpec,
    rank: int,
    *,
    tensor_cls: Any = ShardedTensor,
    object_cls: Any = ShardedObject,
) -> StateDict:
    """The state a load of rank ``rank`` fills: its tensors allocated and set to zero
    before the load, as a model's parameters are when a checkpoint is loaded into them.
    A load into untouched memory would also pay the kernel's first touch of every page
    (half of a 2 GiB local load's time here), which no baseline pays: the raw read's
    buffer is zeroed before it is timed too."""
    state = build_state(spec, rank, empty=True, tensor_cls=tensor_cls, object_cls=object_cls)
    for group in ("model", "optimizer"):
        section = state[group]
        assert isinstance(section, dict)
        for item in section.values():  # either project's ShardedTensor
            if isinstance(getattr(item, "data", None), torch.Tensor):
                item.data.zero_()
    return state


def _optimizer_states(
    spec: WorkloadSpec,
    param: _Param,
    local: tuple[int, ...],
    rank: int,
    index: int,
    empty: bool,
    tensor_cls: Any,
) -> StateDict:
    """The fp32 states of one parameter: its TP shard cut along dim 0 by DP (a vector
    whole on every TP rank is cut by DP only, and replicated across TP)."""
    tp_rank, dp_rank = rank % spec.tp, rank // spec.tp
    rows = local[0] // spec.dp
    shape = (rows, *local[1:])
    tp_split = param.tp_axis is not None
    if param.tp_axis == 0:
        axis0 = (0, tp_rank * spec.dp + dp_rank, spec.tp * spec.dp)
        offsets = [axis0]
    elif param.tp_axis == 1:
        offsets = [(0, dp_rank, spec.dp), (1, tp_rank, spec.tp)]
    else:
        offsets = [(0, dp_rank, spec.dp)]
    replica = 0 if tp_split else tp_rank
    states: StateDict = {}
    for number, name in enumerate(_OPTIMIZER_STATES):
        key = f"optimizer.state.{name}.{param.key}"
        data = torch.empty(shape, dtype=torch.float32)
        if not empty:
            source = rank if tp_split else dp_rank * spec.tp  # TP replicas: same values
            data = _filled(shape, torch.float32, (index * 3 + number) * spec.world_size + source)
        states[key] = tensor_cls.from_rank_offsets(key, data, *offsets, replica_id=replica)
    return states


def local_tensors(state: StateDict) -> list[torch.Tensor]:
    """Every tensor of a state built by :func:`build_state`, in a fixed order."""
    found: list[torch.Tensor] = []
    for group in ("model", "optimizer"):
        section = state[group]
        assert isinstance(section, dict)
        found += [_data(item) for item in section.values() if isinstance(item, ShardedTensor)]
    return found


def _data(item: ShardedTensor) -> torch.Tensor:
    assert item.data is not None, f"{item.key} has no data"
    return item.data


def rank_share(state: StateDict, spec: WorkloadSpec, rank: int) -> dict[str, torch.Tensor]:
    """The tensors this rank writes when every tensor is written once and replicated
    ones are spread over their replicas (parameter ``i`` by DP rank ``i % dp``): the
    raw baselines' per-rank bytes, whose sum over the ranks is the checkpoint's."""
    tp_rank, dp_rank = rank % spec.tp, rank // spec.tp
    share: dict[str, torch.Tensor] = {}
    model, optimizer = state["model"], state["optimizer"]
    assert isinstance(model, dict) and isinstance(optimizer, dict)
    for index, item in enumerate(model.values()):
        assert isinstance(item, ShardedTensor)
        # a TP-replicated vector is written by TP rank 0 only
        if index % spec.dp == dp_rank and (tp_rank == 0 or not _tp_replicated(item, spec)):
            share[f"{item.key}@{item.global_offset}"] = _data(item)
    for item in optimizer.values():
        assert isinstance(item, ShardedTensor)
        if item.replica_id == 0:
            share[f"{item.key}@{item.global_offset}"] = _data(item)
    return share


def _tp_replicated(item: ShardedTensor, spec: WorkloadSpec) -> bool:
    return spec.tp > 1 and tuple(item.local_shape) == tuple(item.global_shape)
