"""Zarr backend ("zarr", version 1): Megatron-Core 0.15's zarr strategies, one zarr v2
array per ShardedTensor key. The format is :mod:`cloudckpt.formats.zarr` (the save side in
:mod:`~cloudckpt.formats.zarr.save`, resharded reads in :mod:`~cloudckpt.formats.zarr.
reader`); the strategies here hold the settings and Megatron-Core's signatures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from cloudckpt.commit_state import amend_manifest
from cloudckpt.config import DEFAULT_CHUNK_SIZE, CheckpointConfig
from cloudckpt.dict_utils import dict_list_map_outplace, nested_values
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
)
from cloudckpt.formats.zarr.reader import TensorReader
from cloudckpt.formats.zarr.save import ZarrFormat
from cloudckpt.mapping import ShardedStateDict, ShardedTensor, StateDict
from cloudckpt.storage import CheckpointStorage, FileSystem, open_checkpoint
from cloudckpt.strategies.base import (
    FormatSaveMixin,
    LoadShardedStrategy,
    SaveShardedStrategy,
    ShardedLoadMixin,
    SingleFormatLoadMixin,
    StrategyAction,
    register_default_strategy,
)

logger = logging.getLogger(__name__)

BACKEND = "zarr"
VERSION = 1


class ZarrSaveShardedStrategy(FormatSaveMixin, SaveShardedStrategy):
    """Save ShardedTensors as zarr v2 arrays through the storage layer.

    Args:
        backend: must be "zarr".
        version: format version (1).
        fs: an fsspec filesystem to use instead of resolving one from the URI.
        storage_options: options for the filesystem resolved from the URI.
        chunk_size: largest chunk (object) in bytes; a larger shard is split into
            several chunks. None writes every shard as one chunk, however large.
        config: a :class:`~cloudckpt.config.CheckpointConfig`; when set (here or by
            ``save(..., config=...)``), its ``chunk_size`` wins over ``chunk_size``.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        config: CheckpointConfig | None = None,
    ) -> None:
        super().__init__(backend, version)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of bytes or None: {chunk_size}")
        self.chunk_size = chunk_size
        self._set_storage(fs, storage_options, config)

    def save_format(self) -> ZarrFormat:
        """The zarr format with this strategy's settings (what a session drives)."""
        return ZarrFormat(self.chunk_size, self.config)


class ZarrLoadShardedStrategy(SingleFormatLoadMixin, ShardedLoadMixin, LoadShardedStrategy):
    """Load ShardedTensors from zarr v2 arrays, resharding as needed.

    Reads checkpoints written by cloudckpt and by Megatron-Core's zarr backend
    (compressed chunks included).
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self.version = version
        self._set_storage(fs, storage_options)

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        """Return ``sharded_state_dict`` with every ShardedTensor replaced by its data."""
        reader = TensorReader(storage)
        tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        loaded = reader.load_all(tensors)

        def replace(value: Any) -> Any:
            return loaded[id(value)] if isinstance(value, ShardedTensor) else value

        return dict_list_map_outplace(replace, sharded_state_dict)

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (meta-device data, one shard) for every stored array."""
        metas = TensorReader(storage).all_array_metas()
        return {
            key: ShardedTensor.from_rank_offsets(
                key, torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            )
            for key, meta in metas.items()
        }

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        """Delete every array whose key starts with ``key_prefix``."""
        removed = [key for key in TensorReader(storage).array_keys() if key.startswith(key_prefix)]
        for key in removed:
            logger.info("removing tensor %s from %s", key, storage.uri)
            storage.delete(key, recursive=True)
        if removed:
            amend_manifest(storage, deleted=removed, removed_tensors=removed)


def load_zarr_based_sharded_metadata(
    checkpoint_dir: str, get_shape_dtype_fn: Callable[[str], tuple[tuple[int, ...], torch.dtype]]
) -> ShardedStateDict:
    """Megatron-compatible helper: metadata of every array via ``get_shape_dtype_fn(key)``."""
    storage = open_checkpoint(checkpoint_dir)
    out: ShardedStateDict = {}
    for key in TensorReader(storage).array_keys():
        shape, dtype = get_shape_dtype_fn(key)
        out[key] = ShardedTensor.from_rank_offsets(
            key, torch.empty(shape, dtype=dtype, device="meta")
        )
    if not out:
        raise CheckpointNotFoundError(f"no zarr arrays found in {checkpoint_dir!r}")
    return out


def flatten_range(sharded_tensor: ShardedTensor, x: torch.Tensor) -> torch.Tensor:
    """Apply ``sharded_tensor.flattened_range`` (if any) to ``x`` of the local shape."""
    if sharded_tensor.flattened_range is None:
        return x
    return x.reshape(-1)[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: torch.Tensor, expected_sharded_ten: ShardedTensor) -> torch.Tensor:
    """Cut ``x`` to, or zero-pad it to, the local shape ``expected_sharded_ten`` asks for.

    Used with ``allow_shape_mismatch``: the stored tensor's global shape may differ
    from the requested one; extra elements are dropped and missing ones are zeros,
    at the end of each axis.
    """
    expected = tuple(expected_sharded_ten.local_shape)
    if tuple(x.shape) == expected:
        return x
    if x.dim() != len(expected):
        raise CheckpointingException(
            f"tensor {expected_sharded_ten.key!r}: cannot pad a {x.dim()}-d tensor to "
            f"shape {expected}"
        )
    out = torch.zeros(expected, dtype=x.dtype, device=x.device)
    common = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, expected, strict=True))
    out[common] = x[common]
    return out


def register_default_zarr_strategies() -> None:
    """Register the zarr save and load strategies as defaults for ("zarr", 1)."""
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ZarrSaveShardedStrategy()
    )
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ZarrLoadShardedStrategy()
    )


register_default_zarr_strategies()
