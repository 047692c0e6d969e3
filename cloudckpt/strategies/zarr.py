"""Zarr backend ("zarr", version 1): one zarr v2 array per ShardedTensor key.

Byte-compatible with Megatron-Core 0.15's zarr backend: ``<key>/.zarray`` plus one
object per chunk, the chunk being the local shard shape. A shard larger than the
strategy's ``chunk_size`` is split into several chunks (a regular grid of smaller
chunks, see :func:`cloudckpt.formats.zarr.layout.split_chunk_shape`), so that no object is
unbounded; every chunk is a contiguous slice of the shard's bytes, written without a
copy. All ranks derive the same chunk shape from the shared local shape and dtype,
so no communication is needed. Each main-replica shard is written exactly once, by
the rank that holds it; shards of flattened tensors (distributed-optimizer state
split into flat ranges over data-parallel ranks) are first assembled on one rank
(see :mod:`cloudckpt.planning`). Chunk bytes go through :mod:`cloudckpt.storage`, so
any fsspec URI works. Loading reshards: each requested shard reads the chunks (and,
for raw chunks, only the byte ranges) it overlaps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.commit import amend_manifest
from cloudckpt.config import DEFAULT_CHUNK_SIZE, CheckpointConfig
from cloudckpt.dict_utils import dict_list_map_outplace, nested_values
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
)
from cloudckpt.formats.zarr.layout import (
    ZARRAY,
    ArrayMeta,
    encode_dtype,
    shard_chunk_indices,
    split_chunk_shape,
    tensor_bytes,
)
from cloudckpt.formats.zarr.reader import TensorReader
from cloudckpt.manifest import TensorEntry
from cloudckpt.mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from cloudckpt.planning import RankFlatPlan, flat_shard_table, plan_flat_exchange
from cloudckpt.storage import CheckpointStorage, FileSystem, WriteResult, open_checkpoint
from cloudckpt.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    SingleFormatLoadMixin,
    StrategyAction,
    register_default_strategy,
)
from cloudckpt.strategies.bound import ShardedLoadMixin, ShardedSaveMixin
from cloudckpt.validation import chunk_index, chunk_shape

logger = logging.getLogger(__name__)

BACKEND = "zarr"
VERSION = 1

Write = tuple[str, Any]  # (relative path, buffer)
ChunkId = tuple[str, tuple[int, ...]]  # (tensor key, chunk index)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of a device tensor; CPU tensors are returned as they are.

    The device-to-host copy is synchronous: when this returns, the bytes are on the
    host and the training step may modify the device tensor again.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()


def _array_meta(sh: ShardedTensor, chunk_size: int | None) -> ArrayMeta:
    """The ``.zarray`` of ``sh``'s array: the same on every rank (shards share shape, dtype)."""
    encode_dtype(sh.dtype, sh.key)  # fail early, naming the key, on an unsupported dtype
    itemsize = torch.empty((), dtype=sh.dtype).element_size()
    chunks = split_chunk_shape(chunk_shape(sh), itemsize, chunk_size)
    return ArrayMeta(shape=tuple(sh.global_shape), chunks=chunks, dtype=sh.dtype)


def _shard_writes(
    sh: ShardedTensor, meta: ArrayMeta, index: tuple[int, ...], data: memoryview
) -> list[Write]:
    """The objects of one whole shard: its chunks, and ``.zarray`` for shard (0, ..., 0).

    ``data`` is the shard's C-order bytes; each chunk is a contiguous slice of it
    (no copy), in the order :func:`shard_chunk_indices` lists the chunks.
    """
    indices = shard_chunk_indices(index, chunk_shape(sh), meta.chunks)
    size = meta.chunk_nbytes
    if size * len(indices) != len(data):
        raise CheckpointingException(
            f"tensor {sh.key!r}: shard has {len(data)} bytes, expected {len(indices)} "
            f"chunk(s) of {size} bytes (chunk shape {meta.chunks})"
        )
    writes = _zarray_write(sh, meta, index)
    if len(indices) == 1:  # the common case: the shard is one chunk, as Megatron-Core writes
        return [*writes, (f"{sh.key}/{meta.chunk_key(indices[0])}", data)]
    for j, chunk in enumerate(indices):
        writes.append((f"{sh.key}/{meta.chunk_key(chunk)}", data[j * size : (j + 1) * size]))
    return writes


class ZarrSaveShardedStrategy(ShardedSaveMixin, SaveShardedStrategy):
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

    def _chunk_size(self, config: CheckpointConfig | None) -> int | None:
        """The strategy's own config, else the save's, else its ``chunk_size``."""
        config = self.config or config
        return config.chunk_size if config is not None else self.chunk_size

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        """Manifest entries (global shape, dtype, zarr chunk shape) of ``tensors``."""
        entries = {}
        for sh in tensors:
            meta = _array_meta(sh, self._chunk_size(config))
            dtype = str(sh.dtype).removeprefix("torch.")
            entries[sh.key] = TensorEntry(sh.key, tuple(sh.global_shape), dtype, meta.chunks)
        return list(entries.values())

    def save_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> list[WriteResult]:
        """Write this rank's main-replica chunks; collective when tensors are flattened.

        Returns:
            One WriteResult per object this rank wrote.
        """
        tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        flat = [t for t in tensors if t.flattened_range is not None]
        chunk_size = self._chunk_size(config)
        writes = []
        if dist.all_reduce_int(int(bool(flat)), op="max"):  # collective: any rank with flat ones
            writes = self._flat_writes(flat, chunk_size)
        regular = [t for t in tensors if t.flattened_range is None]
        writes += self._regular_writes(regular, chunk_size)
        return storage.write_many(writes)

    def _regular_writes(self, tensors: list[ShardedTensor], chunk_size: int | None) -> list[Write]:
        writes: list[Write] = []
        for sh in tensors:
            if not is_main_replica(sh.replica_id):
                continue
            if sh.data is None:
                raise CheckpointingException(f"tensor {sh.key!r} has no data to save")
            meta, index = _array_meta(sh, chunk_size), _require_index(sh)
            writes += _shard_writes(sh, meta, index, tensor_bytes(_to_host(sh.data)))
        return writes

    def _flat_writes(self, tensors: list[ShardedTensor], chunk_size: int | None) -> list[Write]:
        """Assemble flattened chunks on their planned ranks and return the writes.

        Each rank sends the coordinator a small table of its main-replica pieces
        (:func:`~cloudckpt.planning.flat_shard_table`); the coordinator alone plans the
        assembly (:func:`~cloudckpt.planning.plan_flat_exchange`) and sends each rank only
        its own transfers, so what a rank sends and receives does not grow with the
        world size. A failure on any rank (here or on the coordinator) is raised on
        every rank after the plans are scattered, before any tensor moves.
        """
        failure: Exception | None = None
        local: list[tuple[ShardedTensor, tuple[int, ...]]] = []
        table = None
        try:
            local, table = _flat_table(tensors)
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement below
            failure = exc
        with dist.paused_gc():  # every rank's table, planned at once on the coordinator
            tables = dist.gather_object(table, what="gathering the flattened pieces")
            plans: list[RankFlatPlan | None] | None = None
            if tables is not None:
                plans, failure = _plan_on_coordinator(tables, failure)
            plan = dist.scatter_object(plans, what="scattering the flattened chunks' plans")
            del tables, plans  # before the collector runs again
        with dist.agree("planning the assembly of flattened chunks"):  # peers must not wait
            if failure is not None:
                raise failure
            buffers, sends, recvs = (
                _exchange_plan(plan, local) if plan is not None else ([], [], [])
            )
        dist.exchange_tensors(sends, recvs)
        writes: list[Write] = []
        for sample, index, buffer in buffers:
            meta = _array_meta(sample, chunk_size)
            writes += _shard_writes(sample, meta, index, tensor_bytes(buffer))
        return writes


def _flat_table(
    tensors: list[ShardedTensor],
) -> tuple[list[tuple[ShardedTensor, tuple[int, ...]]], Any]:
    """This rank's main-replica flattened shards (with their chunk index) in the order of
    the rows of their :func:`~cloudckpt.planning.flat_shard_table`, and the table."""
    shards = [(t, _require_index(t)) for t in tensors if is_main_replica(t.replica_id)]
    pieces = []
    for t, index in shards:
        rng = t.flattened_range
        assert rng is not None
        pieces.append((t.key, index, rng.start, rng.stop, math.prod(chunk_shape(t))))
    order, table = flat_shard_table(pieces)
    return [shards[i] for i in order], table


def _plan_on_coordinator(
    tables: list[Any], failure: Exception | None
) -> tuple[list[RankFlatPlan | None], Exception | None]:
    """Every rank's plan; None for every rank when a rank sent no table (it failed: it
    raises in the agreement) or the planning fails (then the coordinator raises it)."""
    if failure is None and all(t is not None for t in tables):
        try:
            return list(plan_flat_exchange(tables)), None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the agreement
            failure = exc
    return [None] * len(tables), failure


def _require_index(sh: ShardedTensor) -> tuple[int, ...]:
    index = chunk_index(sh)
    if index is None:
        raise CheckpointingException(
            f"tensor {sh.key!r}: offset {tuple(sh.global_offset)} is not on the chunk grid of "
            f"local shape {tuple(sh.local_shape)}; the zarr backend needs a regular grid"
        )
    return index


def _zarray_write(sh: ShardedTensor, meta: ArrayMeta, index: tuple[int, ...]) -> list[Write]:
    """The ``.zarray`` object, written by whoever writes shard (0, ..., 0)."""
    return [(f"{sh.key}/{ZARRAY}", meta.to_json())] if not any(index) else []


def _exchange_plan(
    plan: RankFlatPlan, local: list[tuple[ShardedTensor, tuple[int, ...]]]
) -> tuple[
    list[tuple[ShardedTensor, tuple[int, ...], torch.Tensor]],
    list[dist.Transfer],
    list[dist.Transfer],
]:
    """The chunk buffers this rank assembles (with a shard of each and its chunk index),
    and the transfers that fill them and the other ranks' buffers.

    ``local`` holds this rank's pieces in the rows of its table: the rows ``plan`` sends
    go to their assemblers; every other row is a piece of a chunk this rank assembles.
    The tags are the coordinator's (unique per piece), so sends and receives pair up.
    """
    sends: list[dist.Transfer] = []
    sent = set()
    for row, assembler, tag in plan.sends.tolist():
        sent.add(row)
        sends.append((assembler, tag, _to_host(local[row][0].data)))
    chunks: dict[ChunkId, torch.Tensor] = {}
    buffers = []
    for row, (sh, index) in enumerate(local):
        if row in sent:
            continue
        buffer = chunks.get((sh.key, index))
        if buffer is None:
            buffer = chunks[(sh.key, index)] = torch.empty(chunk_shape(sh), dtype=sh.dtype)
            buffers.append((sh, index, buffer))
        rng = sh.flattened_range
        assert rng is not None
        buffer.view(-1)[rng.start : rng.stop] = _to_host(sh.data)  # type: ignore[arg-type]
    recvs: list[dist.Transfer] = []
    for row, peer, start, stop, tag in plan.recvs.tolist():
        sh, index = local[row]
        recvs.append((peer, tag, chunks[(sh.key, index)].view(-1)[start:stop]))
    return buffers, sends, recvs


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
