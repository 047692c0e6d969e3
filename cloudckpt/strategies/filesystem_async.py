"""An asynchronous DCP storage writer over cloudckpt's storage (Megatron-Core's
``strategies.filesystem_async``).

:class:`FileSystemWriterAsync` splits a DCP save into Megatron-Core's three steps:

1. :meth:`~FileSystemWriterAsync.prepare_write_data` (training thread, after planning)
   serializes this rank's items into host-memory ``.distcp`` objects, so training may
   change its tensors right after it returns;
2. the function of :meth:`~FileSystemWriterAsync.get_save_function_and_args` uploads
   those objects; it is what an :class:`~cloudckpt.strategies.async_utils.AsyncRequest`
   runs in the background;
3. :meth:`~FileSystemWriterAsync.retrieve_write_results` hands DCP the results for
   ``.metadata``, written by the coordinator in ``finish``
   (:func:`cloudckpt.strategies.state_dict_saver.save_state_dict_async_finalize`).

Unlike Megatron-Core's writer (files on a POSIX file system, one per writer thread,
forked processes), this one uploads through :class:`~cloudckpt.storage.CheckpointStorage`
to any URI cloudckpt supports, with the storage pool's concurrency, objects of
``object_size`` bytes and no rename; ``path`` may be a URI, a local path or an opened
storage. The cloudckpt write results (path, size, CRC-32C) of every object are in
:attr:`~cloudckpt.formats.dcp.storage.CloudStorageWriter.results` for a manifest.
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult
from torch.futures import Future

from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.objects import BufferedObject
from cloudckpt.formats.dcp.storage import DEFAULT_OBJECT_SIZE, CloudStorageWriter
from cloudckpt.storage import CheckpointStorage, WriteResult, open_checkpoint
from cloudckpt.storage.location import checkpoint_uri

logger = logging.getLogger(__name__)

#: ``torch.distributed.checkpoint.FileSystemWriter`` options Megatron-Core passes on;
#: accepted, with no effect here (uploads need no files, threads or fsync).
FILESYSTEM_WRITER_OPTIONS = frozenset(
    {
        "single_file_per_rank",
        "sync_files",
        "thread_count",
        "per_thread_copy_ahead",
        "overwrite",
        "cache_staged_state_dict",
    }
)

#: Megatron-Core's queue through which its forked writer processes report their results
#: (created by the first multiprocess write). cloudckpt uploads from threads of the
#: training process and hands their results to the async request, so no such queue ever
#: exists: None, the value Megatron-Core's training loop tests before shutting one down.
_results_queue: Any = None

_local_results: queue.SimpleQueue[Any] | None = None


def get_write_results_queue(mp_mode: str = "spawn") -> queue.SimpleQueue[Any]:
    """Megatron-Core's: the queue its writer processes report their results through.

    cloudckpt's writer uploads from threads of the training process and hands its
    results to the async request directly, so nothing is ever put here: this returns
    one process-local queue (the same at every call) for the callers that create it
    ahead, as Megatron-LM's training loop does, and starts no process. ``mp_mode`` is
    checked, not used.

    Raises:
        ValueError: ``mp_mode`` is not a multiprocessing start method.
    """
    global _local_results  # noqa: PLW0603 - one per process, as Megatron-Core's
    if mp_mode not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"mp_mode {mp_mode!r} is not a start method (spawn, fork, forkserver)")
    if _local_results is None:
        _local_results = queue.SimpleQueue()
    return _local_results


#: The staged objects of one rank: ``[(object path, bytes)]``.
WriteBuckets = list[tuple[str, memoryview]]


@dataclass
class _Outcome:
    """What the upload function leaves for :meth:`FileSystemWriterAsync.retrieve_write_results`."""

    uploaded: list[WriteResult] | None = None
    error: BaseException | None = None
    done: bool = False
    items: list[DcpWriteResult] = field(default_factory=list)


def _upload_buckets(
    storage: CheckpointStorage, write_buckets: WriteBuckets, outcome: _Outcome
) -> None:
    """Upload the staged objects (the async function); record the outcome, then raise
    the error if any (so the async call fails too)."""
    try:
        outcome.uploaded = storage.write_many(write_buckets) if write_buckets else []
    except BaseException as exc:
        outcome.error = exc
        raise
    finally:
        outcome.done = True


class FileSystemWriterAsync(CloudStorageWriter):
    """DCP storage writer whose uploads run apart from planning (see the module docstring).

    Args:
        path: the checkpoint: URI, local path or :class:`CheckpointStorage`.
        *args: positional options of PyTorch's ``FileSystemWriter`` (accepted, unused).
        separation_hint: items whose key starts with it go to objects of their own.
        use_msc: Megatron-Core's Multi-Storage Client switch; cloudckpt's storage
            already reaches object stores, so it must be False.
        object_size: target size of one ``.distcp`` object in bytes.
        storage_options, config: for opening ``path`` when it is a URI.
        **kwargs: options of PyTorch's ``FileSystemWriter`` (see
            :data:`FILESYSTEM_WRITER_OPTIONS`; accepted, unused).

    Raises:
        TypeError: an unknown keyword argument.
        CheckpointingException: ``use_msc=True``.
    """

    #: Planning goes through the coordinator (it merges the N-D flattened metadata).
    can_run_decentralized_global_plan = False

    keeps_plan_items = True  # its global step is cloudckpt's writer's; its writes differ

    def __init__(
        self,
        path: str | os.PathLike[str] | CheckpointStorage,
        *args: Any,
        separation_hint: str | None = None,
        use_msc: bool = False,
        object_size: int = DEFAULT_OBJECT_SIZE,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - FILESYSTEM_WRITER_OPTIONS
        if unknown:
            raise TypeError(f"FileSystemWriterAsync got unexpected arguments {sorted(unknown)}")
        if use_msc:
            raise CheckpointingException(
                "use_msc=True: cloudckpt reaches object stores through its own storage layer; "
                "pass the object store URI as path instead"
            )
        storage = (
            path
            if isinstance(path, CheckpointStorage)
            else open_checkpoint(
                checkpoint_uri(path), storage_options=storage_options, config=config
            )
        )
        super().__init__(storage, object_size, separation_hint=separation_hint)
        self.write_buckets: WriteBuckets | None = None
        self._outcome = _Outcome()

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Serialize this rank's items of ``plan`` into host-memory objects (staging)."""
        prefix = plan.storage_data.prefix
        buckets: WriteBuckets = []
        outcome = _Outcome()
        for obj, items in self._objects(prefix, plan.items, planner, BufferedObject):
            buckets.append((obj.path, obj.payload()))
            outcome.items += items
        self.write_buckets, self._outcome = buckets, outcome
        logger.debug(
            "staged %s object(s), %s bytes for %s",
            len(buckets),
            sum(len(b) for _, b in buckets),
            self.storage.uri,
        )

    def get_save_function_and_args(
        self,
    ) -> tuple[Callable[..., None] | None, Callable[[], WriteBuckets] | None, tuple[Any, ...]]:
        """``(save_fn, preload_fn, args)`` for an AsyncRequest (Megatron-Core's shape).

        ``save_fn(*args)`` uploads the staged objects; ``args[1]`` are the write buckets.
        ``preload_fn`` is None: :meth:`prepare_write_data` staged them already. With
        nothing staged, ``(None, None, ())``.

        Raises:
            CheckpointingException: :meth:`prepare_write_data` was not called.
        """
        if self.write_buckets is None:
            raise CheckpointingException(
                f"FileSystemWriterAsync for {self.storage.uri!r}: prepare_write_data first"
            )
        if not self.write_buckets:
            self._outcome.uploaded, self._outcome.done = [], True
            return None, None, ()
        return _upload_buckets, None, (self.storage, self.write_buckets, self._outcome)

    def retrieve_write_results(self) -> list[DcpWriteResult]:
        """DCP's write results of the staged items, once the upload is done.

        Raises:
            CheckpointingException: the upload has not run, or failed (chained).
        """
        outcome = self._outcome
        if outcome.error is not None:
            raise CheckpointingException(
                f"uploading the objects of {self.storage.uri!r} failed: {outcome.error}"
            ) from outcome.error
        if not outcome.done or outcome.uploaded is None:
            raise CheckpointingException(
                f"the objects of {self.storage.uri!r} were not uploaded yet"
            )
        self.results += outcome.uploaded
        self.write_buckets = None
        return list(outcome.items)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[DcpWriteResult]]:
        """Synchronous DCP write: stage, upload and return the results at once."""
        self.prepare_write_data(plan, planner)
        save_fn, _, args = self.get_save_function_and_args()
        if save_fn is not None:
            save_fn(*args)
        future: Future[list[DcpWriteResult]] = Future()
        future.set_result(self.retrieve_write_results())
        return future


__all__ = [
    "FILESYSTEM_WRITER_OPTIONS",
    "FileSystemWriterAsync",
    "WriteBuckets",
    "get_write_results_queue",
]
