"""The state dicts the demo saves and loads back, and the check of what was loaded.

The saved state dict holds each rank's shard of the model and Adam state, the common
state, a per-rank :class:`~cloudckpt.mapping.ShardedObject` and a
:class:`~cloudckpt.mapping.LocalNonpersistentObject`; the one loaded back is of another
layout, NaN-filled, and every tensor of it is compared bit for bit with the reference
copies gathered before the save (:func:`_check_tensors`, :func:`_check_common`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist

from cloudckpt.demo.model import (
    Layout,
    ParamSpec,
    local_state,
    model_sharded_state_dict,
    optimizer_sharded_state_dict,
)
from cloudckpt.demo.train import BETAS, EPS, STATE_NAMES, Tensors, Trainer
from cloudckpt.mapping import LocalNonpersistentObject, ShardedObject, ShardedStateDict

if TYPE_CHECKING:
    from cloudckpt.demo.options import DemoOptions


def _common_state(options: DemoOptions) -> dict[str, Any]:
    return {
        "iteration": options.steps,
        "args": {
            **asdict(options.config),
            "lr": options.lr,
            "seed": options.seed,
            "tp": options.tp,
        },
        "param_groups": [{"lr": options.lr, "betas": BETAS, "eps": EPS, "step": options.steps}],
    }


def _save_state_dict(
    trainer: Trainer, options: DemoOptions, rng_obj: dict[str, Any]
) -> ShardedStateDict:
    lay, world = trainer.layout, options.world_size
    return {
        "model": model_sharded_state_dict(trainer.params, trainer.specs, lay),
        "optimizer": {"state": optimizer_sharded_state_dict(trainer.states, trainer.specs, lay)},
        "rng_state": ShardedObject("rng_state", rng_obj, (world,), (lay.rank,), replica_id=0),
        "local_cache": LocalNonpersistentObject({"pid": os.getpid()}),
        **_common_state(options),
    }


def _load_state_dict(
    specs: Sequence[ParamSpec], layout: Layout, options: DemoOptions
) -> ShardedStateDict:
    """The state dict of ``layout``, NaN-filled so a tensor the load misses cannot match."""
    nans = {s.key: torch.full(s.shape, math.nan) for s in specs}
    params = {s.key: local_state(nans, s, layout) for s in specs}
    states = {
        s.key: {n: local_state(nans, s, layout, flat=True) for n in STATE_NAMES} for s in specs
    }
    world, rank = options.world_size, layout.rank
    return {
        "model": model_sharded_state_dict(params, specs, layout),
        "optimizer": {"state": optimizer_sharded_state_dict(states, specs, layout)},
        "rng_state": ShardedObject("rng_state", None, (world,), (rank,), replica_id=0),
        "local_cache": LocalNonpersistentObject({"pid": os.getpid()}),
    }


def _expected_tensors(
    specs: Sequence[ParamSpec], layout: Layout, params: Tensors, states: dict[str, Tensors]
) -> dict[tuple[str, ...], torch.Tensor]:
    """What each tensor of the loaded state dict must equal, by its key path."""
    expected: dict[tuple[str, ...], torch.Tensor] = {}
    for spec in specs:
        expected["model", spec.key] = local_state(params, spec, layout)
        for name in STATE_NAMES:
            path = ("optimizer", "state", spec.key, name)
            expected[path] = local_state(states[name], spec, layout, flat=True)
    return expected


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _check_tensors(
    rank: int, loaded: dict[str, Any], expected: dict[tuple[str, ...], torch.Tensor]
) -> list[str]:
    """Compare every expected tensor bit for bit; one line per difference."""
    problems = []
    for path, want in expected.items():
        got = _lookup(loaded, path)
        where = f"rank {rank}: {'/'.join(path)}"
        if not isinstance(got, torch.Tensor):
            problems.append(f"{where}: expected a tensor, got {type(got).__name__}")
        elif got.shape != want.shape or got.dtype != want.dtype:
            problems.append(
                f"{where}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
            )
        elif not torch.equal(got, want):
            diff = (got - want).abs().nan_to_num(math.inf)
            count, worst = int((diff != 0).sum()), float(diff.max())
            problems.append(f"{where}: {count} elements differ (max |diff| {worst:.3g})")
    return problems


def _check_common(
    options: DemoOptions, loaded: dict[str, Any], rng_obj: dict[str, Any]
) -> list[str]:
    """Compare the common state, the ShardedObject and the LocalNonpersistentObject."""
    where = f"rank {torch_dist.get_rank()}"
    problems = [
        f"{where}: common {key!r} is {loaded.get(key)!r}, want {value!r}"
        for key, value in _common_state(options).items()
        if loaded.get(key) != value
    ]
    got = loaded.get("rng_state")
    if not (
        isinstance(got, dict)
        and got.keys() == rng_obj.keys()
        and all(
            torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            for k, v in rng_obj.items()
        )
    ):
        problems.append(f"{where}: sharded object 'rng_state' is {got!r}, want {rng_obj!r}")
    if loaded.get("local_cache") != {"pid": os.getpid()}:
        problems.append(f"{where}: local object 'local_cache' is {loaded.get('local_cache')!r}")
    return problems
