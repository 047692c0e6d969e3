"""Megatron-Core's public helpers of ``strategies.torch``, for code that calls them.

cloudckpt's torch_dist strategies (:mod:`cloudckpt.strategies.torch`, which re-exports
these names) save through DCP with their own planner and load with their own reader;
the names here give Megatron-Core's building blocks to code written against them:

* :class:`MCoreSavePlanner` / :class:`MCoreLoadPlanner`: DCP planners for state dicts
  made by :func:`mcore_to_pyt_state_dict` (ShardedObjects as ``BytesIO`` written as
  they are; global shapes checked before a load);
* :func:`flatten_state_dict`: one level of ``"a.b.c"`` keys, ShardedBase leaves kept;
* :func:`mcore_to_pyt_state_dict`: ShardedTensors -> DCP checkpointables,
  ShardedObjects -> ``BytesIO``;
* :func:`sharded_tensor_to_torch_sharded_tensor`: PyTorch's (legacy) ShardedTensor of
  a regular grid, as Megatron-Core built before checkpointables existed.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from itertools import product
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType

from cloudckpt import dist
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    dcp_global_shape,
)
from cloudckpt.formats.dcp.plan import LinearGlobalPlanMixin
from cloudckpt.formats.dcp.reader import ORIG_SHAPE_KEY
from cloudckpt.formats.dcp.storage import MCoreMetadata, MCoreSavePlan
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor

logger = logging.getLogger(__name__)

#: A key path in a nested state dict: dict keys and list indices, outermost first.
OBJ_PATH = tuple[str | int, ...]


class MCoreSavePlanner(LinearGlobalPlanMixin):
    """DCP's default save planner, plus Megatron-Core's: ``BytesIO`` items (ShardedObjects,
    already ``torch.save``-d) are written as they are, on every rank, and each rank's
    ``mcore_data`` (original shapes of N-D flattened tensors) travels in its plan
    (:class:`MCoreSavePlan`) into the global :class:`MCoreMetadata`.

    Args:
        dedup_replicated_tensors: accepted for Megatron-Core's signature; PyTorch >= 2.3
            always de-duplicates (cloudckpt passes only main replicas anyway).
        nd_flattened_global_shapes: ``{key: original global shape}`` of N-D flattened
            tensors (values with an ``mcore_metadata`` attribute bring their own).
        can_run_decentralized_global_plan: allow :meth:`create_decentralized_global_plan`
            (needs ``flatten_state_dict=False``).
    """

    def __init__(
        self,
        *args: Any,
        dedup_replicated_tensors: bool | None = None,
        nd_flattened_global_shapes: Mapping[str, tuple[int, ...]] | None = None,
        can_run_decentralized_global_plan: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.nd_flattened_global_shapes = dict(nd_flattened_global_shapes or {})
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        if can_run_decentralized_global_plan and (
            dedup_replicated_tensors or self.flatten_state_dict
        ):
            raise CheckpointingException(
                "a decentralized global plan needs dedup_replicated_tensors and "
                "flatten_state_dict off"
            )

    def _mcore_data(self) -> dict[str, dict[str, Any]]:
        data: dict[str, dict[str, Any]] = {}
        for key, value in self.state_dict.items():
            own = getattr(value, "mcore_metadata", None)
            if own is not None:
                data[key] = dict(own)
            elif key in self.nd_flattened_global_shapes:
                data[key] = {ORIG_SHAPE_KEY: tuple(self.nd_flattened_global_shapes[key])}
        return data

    def create_local_plan(self) -> SavePlan:
        """DCP's local plan as an :class:`MCoreSavePlan` with this rank's ``mcore_data``."""
        plan = super().create_local_plan()
        values = {f.name: getattr(plan, f.name) for f in fields(plan)}
        self.plan = MCoreSavePlan(**values, mcore_data=self._mcore_data())
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global plan; the metadata is an :class:`MCoreMetadata` merging every
        rank's ``mcore_data``."""
        global_plan, metadata = super().create_global_plan(all_plans)
        merged: dict[str, dict[str, Any]] = {}
        for plan in all_plans:
            merged.update(getattr(plan, "mcore_data", None) or {})
        return global_plan, MCoreMetadata(mcore_data=merged, **vars(metadata))

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """``BytesIO`` items as they are (already serialized); others as DCP does."""
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The local plan as the global one (no exchange with other ranks)."""
        if self.flatten_state_dict or local_plan.planner_data:
            raise CheckpointingException(
                "a decentralized global plan needs flatten_state_dict off and no planner data"
            )
        return local_plan


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, checking the global shapes of the requested tensors.

    Args:
        shapes_validation_sharded_tensors: ShardedTensors whose global shape must equal
            the stored one (for a flattened tensor: its stored, reformulated shape).
        allow_shape_mismatch_sharded_tensors: ``{key: ShardedTensor}`` allowed to
            differ: DCP's own size check is bypassed for them.
    """

    def __init__(
        self,
        *args: Any,
        shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
        allow_shape_mismatch_sharded_tensors: Mapping[str, ShardedTensor] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors

    @staticmethod
    def _expected_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
        """The stored shape of ``sh_ten``: reformulated for an N-D flattened tensor."""
        return tuple(dcp_global_shape(sh_ten))

    def _validate_global_shapes(
        self, metadata: Metadata, sharded_tensors: Iterable[ShardedTensor]
    ) -> None:
        for sh_ten in sharded_tensors:
            stored = metadata.state_dict_metadata.get(sh_ten.key)
            if stored is None:
                raise KeyError(
                    f"{sh_ten.key} from model not in state dict:"
                    f" {sorted(metadata.state_dict_metadata)}"
                )
            expected = self._expected_shape(sh_ten)
            if isinstance(stored, TensorStorageMetadata) and tuple(stored.size) != expected:
                raise CheckpointingException(
                    f"Global shape mismatch for loaded ({tuple(stored.size)}) and expected "
                    f"({expected}) tensor for key {sh_ten.key}"
                )

    @contextmanager
    def _temporarily_bypass_shape_validation(self) -> Iterator[None]:
        """Give the allowed-to-differ tensors their requested shape while DCP plans."""
        allowed = self.allow_shape_mismatch_sharded_tensors or {}
        stored = self.metadata.state_dict_metadata if self.metadata else {}
        saved = [
            (md, md.size, sh)
            for k, sh in allowed.items()
            if isinstance(md := stored.get(k), TensorStorageMetadata)
        ]
        try:
            for md, _, sh_ten in saved:
                md.size = torch.Size(sh_ten.global_shape)
            yield
        finally:
            for md, size, _ in saved:
                md.size = size

    def create_local_plan(self) -> LoadPlan:
        """Check the global shapes, then plan as DCP does."""
        if self.metadata is None:
            raise CheckpointingException("MCoreLoadPlanner has no checkpoint metadata")
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()


def flatten_state_dict(
    state_dict: ShardedStateDict,
) -> tuple[dict[str, Any], dict[str, OBJ_PATH]]:
    """One level of ``"a.b.0"`` keys; tensors and ShardedBase objects are leaves.

    Returns:
        ``(flat, mapping)``: the flat dict and, per flat key, the original key path.

    Raises:
        ValueError: two key paths flatten to the same key.
    """
    flat: dict[str, Any] = {}
    paths: dict[str, OBJ_PATH] = {}

    def visit(path: OBJ_PATH, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                visit((*path, k), v)
            return
        if isinstance(value, list) and value:
            for i, v in enumerate(value):
                visit((*path, i), v)
            return
        key = ".".join(map(str, path))
        if key in flat:
            raise ValueError(f"duplicated flatten key {key}")
        flat[key], paths[key] = value, path

    for k, v in state_dict.items():
        visit((k,), v)
    return flat, paths


def _checkpointable(
    sh_tens: list[ShardedTensor], is_loading: bool, init_device: torch.device
) -> torch.Tensor:
    for sh_ten in sh_tens:
        if sh_ten.data is None:
            if not is_loading:
                raise CheckpointingException(f"`data` attr is None for {sh_ten.key!r}")
            init = torch.zeros if sh_ten.allow_shape_mismatch else torch.empty
            sh_ten.init_data(init_device, init_fn=init)
        else:
            sh_ten.data = sh_ten.data.detach()
            if sh_ten.allow_shape_mismatch and is_loading:
                sh_ten.data.zero_()
    shards = [CheckpointableShardedTensor.from_sh_ten(sh) for sh in sh_tens]
    return shards[0] if len(shards) == 1 else LocalShardsContainer(list(shards))


def mcore_to_pyt_state_dict(
    state_dict: Mapping[str, list[ShardedBase]],
    is_loading: bool = False,
    init_device: torch.device = torch.device("cpu"),  # noqa: B008 - Megatron's default
    load_legacy_1d_flatten_tensors: bool = False,
) -> dict[str, torch.Tensor | io.BytesIO]:
    """DCP values for ``{key: [shards of that key held here]}``.

    ShardedTensors become :class:`CheckpointableShardedTensor` (several shards: a
    :class:`LocalShardsContainer`); when loading, missing ``data`` is allocated on
    ``init_device`` (zeros for ``allow_shape_mismatch``). ShardedObjects become a
    ``BytesIO`` of ``torch.save([data, ...])``. ``load_legacy_1d_flatten_tensors`` is
    accepted for Megatron-Core's signature: cloudckpt stores 1-D flattened tensors in
    the N-D layout (its reader loads both).

    Raises:
        CheckpointingException: saving a ShardedTensor without data.
    """
    out: dict[str, torch.Tensor | io.BytesIO] = {}
    for key, shards in state_dict.items():
        if isinstance(shards[0], ShardedTensor):
            tensors = [sh for sh in shards if isinstance(sh, ShardedTensor)]
            out[key] = _checkpointable(tensors, is_loading, init_device)
        else:
            buffer = io.BytesIO()
            torch.save([sh.data for sh in shards if isinstance(sh, ShardedObject)], buffer)
            out[key] = buffer
    return out


def sharded_tensor_to_torch_sharded_tensor(
    sh_tens: list[ShardedTensor],
    rank: int | None = None,
    load_legacy_1d_flatten_tensors: bool = False,
) -> TorchShardedTensor:
    """PyTorch's (legacy) ShardedTensor holding ``sh_tens``, shards of one key on this rank.

    The shards must lie on a regular grid (``axis_fragmentations``); the chunks of other
    ranks are described, not held, so nothing is communicated. Prepended axes become
    leading axes of extent 1. The result carries ``mcore_sh_ten`` (the metadata of the
    first shard), as in Megatron-Core. Needs an initialised process group (PyTorch's).

    Flattened shards (``flattened_range``) are not boxes of the global tensor: cloudckpt
    stores them through :class:`CheckpointableShardedTensor` in the N-D flattened layout
    (as Megatron-Core >= 0.14 with PyTorch >= 2.6 does); here they are refused, except
    1-D ones with ``load_legacy_1d_flatten_tensors`` (the legacy layout: a plain range).

    Raises:
        CheckpointingException: no shards, a shard without data, no regular grid, or a
            flattened shard (see above).
    """
    if not sh_tens or any(sh.data is None for sh in sh_tens):
        raise CheckpointingException(
            "sharded_tensor_to_torch_sharded_tensor needs shards with data"
        )
    first = sh_tens[0]
    legacy_1d = load_legacy_1d_flatten_tensors and len(first.global_shape) == 1
    if first.flattened_range is not None and not legacy_1d:
        raise CheckpointingException(
            f"tensor {first.key!r}: flattened shards are stored as DCP checkpointables "
            "(mcore_to_pyt_state_dict), not as a PyTorch ShardedTensor"
        )
    if first.axis_fragmentations is None and not legacy_1d:
        raise CheckpointingException(f"tensor {first.key!r}: shards without a regular grid")
    rank = dist.get_rank() if rank is None else rank
    local = []
    for sh in sh_tens:
        assert sh.data is not None
        if legacy_1d and sh.flattened_range is not None:
            data, offsets = sh.data.contiguous(), [sh.global_offset[0] + sh.flattened_range.start]
        else:
            shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            data, offsets = sh.data.contiguous().view(shape), list(sh.global_offset)
        local.append(Shard.from_tensor_and_offsets(data, offsets, rank))
    metadata = _torch_sharded_metadata(first, local, rank)
    result = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local, sharded_tensor_metadata=metadata, process_group=None
    )
    result.mcore_sh_ten = first.without_data()  # type: ignore[attr-defined]
    result.mcore_metadata = {}  # type: ignore[attr-defined]
    return result


def _torch_sharded_metadata(
    first: ShardedTensor, local: list[Shard], rank: int
) -> ShardedTensorMetadata:
    """The local shards as held, every other chunk of the grid on another rank."""
    global_shape = tuple(first.global_shape)
    shards_md = [s.metadata for s in local]
    held = {tuple(md.shard_offsets) for md in shards_md}
    if first.axis_fragmentations is not None and first.flattened_range is None:
        chunk = (1,) * first.prepend_axis_num + tuple(first.local_shape)
        other = f"rank:{(rank + 1) % max(dist.get_world_size(), 1)}/{local[0].tensor.device.type}"
        for index in product(*map(range, first.axis_fragmentations)):
            offsets = [i * c for i, c in zip(index, chunk, strict=True)]
            if tuple(offsets) not in held:
                shards_md.append(ShardMetadata(offsets, list(chunk), other))
    data = local[0].tensor
    properties = TensorProperties(
        dtype=data.dtype,
        layout=data.layout,
        requires_grad=data.requires_grad,
        memory_format=torch.contiguous_format,
        pin_memory=data.is_pinned() if data.device.type == "cpu" else False,
    )
    return ShardedTensorMetadata(shards_md, torch.Size(global_shape), properties)


__all__ = [
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "MCoreSavePlanner",
    "OBJ_PATH",
    "flatten_state_dict",
    "mcore_to_pyt_state_dict",
    "sharded_tensor_to_torch_sharded_tensor",
]
