"""Sharding of optimizer state from the sharding of the model (Megatron-Core's
``dist_checkpointing.optimizer``).

A ``torch.optim`` state dict keys its per-parameter state by integer ids (the
position of the parameter in the optimizer's parameter groups). These helpers map
those ids to the model's ShardedTensors (or factories) and turn each state tensor
(``exp_avg``, ``exp_avg_sq``, ...) into a ShardedTensor with the parameter's sharding
under the key ``optimizer.state.<state key>.<parameter key>``.

Parameters are matched by identity: build the model's sharded state dict from
``state_dict(keep_vars=True)`` so that its ShardedTensors hold the very
``torch.nn.Parameter`` objects the optimizer holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from copy import deepcopy
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from cloudckpt import dist
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from cloudckpt.utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)

ShardedParam = ShardedTensor | ShardedTensorFactory


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (``tensor.to_local()``); any other tensor as is."""
    if isinstance(tensor, DTensor):
        local: torch.Tensor = tensor.to_local()
        return local
    return tensor


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> dict[int, int]:
    """``{id(parameter): position}`` for the parameters in optimizer order.

    A parameter seen twice keeps its first position; DTensors are mapped by their
    local tensor (as a model's sharded state dict holds it).
    """
    mapping: dict[int, int] = {}
    for position, param in enumerate(optim_params_iter):
        mapping.setdefault(id(to_local_if_dtensor(param)), position)
    return mapping


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> dict[int, ShardedParam]:
    """``{optimizer param id: model ShardedTensor or factory}``.

    Args:
        model_sharded_state_dict: the model's sharded state dict (any nesting), built
            from ``state_dict(keep_vars=True)``.
        optim_params_iter: the parameters the optimizer tracks, in its order (e.g.
            ``itertools.chain.from_iterable(g["params"] for g in optim.param_groups)``).

    Returns:
        The mapping; empty (with a WARNING on rank 0) when no sharded tensor holds an
        optimizer parameter, which usually means ``keep_vars=True`` was forgotten.
    """
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    result: dict[int, ShardedParam] = {}
    for sharded_param in nested_values(sharded):
        param_id = param_to_id.get(id(sharded_param.data))
        if param_id is None:
            logger.debug("%s is not tracked by the optimizer", sharded_param.key)
        else:
            result[param_id] = sharded_param
    if not result and dist.get_rank() == 0:
        logger.warning(
            "Sharded parameters mapping is empty: the tensors of the model state dict are not"
            " the optimizer's parameters.%s",
            KEEP_VARS_HINT,
        )
    return result


def make_sharded_optimizer_tensor(
    model_param: ShardedParam, optim_param: torch.Tensor, prefix: str
) -> ShardedParam:
    """The optimizer tensor ``optim_param`` with the sharding of ``model_param``.

    The result is a copy of ``model_param`` with key ``<prefix>.<model key>`` and
    ``data=optim_param`` (a ShardedTensor also takes the optimizer tensor's dtype).

    Raises:
        CheckpointingException: for a ShardedTensor, the optimizer tensor's shape is
            not the parameter's local shape (or, for a flat shard, its range length).
        ShardingValidationError: the resulting ShardedTensor is inconsistent.
    """
    optim_param = to_local_if_dtensor(optim_param)
    key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=key, data=optim_param)
    rng = model_param.flattened_range
    expected = model_param.local_shape if rng is None else (rng.stop - rng.start,)
    if tuple(optim_param.shape) != tuple(expected):
        raise CheckpointingException(
            f"Optimizer shape ({tuple(optim_param.shape)}) does not match model shape "
            f"({tuple(expected)}) for key {key!r}"
        )
    sharded = replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)
    sharded.validate_metadata_integrity()
    return sharded


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Mapping[int, ShardedParam],
    exclude_keys: tuple[str, ...] = (),
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded state dict, in place.

    Each tensor under ``optim_state_dict["state"][param_id][state_key]`` becomes a
    ShardedTensor (:func:`make_sharded_optimizer_tensor` with prefix
    ``optimizer.state.<state_key>``); ``param_groups`` is deep-copied and each
    group's ``params`` wrapped in a LocalNonpersistentObject (the ids are rebuilt by
    the optimizer, not loaded).

    Args:
        optim_state_dict: ``optimizer.state_dict()``.
        id_to_sharded_param_map: from :func:`get_param_id_to_sharded_param_map`.
        exclude_keys: state keys to drop (e.g. ``("step",)``).

    Raises:
        ValueError: a parameter id of the optimizer state has no sharded parameter.
    """
    sharded_state: dict[Any, dict[str, Any]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        kept = {k: v for k, v in param_state.items() if k not in exclude_keys}
        if kept and param_id not in id_to_sharded_param_map:
            raise ValueError(f"Param id {param_id} does not match any model sharded param")
        sharded_state[param_id] = {
            state_key: make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{state_key}"
            )
            for state_key, value in kept.items()
        }
    groups = deepcopy(optim_state_dict["param_groups"])
    for group in groups:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["param_groups"] = groups
    optim_state_dict["state"] = sharded_state


__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]
