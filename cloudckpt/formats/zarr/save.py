"""The zarr format's save side: :class:`ZarrFormat`, the format protocol
(:mod:`cloudckpt.formats.protocol`) for one zarr v2 array per ShardedTensor key.

Byte-compatible with Megatron-Core 0.15's zarr backend: ``<key>/.zarray`` plus one
object per chunk, the chunk being the local shard shape. A shard larger than the
format's ``chunk_size`` is split into several chunks (a regular grid of smaller chunks,
see :func:`cloudckpt.formats.zarr.layout.split_chunk_shape`), so that no object is
unbounded; every chunk is a contiguous slice of the shard's bytes, written without a
copy. All ranks derive the same chunk shape from the shared local shape and dtype, so
no communication is needed. Each main-replica shard is written exactly once, by the
rank that holds it; shards of flattened tensors (distributed-optimizer state split into
flat ranges over data-parallel ranks) are first assembled on one rank (see
:mod:`cloudckpt.planning`): that exchange is the plan's collective work, with one
integer all-reduce (does any rank hold flattened shards?) before it. ``write`` then
writes the planned objects (no collective); the format has nothing to finish.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.config import CheckpointConfig
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.protocol import FormatTraits, Written
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.formats.zarr.layout import (
    ZARRAY,
    ArrayMeta,
    encode_dtype,
    shard_chunk_indices,
    split_chunk_shape,
)
from cloudckpt.manifest import TensorEntry
from cloudckpt.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from cloudckpt.planning import RankFlatPlan, flat_shard_table, plan_flat_exchange
from cloudckpt.storage import CheckpointStorage, WriteResult
from cloudckpt.validation import chunk_index, chunk_shape

logger = logging.getLogger(__name__)

BACKEND = "zarr"
VERSION = 1
TRAITS = FormatTraits(BACKEND, VERSION, tensor_dirs=True, writes_objects=False, regular_grid=True)

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


def regular_writes(tensors: list[ShardedTensor], chunk_size: int | None) -> list[Write]:
    writes: list[Write] = []
    for sh in tensors:
        if not is_main_replica(sh.replica_id):
            continue
        if sh.data is None:
            raise CheckpointingException(f"tensor {sh.key!r} has no data to save")
        meta, index = _array_meta(sh, chunk_size), _require_index(sh)
        writes += _shard_writes(sh, meta, index, tensor_bytes(_to_host(sh.data)))
    return writes


def flat_writes(tensors: list[ShardedTensor], chunk_size: int | None) -> list[Write]:
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
        buffers, sends, recvs = _exchange_plan(plan, local) if plan is not None else ([], [], [])
    dist.exchange_tensors(sends, recvs)
    writes: list[Write] = []
    for sample, index, buffer in buffers:
        meta = _array_meta(sample, chunk_size)
        writes += _shard_writes(sample, meta, index, tensor_bytes(buffer))
    return writes


@dataclass(frozen=True)
class ZarrFormat:
    """The zarr format with one strategy's settings (see the module docstring).

    Attributes:
        chunk_size: largest chunk (object) in bytes; None writes every shard as one chunk.
        config: the strategy's own config; its ``chunk_size`` wins over the save's and
            over ``chunk_size``.
    """

    chunk_size: int | None
    config: CheckpointConfig | None = None

    @property
    def traits(self) -> FormatTraits:
        return TRAITS

    def effective_chunk_size(self, config: CheckpointConfig | None) -> int | None:
        """The strategy's own config, else the save's, else ``chunk_size``."""
        config = self.config or config
        return config.chunk_size if config is not None else self.chunk_size

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        """Manifest entries (global shape, dtype, zarr chunk shape) of ``tensors``."""
        entries = {}
        for sh in tensors:
            meta = _array_meta(sh, self.effective_chunk_size(config))
            dtype = str(sh.dtype).removeprefix("torch.")
            entries[sh.key] = TensorEntry(sh.key, tuple(sh.global_shape), dtype, meta.chunks)
        return list(entries.values())

    def plan(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
        *,
        staged: bool = False,
    ) -> ZarrPlannedWrite:
        """This rank's objects (collective when tensors are flattened: their chunks are
        assembled here). The format does not stage itself: an async save writes into
        host memory (``storage``) before it returns."""
        tensors = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        flat = [t for t in tensors if t.flattened_range is not None]
        chunk_size = self.effective_chunk_size(config)
        writes = []
        if dist.all_reduce_int(int(bool(flat)), op="max"):  # collective: any rank with flat ones
            writes = flat_writes(flat, chunk_size)
        regular = [t for t in tensors if t.flattened_range is None]
        writes += regular_writes(regular, chunk_size)
        return ZarrPlannedWrite(storage, writes)


@dataclass(frozen=True)
class ZarrPlannedWrite:
    """A zarr save planned on this rank: the objects to write."""

    storage: CheckpointStorage
    writes: list[Write]

    def write(self) -> Written:
        """Write this rank's chunks and ``.zarray`` objects (no collective)."""
        return Written(self.storage.write_many(self.writes))

    def finish(self, payloads: Sequence[Any]) -> list[WriteResult]:
        """Nothing: every object was written by its rank."""
        return []


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


__all__ = [
    "BACKEND",
    "TRAITS",
    "VERSION",
    "ZarrFormat",
    "ZarrPlannedWrite",
    "flat_writes",
    "regular_writes",
]
