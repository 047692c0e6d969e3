"""The torch_dist format's save side: :class:`DcpFormat`, the format protocol
(:mod:`cloudckpt.formats.protocol`) over PyTorch DCP's plan / write / finish steps.

``plan`` runs DCP's planning with cloudckpt's bounded collectives
(:func:`~cloudckpt.formats.dcp.steps.plan_save`: the local plans gathered, the
coordinator's step, the updates scattered; with a :class:`~cloudckpt.formats.dcp.steps.
SavePlanCache`, one integer all-reduce while no rank's plan changed). Staged (an async
save), this rank's main replicas are first copied to host memory
(:func:`host_copy`). ``write`` serializes and uploads this rank's items into ``.distcp``
objects (no collective) and returns their DCP write results as its payload; the
coordinator's ``finish`` writes ``.metadata`` from every rank's.

The DCP state dict: a ShardedTensor's DCP key is its ``key`` (several shards of one key a
``LocalShardsContainer``), a ShardedObject's its ``unique_key``, stored as the
``torch.save([data])`` bytes Megatron-Core stores (and expects).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import pickle
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from cloudckpt.config import CheckpointConfig
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    is_nd_flattened,
)
from cloudckpt.formats.dcp.errors import save_failure
from cloudckpt.formats.dcp.metadata_build import merge_metadata
from cloudckpt.formats.dcp.plan import LinearGlobalPlanMixin
from cloudckpt.formats.dcp.reader import ORIG_SHAPE_KEY
from cloudckpt.formats.dcp.steps import PlannedSave, SavePlanCache, plan_save, save_state_dict
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.formats.host_copies import HOST_COPIES
from cloudckpt.formats.protocol import FormatTraits, Written
from cloudckpt.manifest import TensorEntry
from cloudckpt.mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from cloudckpt.storage import CheckpointStorage, WriteResult

logger = logging.getLogger(__name__)

BACKEND = "torch_dist"
VERSION = 1
TRAITS = FormatTraits(
    BACKEND, VERSION, tensor_dirs=False, writes_objects=True, regular_grid=False, stages_itself=True
)
_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def to_dcp_state_dict(
    sharded_state_dict: ShardedStateDict,
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """This rank's DCP state dict (main replicas only) and the per-key ``mcore_data``.

    ShardedTensors become CheckpointableShardedTensors (several shards of one key a
    LocalShardsContainer); ShardedObjects become ``BytesIO`` of ``torch.save([data])``,
    the one-element list Megatron-Core stores (and expects) for each object.
    """
    shards: dict[str, list[CheckpointableShardedTensor]] = {}
    state: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            shards.setdefault(value.key, []).append(CheckpointableShardedTensor.from_sh_ten(value))
            if is_nd_flattened(value):
                extra[value.key] = {ORIG_SHAPE_KEY: tuple(value.global_shape)}
        elif isinstance(value, ShardedObject) and is_main_replica(value.replica_id):
            buffer = io.BytesIO()
            torch.save([value.data], buffer)
            state[value.unique_key] = buffer
    for key, local in shards.items():
        state[key] = local[0] if len(local) == 1 else LocalShardsContainer(list(local))
    return state, extra


class _PackedObjectsSavePlanner(LinearGlobalPlanMixin):
    """DCP's default planner, except that bytes items are stored as the ``BytesIO``
    already holds them (``torch.save([data])``, as Megatron-Core stores ShardedObjects)
    instead of being pickled once more. It leaves the metadata a plain DCP ``Metadata``
    (the writer adds ``mcore_data``), so that no cloudckpt class is pickled into a
    checkpoint that stock Megatron-Core must read. The coordinator's step is linear
    (:class:`~cloudckpt.formats.dcp.plan.LinearGlobalPlanMixin`: DCP's plans and
    metadata, without DCP's per-item costs)."""

    exact_in_columns = True  # it changes no step of the plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO and isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def new_planner() -> _PackedObjectsSavePlanner:
    """The planner of every cloudckpt torch_dist save."""
    return _PackedObjectsSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


_DCP_LOGGERS = "torch.distributed.checkpoint"
_quiet = threading.local()


class _DcpDebugFilter(logging.Filter):
    """Drops DCP's records below INFO made in a thread inside :func:`quiet_dcp_debug`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.INFO or not getattr(_quiet, "depth", 0)


_FILTER = _DcpDebugFilter()


def _dcp_loggers() -> list[logging.Logger]:
    """PyTorch DCP's loggers: its event logger (``c10d-...-dcp_logger``) and every
    ``torch.distributed.checkpoint.*`` logger created so far."""
    from torch.distributed.checkpoint import logger as dcp_logger  # noqa: PLC0415

    found = [dcp_logger._dcp_logger]
    for name, obj in list(logging.Logger.manager.loggerDict.items()):
        if name.startswith(_DCP_LOGGERS) and isinstance(obj, logging.Logger):
            found.append(obj)
    return found


@contextlib.contextmanager
def quiet_dcp_debug() -> Iterator[None]:
    """Keep PyTorch DCP's DEBUG records (an event per DCP call and step) out of the
    caller's handlers while this thread runs cloudckpt's DCP calls. DCP's event logger
    does not propagate, but a logging configuration may make it (``dictConfig``, test
    harnesses); its INFO and WARNING records pass. Other threads are not affected."""
    for dcp_log in _dcp_loggers():
        if _FILTER not in dcp_log.filters:
            dcp_log.addFilter(_FILTER)
    _quiet.depth = getattr(_quiet, "depth", 0) + 1
    try:
        yield
    finally:
        _quiet.depth -= 1


@contextlib.contextmanager
def _dcp_steps(uri: str) -> Iterator[None]:
    """Around DCP's steps: its DEBUG records and its no-process-group warning kept out,
    its ``CheckpointException`` (a BaseException) made a ``CheckpointingException``."""
    with warnings.catch_warnings(), quiet_dcp_debug():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        try:
            yield
        except CheckpointException as exc:
            raise save_failure(exc, uri) from exc


def dcp_save(
    state: dict[str, Any], writer: CloudStorageWriter, plan_cache: SavePlanCache | None = None
) -> None:
    """``torch.distributed.checkpoint.save`` with ``writer`` (collective when distributed);
    with ``plan_cache``, the previous save's plans while no rank's plan changed."""
    with _dcp_steps(writer.storage.uri):
        save_state_dict(state, writer, new_planner(), plan_cache=plan_cache)


@contextlib.contextmanager
def _write_failures(uri: str) -> Iterator[None]:
    """Any error of a torch_dist write as a :class:`CheckpointingException` naming ``uri``."""
    try:
        yield
    except CheckpointingException:
        raise
    except Exception as exc:
        raise CheckpointingException(
            f"saving the torch_dist part of checkpoint {uri!r} failed: {exc}"
        ) from exc


def host_copy(
    sharded_state_dict: ShardedStateDict, lent: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """This rank's main replicas, each ShardedTensor with a host copy of its data (a
    shallow copy of the ShardedTensor): what an async save serializes later, while the
    training loop changes its own tensors. Device tensors are copied into the buffers
    :data:`~cloudckpt.formats.host_copies.HOST_COPIES` keeps (pinned with CUDA,
    reused by the next save once ``lent`` - which gets every copy - is released).
    ShardedObjects are kept as they are (:func:`to_dcp_state_dict` serializes them at
    once)."""
    entries: list[Any] = []
    staged: list[ShardedTensor] = []
    tensors: list[torch.Tensor] = []
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            if value.data is None:
                raise CheckpointingException(f"tensor {value.key!r} has no data to save")
            staged.append(copy.copy(value))
            tensors.append(value.data)
            entries.append(staged[-1])
        elif isinstance(value, ShardedObject) and is_main_replica(value.replica_id):
            entries.append(value)
    copies = HOST_COPIES.copies(tensors)
    for entry, data in zip(staged, copies, strict=True):
        entry.data = data
    if lent is not None:
        lent.extend(copies)
    return {str(i): entry for i, entry in enumerate(entries)}


def tensor_entries(tensors: Iterable[ShardedTensor]) -> list[TensorEntry]:
    """Manifest entries (global shape, dtype; no chunking) of ``tensors``: one per key
    (a rank's shards of one tensor share them), each dtype named once."""
    entries: dict[str, TensorEntry] = {}
    names: dict[torch.dtype, str] = {}
    for sh in tensors:
        if sh.key in entries:
            continue
        name = names.get(sh.dtype)
        if name is None:
            name = names[sh.dtype] = str(sh.dtype).removeprefix("torch.")
        entries[sh.key] = TensorEntry(sh.key, tuple(sh.global_shape), name, None)
    return list(entries.values())


@dataclass(frozen=True)
class DcpFormat:
    """The torch_dist format with one strategy's settings (see the module docstring).

    Attributes:
        object_size: target size in bytes of one ``.distcp`` object (the save's
            config's ``chunk_size`` wins, unless ``config`` is set).
        separation_hint: items whose key starts with it get objects of their own.
        plan_cache: the plans of the previous save, reused while unchanged.
        config: the strategy's own config (wins over the save's).
    """

    object_size: int
    separation_hint: str | None = None
    plan_cache: SavePlanCache | None = None
    config: CheckpointConfig | None = None

    @property
    def traits(self) -> FormatTraits:
        return TRAITS

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        return tensor_entries(tensors)

    def chunk_size(self, config: CheckpointConfig | None) -> int:
        """The strategy's own config's chunk size, else the save's, else ``object_size``."""
        config = self.config or config
        if config is not None and config.chunk_size is not None:
            return config.chunk_size
        return self.object_size

    def batch_bytes(self, config: CheckpointConfig | None) -> int:
        """How many bytes of items the writer batches into one round of uploads."""
        effective = self.config or config or CheckpointConfig()
        return max(self.chunk_size(config), effective.part_size * effective.max_in_flight)

    def writer(
        self, storage: CheckpointStorage, config: CheckpointConfig | None, **kwargs: Any
    ) -> CloudStorageWriter:
        """cloudckpt's DCP storage writer into ``storage`` with these settings."""
        return CloudStorageWriter(
            storage,
            self.chunk_size(config),
            self.batch_bytes(config),
            separation_hint=self.separation_hint,
            **kwargs,
        )

    def plan(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
        *,
        staged: bool = False,
    ) -> DcpPlannedWrite:
        """DCP's planning (collective); staged: on host copies of the tensors."""
        writer = self.writer(storage, config)
        lent: list[torch.Tensor] = []

        def make_state() -> dict[str, Any]:
            source = host_copy(sharded_state_dict, lent) if staged else sharded_state_dict
            state, extra = to_dcp_state_dict(source)
            writer.mcore_data = dict(extra)
            return state

        try:
            with _dcp_steps(storage.uri):
                planned = plan_save(make_state, writer, new_planner(), plan_cache=self.plan_cache)
        except BaseException:
            HOST_COPIES.release(lent)
            raise
        return DcpPlannedWrite(planned, writer, lent)

    def batch_writer(
        self, storage: CheckpointStorage, config: CheckpointConfig | None = None
    ) -> DcpBatchWriter:
        """A writer of one checkpoint in several DCP saves (see :class:`DcpBatchWriter`)."""
        return DcpBatchWriter(self, storage, config)


@dataclass
class DcpPlannedWrite:
    """A torch_dist save planned on this rank (see :meth:`DcpFormat.plan`)."""

    planned: PlannedSave
    writer: CloudStorageWriter
    lent: list[torch.Tensor] = field(default_factory=list)
    """Host copies of a staged save, back to the pool once written."""

    def write(self) -> Written:
        """Serialize and upload this rank's items (no collective); the payload is their
        DCP write results. Host copies are released once written, or once the write
        failed (the save is lost then)."""
        try:
            with _write_failures(self.writer.storage.uri):
                items = self.planned.write()
            # the planner holds the state (the host copies): drop it
            self.planned.planner.set_up_planner(
                {}, is_coordinator=self.planned.wrapper.is_coordinator
            )
        finally:
            HOST_COPIES.release(self.lent)
            self.lent = []
        return Written(list(self.writer.results), items)

    def finish(self, payloads: Sequence[Any]) -> list[WriteResult]:
        """The coordinator's ``.metadata`` from every rank's item results; its result."""
        written = len(self.writer.results)
        with _dcp_steps(self.writer.storage.uri):
            self.planned.write_metadata(list(payloads))  # results in columns where they are
        return list(self.writer.results[written:])


class DcpBatchWriter:
    """Write one torch_dist checkpoint in several DCP saves (single process), for
    :func:`cloudckpt.convert.convert`: each :meth:`add` writes its ``.distcp`` objects,
    :meth:`finish` writes the one ``.metadata`` describing all of them."""

    def __init__(
        self, fmt: DcpFormat, storage: CheckpointStorage, config: CheckpointConfig | None = None
    ) -> None:
        self.format = fmt
        self.storage = storage
        self.config = config
        self.parts: list[Metadata] = []

    def add(self, sharded_state_dict: ShardedStateDict) -> list[WriteResult]:
        """Write one batch's items; returns their write results."""
        state, extra = to_dcp_state_dict(sharded_state_dict)
        writer = self.format.writer(
            self.storage,
            self.config,
            mcore_data=extra,
            part=f"{len(self.parts)}_",
            write_metadata=False,
        )
        dcp_save(state, writer)
        assert writer.metadata is not None  # a single process is the coordinator
        self.parts.append(writer.metadata)
        return writer.results

    def finish(self) -> WriteResult:
        """Write ``.metadata`` for every batch added."""
        if not self.parts:
            raise CheckpointingException(f"no batch was written to {self.storage.uri!r}")
        metadata = merge_metadata(self.parts)
        return self.storage.write(METADATA_FNAME, pickle.dumps(metadata))


__all__ = [
    "BACKEND",
    "DcpBatchWriter",
    "DcpFormat",
    "DcpPlannedWrite",
    "TRAITS",
    "VERSION",
    "dcp_save",
    "host_copy",
    "new_planner",
    "quiet_dcp_debug",
    "tensor_entries",
    "to_dcp_state_dict",
]
