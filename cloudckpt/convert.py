"""Copy a checkpoint to another URI and/or backend, tensor by tensor.

:func:`convert` reads a committed checkpoint (any backend cloudckpt reads, any store)
and writes it to a new URI with the chosen sharded backend, committing it with a
manifest like any save. Tensors are copied whole, in their global shape: no parallel
layout is involved (the copy is resharding-free), and the target backend chooses its
own chunking. Memory stays bounded: tensors are read and written in batches of at
most ``max_batch_bytes`` (a single larger tensor is its own batch); a torch_dist
target gets one DCP save per batch and one ``.metadata`` for all of them at the end.
ShardedObjects and the common state are copied as they are.

Run it in one process (no process group needed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.commit import claim, commit
from cloudckpt.config import CheckpointConfig, GiB
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.protocol import BatchWritingFormat
from cloudckpt.formats.run import save_uncommitted
from cloudckpt.keys import KeyLayout, gather_keys, tensor_shapes, validate_key_set
from cloudckpt.load_session import LoadSession
from cloudckpt.manifest import Manifest, TensorEntry, common_key_paths
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from cloudckpt.redact import redact_uri
from cloudckpt.session import SaveSession
from cloudckpt.storage import WriteResult
from cloudckpt.storage.limits import path_limits
from cloudckpt.strategies.base import StrategyAction, get_default_strategy

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_BYTES = 1 * GiB
COMMON_BACKEND = ("torch", 1)


def convert(
    src_uri: str,
    dst_uri: str,
    backend: str = "zarr",
    *,
    src_storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    progress: Callable[[int], None] | None = None,
) -> Manifest:
    """Copy the checkpoint at ``src_uri`` to ``dst_uri`` written with ``backend``.

    Args:
        src_uri / dst_uri: committed source; empty destination.
        backend: sharded backend of the copy ("zarr" or "torch_dist"), version 1.
        src_storage_options / dst_storage_options: fsspec options of each side.
        config: part size, in-flight requests and chunk size (both sides).
        max_batch_bytes: tensor bytes held in memory at once (one tensor at least).
        progress: called with the bytes of each copied tensor.

    Returns:
        The destination's manifest.

    Raises:
        UncommittedCheckpointError / CheckpointNotFoundError: about the source.
        CommitConflictError / CheckpointingException: the destination is not empty.
    """
    if dist.get_world_size() != 1:  # raised on every rank at once: no collective to wait in
        raise CheckpointingException(
            f"convert of {redact_uri(src_uri)!r} runs in a single process (world size 1), "
            f"not on rank {dist.get_rank()} of {dist.get_world_size()}: run it outside the "
            "training job, e.g. `cloudckpt convert SRC DST`"
        )
    started = time.perf_counter()
    source = LoadSession.open(src_uri, storage_options=src_storage_options, config=config)
    target = SaveSession.open(
        dst_uri,
        get_default_strategy(StrategyAction.SAVE_SHARDED, backend, 1),
        get_default_strategy(StrategyAction.SAVE_COMMON, *COMMON_BACKEND),
        storage_options=dst_storage_options,
        config=config,
    )
    tensors = source.tensors_metadata()
    objects = _source_objects(source)
    _check_keys(tensors, objects, target)  # before the claim: nothing written on failure
    claimed = claim(target.storage)
    results: list[WriteResult] = [r for r in [claimed] if r is not None]
    write = _BatchWrite(target, objects, results)
    entries = _copy_tensors(source, tensors, target, write, max_batch_bytes, progress)
    write.finish()
    common = source.common_state()
    results += target.common.save_common_to(target.storage, common)
    if not target.format.traits.writes_objects:
        results += target.common.save_objects_to(target.storage, objects)
    manifest = commit(
        target.storage,
        results,
        target.backends,
        entries,
        common_key_paths(common),
        claimed=claimed,
    )
    assert manifest is not None  # world of one: this process is the coordinator
    logger.info(
        "converted %s -> %s (%s): %d tensors, %.1f MB in %.1f s",
        source.storage.uri,
        target.storage.uri,
        backend,
        len(entries),
        manifest.total_size / 1e6,
        time.perf_counter() - started,
    )
    return manifest


class _BatchWrite:
    """Writes the batches of copied tensors (the first with the ShardedObjects when the
    backend stores them; torch_dist: one DCP save per batch, ``.metadata`` at
    :meth:`finish`)."""

    def __init__(
        self, target: SaveSession, objects: ShardedStateDict, results: list[WriteResult]
    ) -> None:
        self.target, self.results = target, results
        self.objects = objects if target.format.traits.writes_objects else {}
        fmt = target.format
        self.batches = (
            fmt.batch_writer(target.storage, target.config)
            if isinstance(fmt, BatchWritingFormat)
            else None
        )

    def __call__(self, batch: ShardedStateDict) -> None:
        state, self.objects = {**batch, **self.objects}, {}
        if self.batches is not None:
            self.results += self.batches.add(state)
        else:
            target = self.target
            self.results += save_uncommitted(target.format, target.storage, state, target.config)

    def finish(self) -> None:
        if self.objects:  # no tensor batch took them: write them alone
            self(self.objects)
        if self.batches is not None:
            self.results.append(self.batches.finish())


def _check_keys(tensors: ShardedStateDict, objects: ShardedStateDict, target: SaveSession) -> None:
    """The source's keys must be storable in the target's layout (a torch_dist checkpoint
    may hold keys that collide once they are zarr paths).

    Raises:
        InvalidKeyError / KeyCollisionError: naming the keys and the target URI.
    """
    shards = [v for v in (*tensors.values(), *objects.values()) if isinstance(v, ShardedBase)]
    limits = path_limits(target.storage.location)
    layout = KeyLayout.of(target.format.traits, limits)
    per_rank = {0: shards}
    validate_key_set(gather_keys(per_rank), layout, target.storage.uri, 0, tensor_shapes(per_rank))


def _copy_tensors(
    source: LoadSession,
    tensors: ShardedStateDict,
    target: SaveSession,
    write: Callable[[ShardedStateDict], None],
    max_batch_bytes: int,
    progress: Callable[[int], None] | None,
) -> list[TensorEntry]:
    entries: list[TensorEntry] = []
    for batch in _batches(tensors, max_batch_bytes):
        copied = _read_batch(source, batch)
        write(copied)
        shards = [v for v in copied.values() if isinstance(v, ShardedTensor)]
        entries += target.format.tensor_entries(shards, target.config)
        if progress is not None:
            progress(sum(_nbytes(sh) for sh in batch))
    return entries


def _nbytes(sh: ShardedTensor) -> int:
    return int(torch.Size(sh.global_shape).numel()) * torch.empty((), dtype=sh.dtype).element_size()


def _batches(tensors: ShardedStateDict, limit: int) -> Iterator[list[ShardedTensor]]:
    batch: list[ShardedTensor] = []
    size = 0
    for sh in (v for _, v in sorted(tensors.items()) if isinstance(v, ShardedTensor)):
        if batch and size + _nbytes(sh) > limit:
            yield batch
            batch, size = [], 0
        batch.append(sh)
        size += _nbytes(sh)
    if batch:
        yield batch


def _read_batch(source: LoadSession, batch: list[ShardedTensor]) -> ShardedStateDict:
    """Read ``batch`` whole from the source, as whole-tensor ShardedTensors."""
    request = {
        sh.key: ShardedTensor.from_rank_offsets(
            sh.key, torch.empty(tuple(sh.global_shape), dtype=sh.dtype)
        )
        for sh in batch
    }
    loaded = source.read(request)
    return {key: ShardedTensor.from_rank_offsets(key, loaded[key]) for key in request}


def _source_objects(source: LoadSession) -> ShardedStateDict:
    """Every stored ShardedObject of the source, with its data."""
    metadata = source.sharded_metadata()
    wanted = {k: v for k, v in metadata.items() if isinstance(v, ShardedObject)}
    if not wanted:
        return {}
    loaded = source.read(wanted)
    return {
        key: ShardedObject(obj.key, loaded[key], obj.global_shape, obj.global_offset)
        for key, obj in wanted.items()
    }
