"""Megatron-Core's ``strategies.checkpointable``: ShardedTensors as PyTorch DCP
checkpointables. The implementation is the torch_dist format's
(:mod:`cloudckpt.formats.dcp.checkpointable`)."""

from cloudckpt.formats.dcp.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    dcp_chunk,
    dcp_global_shape,
    is_nd_flattened,
)

__all__ = [
    "CheckpointableShardedTensor",
    "LocalShardsContainer",
    "dcp_chunk",
    "dcp_global_shape",
    "is_nd_flattened",
]
