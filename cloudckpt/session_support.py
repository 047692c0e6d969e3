"""What save and load sessions share: opening a checkpoint's storage for the job, this
rank's shards without their data, and the logging of a rank's failure and throughput."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from cloudckpt import dist
from cloudckpt.config import CheckpointConfig
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from cloudckpt.storage import CheckpointStorage, open_checkpoint, validate_relpath

logger = logging.getLogger(__name__)


def open_storage(
    uri: str,
    strategy: Any,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None,
) -> CheckpointStorage:
    """The checkpoint's storage, from the call's options and config, else the
    strategy's own (``fs``, ``storage_options``, ``config``); refuses a store the other
    ranks cannot see."""
    storage = open_checkpoint(
        uri,
        getattr(strategy, "fs", None),
        storage_options or getattr(strategy, "storage_options", None),
        config=config or getattr(strategy, "config", None),
    )
    world = dist.get_world_size()
    if storage.process_local and world > 1:
        raise CheckpointingException(
            f"checkpoint {storage.uri!r} is in this process's memory (memory://), which "
            f"the other {world - 1} rank(s) cannot see: use a local directory or an object "
            f"store URI with {world} ranks (rank {dist.get_rank()})"
        )
    return storage


def local_metadata(
    sharded: ShardedStateDict, uri: str, check_keys: bool = True
) -> list[ShardedBase]:
    """This rank's shards without data, keys checked as object paths (unless
    ``check_keys`` is False: a save checks every rank's keys at once)."""
    metadata = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedBase):
            if check_keys:
                validate_relpath(value.key, uri)
            metadata.append(without_data(value))
    return metadata


def without_data(sh: ShardedBase) -> ShardedBase:
    """``sh.without_data()``; for cloudckpt's own ShardedTensor and ShardedObject (every
    field an ``__init__`` field) a copy of its attributes whose ``__post_init__`` runs
    again, which is what ``dataclasses.replace`` does, at a fraction of its cost."""
    if type(sh) not in _PLAIN_SHARDS:
        return sh.without_data()
    copied = object.__new__(type(sh))
    copied.__dict__.update(sh.__dict__)
    copied.__dict__["data"] = None
    copied.__post_init__()  # type: ignore[attr-defined]
    return copied


_PLAIN_SHARDS = (ShardedTensor, ShardedObject)


@contextlib.contextmanager
def logged_failure(verb: str, shown: str) -> Iterator[None]:
    """Log this rank's own failure (an agreement then raises it on every rank)."""
    try:
        yield
    except Exception as exc:
        logger.error("rank %d failed to %s %s: %s", dist.get_rank(), verb, shown, exc)
        raise


def log_rate(verb: str, uri: str, nbytes: int, count: int, started: float) -> None:
    """Log one rank's throughput of a save or load at DEBUG (Megatron-Core's save and
    load log nothing at INFO, and its own tests check that)."""
    elapsed = max(time.perf_counter() - started, 1e-9)
    logger.debug(
        "rank %d %s %s: %d objects, %.1f MB in %.2f s (%.1f MB/s)",
        dist.get_rank(),
        verb,
        uri,
        count,
        nbytes / 1e6,
        elapsed,
        nbytes / 1e6 / elapsed,
    )
