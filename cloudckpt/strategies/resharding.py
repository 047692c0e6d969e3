"""Resharding of N-D flattened tensors (Megatron-Core's ``strategies.resharding``).

A *flattened* ShardedTensor (``flattened_range`` set: a contiguous range of the
C-order elements of one grid chunk, as distributed optimizers hold their state) of
global shape ``[X, Y, Z]`` and local (chunk) shape ``[x, y, z]`` is stored by the
torch_dist backend as a tensor of shape ``[X // x, Y // y, Z // z, x * y * z]``: one
row per grid chunk, holding that chunk's elements flat (see
:mod:`cloudckpt.formats.dcp.checkpointable`). The original global shape is kept in the
DCP metadata (``mcore_data[key]["nd_reformulated_orig_global_shape"]``).

Loading into a different grid (another TP size) needs the rows of the checkpoint's
grid that overlap each requested chunk. :func:`apply_nd_flattened_tensors_reformulation`
rewrites a sharded state dict so that each N-D flattened tensor whose grid differs
from the checkpoint's is requested as whole checkpoint rows, and
:func:`restore_nd_flattened_tensors_formulation` assembles the requested chunks (and
their flattened ranges) from those rows after the load.

cloudckpt's own torch_dist loader reshards flattened tensors by itself (it reads only
the overlapping element ranges), so ``cloudckpt.load`` never needs these functions;
they are here for code written against Megatron-Core that calls them directly, and
they work with any loader that reads whole checkpoint rows.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch

from cloudckpt.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.checkpointable import dcp_global_shape
from cloudckpt.formats.dcp.reader import DcpCheckpoint
from cloudckpt.mapping import (
    ReplicaId,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factory_merges,
)
from cloudckpt.storage import CheckpointStorage, open_checkpoint
from cloudckpt.storage.location import CheckpointDir, checkpoint_uri

logger = logging.getLogger(__name__)

#: What :func:`restore_nd_flattened_tensors_formulation` needs: the factories (without
#: data) that replaced the reformulated tensors, at their places in the state dict.
ReformulationRestoreMetadata = ShardedStateDict


@dataclass(frozen=True)
class TensorReformulationMetadata:
    """How the checkpoint stores one N-D flattened tensor.

    Attributes:
        ckpt_orig_global_shape: the application's global shape of the tensor.
        ckpt_reform_global_shape: the shape actually stored,
            ``(*axis_fragmentations, prod(local_shape))``.
    """

    ckpt_orig_global_shape: tuple[int, ...]
    ckpt_reform_global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ckpt_orig_global_shape", tuple(self.ckpt_orig_global_shape))
        object.__setattr__(self, "ckpt_reform_global_shape", tuple(self.ckpt_reform_global_shape))
        if not self.ckpt_orig_global_shape:
            raise CheckpointingException(
                "TensorReformulationMetadata needs a non-empty original global shape"
            )


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """True when ``sh_ten`` is a ShardedTensor with a ``flattened_range``."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None


def nd_flattened_tensor_reformulated_global_shape(sh_ten: ShardedTensor) -> tuple[int, ...]:
    """The stored shape of a flattened tensor: ``(*axis_fragmentations, prod(local_shape))``.

    Raises:
        CheckpointingException: ``sh_ten`` is not flattened, or its shards form no grid.
    """
    if not is_nd_flattened_tensor(sh_ten):
        raise CheckpointingException(f"ShardedTensor {sh_ten.key!r} is not flattened")
    return tuple(dcp_global_shape(sh_ten))


def get_reformulation_metadata(
    sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointDir | CheckpointStorage
) -> dict[str, TensorReformulationMetadata]:
    """Read, for every N-D flattened tensor requested, how the checkpoint stores it.

    Args:
        sharded_state_dict: the state dict to load.
        checkpoint_dir: a torch_dist checkpoint (URI, path or opened storage).

    Returns:
        ``{key: TensorReformulationMetadata}`` for each flattened tensor of the state
        dict. A 1-D flattened tensor of a checkpoint without the original shape (the
        legacy layout) is skipped with a warning.

    Raises:
        CheckpointingException: an N-D flattened tensor has no recorded original shape.
        CheckpointKeyNotFoundError: a flattened tensor is not in the checkpoint.
    """
    storage = (
        checkpoint_dir
        if isinstance(checkpoint_dir, CheckpointStorage)
        else open_checkpoint(checkpoint_uri(checkpoint_dir))
    )
    checkpoint = DcpCheckpoint(storage)
    result: dict[str, TensorReformulationMetadata] = {}
    for sh_ten in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(sh_ten):
            continue
        stored = tuple(checkpoint.tensor_metadata(sh_ten.key).size)
        orig = checkpoint.orig_shape(sh_ten.key)
        if orig is None and len(sh_ten.global_shape) == 1:
            warnings.warn(
                f"Legacy checkpoint format detected for 1-D flattened tensor {sh_ten.key!r} "
                f"in {storage.uri!r}. Skip metadata reformulation.",
                stacklevel=2,
            )
            continue
        if orig is None:
            raise CheckpointingException(
                f"Cannot find global shape metadata for N-D flattened tensor {sh_ten.key!r} "
                f"in the metadata of checkpoint {storage.uri!r}"
            )
        result[sh_ten.key] = TensorReformulationMetadata(orig, stored)
    return result


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict,
    reformulation_metadata: Mapping[str, TensorReformulationMetadata],
) -> tuple[ShardedStateDict, ReformulationRestoreMetadata]:
    """Request each N-D flattened tensor as the checkpoint's rows that overlap it.

    Tensors whose stored shape already equals the requested reformulated shape are
    left as they are; others are replaced, in place, by the ShardedTensors of the
    overlapping checkpoint rows.

    Returns:
        ``(sharded_state_dict, restore_metadata)``; pass the loaded state dict and
        ``restore_metadata`` to :func:`restore_nd_flattened_tensors_formulation`.

    Raises:
        CheckpointingException: an N-D (N > 1) flattened tensor has no entry in
            ``reformulation_metadata``, or the checkpoint's grid does not fit its shape.
    """

    def reformulate(value: Any) -> Any:
        if not is_nd_flattened_tensor(value):
            return value
        metadata = reformulation_metadata.get(value.key)
        if metadata is None:
            if len(value.global_shape) == 1:  # legacy 1-D layout: nothing to reformulate
                return value
            raise CheckpointingException(
                f"Missing reformulation metadata for tensor {value.key!r}. "
                f"Existing keys: {sorted(reformulation_metadata)}"
            )
        if metadata.ckpt_reform_global_shape == nd_flattened_tensor_reformulated_global_shape(
            value
        ):
            return value
        return reformulate_single_nd_flattened_tensor(value, metadata)

    dict_list_map_inplace(reformulate, sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict,
        lambda x: isinstance(x, ShardedTensorFactory),
        return_lists_as_dicts=True,
    )
    dict_list_map_inplace(_build_factory, sharded_state_dict)

    def unlink(factory: Any) -> Any:
        factory.data = None
        return factory

    dict_list_map_inplace(unlink, factories)
    return sharded_state_dict, factories


def _build_factory(value: Any) -> Any:
    """A factory's built sub-state-dict (even without data, which reformulation ignores)."""
    if not isinstance(value, ShardedTensorFactory):
        return value
    return value.build_fn(value.key, value.data, value.replica_id, value.flattened_range)  # type: ignore[arg-type]


def restore_nd_flattened_tensors_formulation(
    state_dict: StateDict, formulation_restore_metadata: ReformulationRestoreMetadata
) -> StateDict:
    """Turn the loaded checkpoint rows back into the requested flattened shards.

    The inverse of :func:`apply_nd_flattened_tensors_reformulation`; edits and returns
    ``state_dict``.
    """
    restored: StateDict = apply_factory_merges(state_dict, formulation_restore_metadata)
    return restored


def _overlap_rows(app_index: int, app_fragm: int, ckpt_fragm: int) -> range:
    """Checkpoint chunk indices along one axis overlapping application chunk ``app_index``."""
    first = app_index * ckpt_fragm // app_fragm
    stop = -(-(app_index + 1) * ckpt_fragm // app_fragm)
    return range(first, stop)


def _ckpt_local_shape(
    sh_ten: ShardedTensor, metadata: TensorReformulationMetadata
) -> tuple[int, ...]:
    """The checkpoint's chunk shape (prepended axes included), checked against the grid."""
    orig, fragms = metadata.ckpt_orig_global_shape, metadata.ckpt_reform_global_shape[:-1]
    if len(fragms) != len(orig) or any(size % f for size, f in zip(orig, fragms, strict=True)):
        raise CheckpointingException(
            f"tensor {sh_ten.key!r}: stored shape {metadata.ckpt_reform_global_shape} is no "
            f"grid of the original shape {orig}"
        )
    shape = tuple(size // f for size, f in zip(orig, fragms, strict=True))
    if any(ext != 1 for ext in shape[: sh_ten.prepend_axis_num]):
        raise CheckpointingException(
            f"tensor {sh_ten.key!r}: the checkpoint's chunks {shape} are not single along the "
            f"{sh_ten.prepend_axis_num} prepended axes"
        )
    if len(sh_ten.global_shape) != len(orig):
        raise CheckpointingException(
            f"tensor {sh_ten.key!r}: requested global shape {sh_ten.global_shape} and stored "
            f"original shape {orig} differ in rank"
        )
    return shape


def reformulate_single_nd_flattened_tensor(
    sh_ten: ShardedTensor, reformulation_metadata: TensorReformulationMetadata
) -> ShardedTensorFactory:
    """A factory that requests the checkpoint rows overlapping ``sh_ten`` and merges them.

    Its ``build_fn`` returns ``{(global_offset, ckpt_local_shape): ShardedTensor}``, one
    whole stored row each; its ``merge_fn`` copies the overlaps into a tensor of
    ``sh_ten.local_shape`` and returns its ``flattened_range``.
    """
    meta = reformulation_metadata
    with_prepended = _ckpt_local_shape(sh_ten, meta)
    ckpt_local = with_prepended[sh_ten.prepend_axis_num :]
    ckpt_fragms = meta.ckpt_reform_global_shape[:-1]
    app_fragms = nd_flattened_tensor_reformulated_global_shape(sh_ten)[:-1]
    app_index = sh_ten.local_chunk_offset_in_global()
    rows = [
        _overlap_rows(i, af, cf)
        for i, af, cf in zip(app_index, app_fragms, ckpt_fragms, strict=True)
    ]
    row_len = meta.ckpt_reform_global_shape[-1]
    requested: dict[Any, ShardedTensor] = {}
    for chunk in product(*rows):
        offset = tuple(c * ext for c, ext in zip(chunk, with_prepended, strict=True))
        requested[(offset, ckpt_local)] = ShardedTensor(
            sh_ten.key,
            None,
            sh_ten.dtype,
            ckpt_local,
            meta.ckpt_orig_global_shape,
            offset,
            ckpt_fragms,
            sh_ten.replica_id,
            sh_ten.prepend_axis_num,
            sh_ten.allow_shape_mismatch,
            flattened_range=slice(0, row_len),
        )
    logger.debug(
        "tensor %r: %s checkpoint rows overlap the requested chunk", sh_ten.key, len(requested)
    )
    target = sh_ten.without_data()
    device = sh_ten.data.device if sh_ten.data is not None else None

    def build(key: str, data: Any, replica_id: ReplicaId, rng: slice | None) -> ShardedStateDict:
        return dict(requested)

    def merge(loaded: StateDict) -> torch.Tensor:
        return _merge_rows(target, loaded, device)

    return ShardedTensorFactory(
        sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id, sh_ten.flattened_range
    )


@torch.no_grad()
def _merge_rows(
    target: ShardedTensor, loaded: Mapping[Any, torch.Tensor], device: torch.device | None
) -> torch.Tensor:
    """Assemble ``target``'s chunk from loaded checkpoint rows; return its flat range."""
    if not loaded:
        raise CheckpointingException(f"tensor {target.key!r}: no checkpoint row was loaded")
    out = torch.empty(target.local_shape, dtype=target.dtype, device=device)
    p = target.prepend_axis_num
    app_offset = target.global_offset[p:]
    for row_id, row in loaded.items():
        ckpt_offset: tuple[int, ...] = row_id[0]
        ckpt_local: tuple[int, ...] = row_id[1]
        src = row.reshape(ckpt_local)
        dst = out
        for dim, (c_off, c_len, a_off, a_len) in enumerate(
            zip(ckpt_offset[p:], ckpt_local, app_offset, target.local_shape, strict=True)
        ):
            lo, hi = max(c_off, a_off), min(c_off + c_len, a_off + a_len)
            if lo >= hi:
                break
            src = src.narrow(dim, lo - c_off, hi - lo)
            dst = dst.narrow(dim, lo - a_off, hi - lo)
        else:
            dst.copy_(src)
    rng = target.flattened_range
    flat = out.flatten()
    return flat if rng is None else flat[rng]


__all__ = [
    "ReformulationRestoreMetadata",
    "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation",
    "get_reformulation_metadata",
    "is_nd_flattened_tensor",
    "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor",
    "restore_nd_flattened_tensors_formulation",
]
