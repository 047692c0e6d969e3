"""Distributed training of the demo model on one rank: TP x DP with a distributed Adam.

The scheme is the simplest correct one, not a fast one: every step all-gathers the TP
shards into full weights, runs forward/backward of the full model on a batch specific
to the DP rank, takes the local TP slice of each gradient, all-reduces it over DP,
runs Adam on the contiguous range of the flattened shard this DP rank owns
(:func:`~cloudckpt.demo.model.dp_range`) and all-gathers the updated ranges over DP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

from cloudckpt.demo.model import (
    GPTConfig,
    Layout,
    ParamSpec,
    dp_range,
    forward_loss,
    gather_full,
    init_full_params,
    local_shard,
    local_state,
    param_specs,
)

STATE_NAMES = ("exp_avg", "exp_avg_sq")
BETAS = (0.9, 0.95)
EPS = 1e-8
Tensors = dict[str, torch.Tensor]


def new_groups(layout: Layout) -> tuple[Any, Any]:
    """Collective: create every TP and DP group (same order on every rank).

    Returns:
        This rank's (TP group, DP group).
    """
    tp_size, dp_size = layout.tp_size, layout.dp_size
    tp_group = dp_group = None
    for d in range(dp_size):
        group = torch_dist.new_group([d * tp_size + t for t in range(tp_size)])
        tp_group = group if d == layout.dp_rank else tp_group
    for t in range(tp_size):
        group = torch_dist.new_group([d * tp_size + t for d in range(dp_size)])
        dp_group = group if t == layout.tp_rank else dp_group
    return tp_group, dp_group


def all_gather_ranges(piece: torch.Tensor, numel: int, dp_size: int, group: Any) -> torch.Tensor:
    """Collective over the DP ``group``: rebuild a flat shard from every rank's :func:`dp_range`."""
    ranges = [dp_range(numel, d, dp_size) for d in range(dp_size)]
    width = max(rng.stop - rng.start for rng in ranges)
    padded = torch.zeros(width, dtype=piece.dtype)
    padded[: piece.numel()] = piece
    gathered = [torch.empty_like(padded) for _ in ranges]
    torch_dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[: r.stop - r.start] for g, r in zip(gathered, ranges, strict=True)])


@dataclass
class Trainer:
    """One rank's shard of the model and of the Adam state, and its training step.

    Constructing one is collective (it creates the TP and DP process groups).

    Attributes:
        config: model sizes.
        layout: this rank's place in the TP x DP grid.
        seed: seed of the initial weights (same on every rank) and of the data.
        lr: Adam learning rate.
        batch_size: sequences per DP rank and step.
        seq_len: tokens per sequence (at most ``config.max_seq_len``).
        specs: the model's parameters.
        params: local TP shard of each weight, by key.
        states: ``key -> {"exp_avg", "exp_avg_sq"} ->`` this DP rank's flat range.
        step_count: steps taken.
    """

    config: GPTConfig
    layout: Layout
    seed: int
    lr: float = 1e-3
    batch_size: int = 8
    seq_len: int = 32
    specs: list[ParamSpec] = field(init=False)
    params: Tensors = field(init=False)
    states: dict[str, Tensors] = field(init=False)
    step_count: int = 0
    _groups: tuple[Any, Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.specs = param_specs(self.config)
        self._groups = new_groups(self.layout)
        full = init_full_params(self.specs, self.seed)
        zeros = {s.key: torch.zeros(s.shape) for s in self.specs}
        self.params = {s.key: local_state(full, s, self.layout) for s in self.specs}
        self.states = {
            s.key: {n: local_state(zeros, s, self.layout, flat=True) for n in STATE_NAMES}
            for s in self.specs
        }

    def batch(self, step: int) -> torch.Tensor:
        """Deterministic (batch, seq + 1) tokens of this DP rank: progressions mod vocab."""
        gen = torch.Generator().manual_seed(
            self.seed * 1_000_003 + step * 1009 + self.layout.dp_rank
        )
        vocab = self.config.vocab_size
        start = torch.randint(0, vocab, (self.batch_size, 1), generator=gen)
        stride = torch.randint(1, 8, (self.batch_size, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len + 1)) % vocab

    def step(self) -> float:
        """Collective: one training step; returns the loss averaged over DP."""
        lay, (tp_group, dp_group) = self.layout, self._groups
        self.step_count += 1
        full = {
            s.key: gather_full(self.params[s.key], s, lay.tp_size, tp_group).requires_grad_()
            for s in self.specs
        }
        loss = forward_loss(full, self.batch(self.step_count), self.config)
        loss.backward()  # type: ignore[no-untyped-call]
        for spec in self.specs:
            grad = full[spec.key].grad
            assert grad is not None
            flat_grad = local_shard(grad, spec, lay.tp_rank, lay.tp_size).flatten()
            torch_dist.all_reduce(flat_grad, group=dp_group)
            self._update(spec.key, flat_grad / lay.dp_size)
        mean_loss = loss.detach().reshape(1).clone()
        torch_dist.all_reduce(mean_loss, group=dp_group)
        return float(mean_loss.item()) / lay.dp_size

    def _update(self, key: str, grad: torch.Tensor) -> None:
        """Adam on the owned range of ``key``, then all-gather the new weights over DP."""
        beta1, beta2 = BETAS
        param, lay, step = self.params[key], self.layout, self.step_count
        owned = dp_range(param.numel(), lay.dp_rank, lay.dp_size)
        m, v = self.states[key]["exp_avg"], self.states[key]["exp_avg_sq"]
        m.mul_(beta1).add_(grad[owned], alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad[owned], grad[owned], value=1 - beta2)
        update = (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + EPS)
        piece = param.flatten()[owned] - self.lr * update
        gathered = all_gather_ranges(piece, param.numel(), lay.dp_size, self._groups[1])
        self.params[key] = gathered.view_as(param)

    def reference(self) -> tuple[Tensors, dict[str, Tensors]]:
        """Collective: full copies of every weight and optimizer state, as rank 0 holds them.

        Rank 0 holds the main replica of every shard, so these equal what a checkpoint
        of this trainer holds.

        Returns:
            ``(full weight by key, state name -> full state by key)``.
        """
        lay, (tp_group, dp_group) = self.layout, self._groups
        params: Tensors = {}
        states: dict[str, Tensors] = {n: {} for n in STATE_NAMES}
        for spec in self.specs:
            local = self.params[spec.key]
            params[spec.key] = gather_full(local, spec, lay.tp_size, tp_group)
            for name, piece in self.states[spec.key].items():
                shard = all_gather_ranges(piece, local.numel(), lay.dp_size, dp_group)
                states[name][spec.key] = gather_full(
                    shard.view_as(local), spec, lay.tp_size, tp_group
                )
        for tensor in [*params.values(), *(t for s in states.values() for t in s.values())]:
            torch_dist.broadcast(tensor, src=0)
        return params, states
