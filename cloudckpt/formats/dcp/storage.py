"""PyTorch DCP ``StorageWriter`` over :class:`CheckpointStorage`, and the reading of
``.metadata`` (the ``StorageReader`` is :mod:`.storage_reader`'s).

The files are those of DCP's ``FileSystemWriter``: ``.metadata`` (the pickled
:class:`~torch.distributed.checkpoint.metadata.Metadata`) and ``__<rank>_<i>.distcp``
data objects, each a concatenation of items - tensors as ``torch.save`` bytes, other
values as the bytes the planner produced - whose offsets and lengths ``.metadata``
records. So DCP's own ``FileSystemReader`` reads what this writer wrote. Where each
tensor item's elements lie within its ``torch.save`` bytes is recorded too, in
``mcore_data`` (:mod:`cloudckpt.formats.dcp.ranges`), so that a resharded load can
read just the part of an item it needs.

On local disks and on S3 the objects are written front to back as they are serialized
(:mod:`cloudckpt.storage.streams`): into their files, or into multipart uploads whose
parts send a synchronous save's CPU tensors from their own memory (no copy of those
bytes in the client: on a machine the store shares, the copy into fresh buffers cost
about 0.5 of the save's 1.4 client CPU-seconds per GB). Elsewhere, and into an async
save's staging, memory stays bounded: ``torch.save`` copies each tensor once into host
memory (into the buffer of the object being assembled), so items are packed into objects of about
``object_size`` bytes (an item larger than that gets an object of its own), and
objects are uploaded in batches of about ``batch_bytes`` through
:meth:`CheckpointStorage.write_many` (concurrent requests, multipart uploads, the
buffers streamed without a further copy); after each batch its buffers are released.
So about one batch plus one object of serialised bytes is in memory at a time, however
large the rank's state is. With ``hashed_key_prefix`` in the config, each data object
goes below a prefix of that many hex digits of a hash of its name
(``<uri>/3f/__0_0.distcp``): ``.metadata`` records each item's relative path, so every
DCP reader finds them.
``.metadata`` is written directly by the coordinator (no temporary file and rename):
the checkpoint becomes visible only with cloudckpt's commit, which follows.

The parts: :mod:`.metadata_build` builds the global ``Metadata`` from the write results,
:mod:`.stored_items` locates and decodes one stored item; this module holds the writer,
Megatron-Core's metadata classes and :func:`read_metadata`.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future as TaskFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, TypeVar

from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult
from torch.futures import Future

from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    MalformedCheckpointError,
    UnsafePickleError,
)
from cloudckpt.formats.dcp.columns import (
    ChunkColumns,
    ItemResultColumns,
    PlanKeys,
    RecordColumns,
    StorageColumns,
    as_write_results,
    join_columns,
)
from cloudckpt.formats.dcp.extra import PickledExtra, merge_extras
from cloudckpt.formats.dcp.item_templates import ItemTemplates
from cloudckpt.formats.dcp.metadata_build import _share_sizes, _storage_data
from cloudckpt.formats.dcp.metadata_pickle import dumps_metadata_columns
from cloudckpt.formats.dcp.metadata_pickle_dict import dumps_metadata
from cloudckpt.formats.dcp.objects import (
    BufferedObject,
    DcpObject,
    StreamedObject,
    estimated_size,
    planned_size,
    without_zip_crc32,
)
from cloudckpt.formats.dcp.ranges import TENSOR_DATA_KEY
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.formats.dcp.unpickler import load_dcp_metadata
from cloudckpt.storage import CheckpointStorage, WriteResult
from cloudckpt.storage.blocks import BLOCK_SIZE
from cloudckpt.storage.buffers import Progress

DATA_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"
DEFAULT_OBJECT_SIZE = 256 * 1024 * 1024
DEFAULT_BATCH_BYTES = 512 * 1024 * 1024
SMALL_ITEM_BYTES = BLOCK_SIZE  # items below one CRC block go first in their object

_Obj = TypeVar("_Obj", bound=DcpObject)


class CloudStorageWriter(StorageWriter):
    """DCP storage writer that uploads through cloudckpt's storage layer.

    After ``dcp.save`` returns, :attr:`results` holds this rank's cloudckpt write
    results (the coordinator's include ``.metadata``), for the manifest.

    Args:
        storage: the checkpoint.
        object_size: target size of one ``.distcp`` object in bytes.
        batch_bytes: upload objects in batches of about this many bytes.
        mcore_data: per-key extra metadata stored on ``Metadata.mcore_data`` (as
            Megatron-Core does), merged over ranks by the coordinator.
        part: a tag in the ``.distcp`` names, so that several DCP saves can share one
            checkpoint; with ``write_metadata=False`` the coordinator keeps the
            ``Metadata`` in :attr:`metadata` instead of writing ``.metadata``
            (:func:`merge_metadata` then combines the parts).
        separation_hint: items whose key starts with it go to objects of their own,
            after the other items, named ``<hint>__<rank>_<i>.distcp`` (Megatron-Core's
            ``separation_hint``: e.g. the optimizer state apart from the model weights).
    """

    keeps_plan_items: ClassVar[bool] = True
    """:meth:`prepare_global_plan` changes only each plan's ``storage_data`` (the
    coordinator may then plan without index hints on the items)."""
    exact_in_columns: ClassVar[bool] = True
    """The write results and ``.metadata`` in columns say exactly what this writer's own
    steps (plan, write, finish) would. Both are declared: a subclass has them only where
    its body says so, so that one that changes a step takes DCP's object path."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("keeps_plan_items", "exact_in_columns"):
            if name not in cls.__dict__:
                setattr(cls, name, False)

    def __init__(
        self,
        storage: CheckpointStorage,
        object_size: int = DEFAULT_OBJECT_SIZE,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        mcore_data: dict[str, dict[str, Any]] | None = None,
        *,
        part: str = "",
        write_metadata: bool = True,
        separation_hint: str | None = None,
    ) -> None:
        super().__init__()
        self.separation_hint = separation_hint
        self.part = part
        self.write_metadata = write_metadata
        self.metadata: Metadata | None = None
        self.storage_columns: StorageColumns | None = None
        self.record_columns: RecordColumns | None = None
        self.storage = storage
        self.object_size = object_size
        self.batch_bytes = batch_bytes
        self.mcore_data = dict(mcore_data or {})
        self.results: list[WriteResult] = []
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.results = []
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # the coordinator merges every rank's extra metadata in prepare_global_plan
        return replace(plan, storage_data=PickledExtra.of(self.mcore_data))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        merge_extras(self.mcore_data, [plan.storage_data for plan in plans])
        return [
            replace(p, storage_data=_StoragePrefix(f"__{i}_{self.part}"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[DcpWriteResult]]:
        """Serialize this rank's items into objects and write them: on local disks
        straight into their files, on S3 into multipart uploads whose parts send the
        tensors from their own memory (:class:`~cloudckpt.storage.streams.UploadStream`),
        elsewhere (and into an async save's staging) assembled in memory and uploaded
        (see :meth:`_write_buffered`)."""
        prefix: _StoragePrefix = plan.storage_data
        if self.storage.writes_in_place or self.storage.streams_uploads:
            out = self._write_streamed(prefix.prefix, plan.items, planner)
        else:
            out = self._write_buffered(prefix.prefix, plan.items, planner)
        future: Future[list[DcpWriteResult]] = Future()
        future.set_result(out)
        return future

    def _write_streamed(
        self, prefix: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[DcpWriteResult]:
        """Serialize every object straight into its file or upload, one after another
        (an unfinished one is removed or aborted on failure)."""
        out: list[DcpWriteResult] = []
        opened: list[StreamedObject] = []
        total = sum(planned_size(item) for item in items)  # about: torch.save adds framing
        progress = Progress("wrote", self.storage.uri, total, len(items))

        def open_object(path: str, capacity: int) -> StreamedObject:
            stream = self.storage.open_stream(path, progress, size_hint=capacity)
            opened.append(StreamedObject(path, stream))
            return opened[-1]

        try:
            for obj, results in self._objects(prefix, items, planner, open_object):
                out += results
                self.results.append(obj.finish())
        finally:
            for obj in opened:
                obj.abort()  # a no-op for those finished
        progress.finish()
        return out

    def _write_buffered(
        self, prefix: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[DcpWriteResult]:
        """Serialize the objects in memory and upload them, a batch uploading in the
        background while the next is serialized (two half batches: at most about
        ``batch_bytes`` held)."""
        out: list[DcpWriteResult] = []
        pending: list[BufferedObject] = []
        with ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-dcp-upload") as uploader:
            uploading: TaskFuture[None] | None = None
            try:
                for obj, results in self._objects(prefix, items, planner, BufferedObject):
                    out += results
                    pending.append(obj)
                    if sum(o.size for o in pending) >= self.batch_bytes // 2:
                        if uploading is not None:
                            uploading.result()  # its error stops the save here
                        uploading = uploader.submit(self._upload, pending)
                        pending = []
                if uploading is not None:
                    uploading.result()
            finally:
                if uploading is not None:  # never left running: it holds the objects
                    wait_all([uploading])
        self._upload(pending)
        return out

    def _objects(
        self,
        prefix: str,
        items: list[WriteItem],
        planner: SavePlanner,
        open_object: Callable[[str, int], _Obj],
    ) -> Iterator[tuple[_Obj, list[DcpWriteResult]]]:
        """Pack the items into objects of about ``object_size`` bytes, in plan order
        (the items of the separation hint after the others, in objects of their own),
        items under one block first: a load that needs many small items of an object
        (layer norms, biases) reads the few blocks they share in one ranged GET instead
        of one block per item. ``open_object(path, capacity)`` starts each
        (``capacity``: its expected size). Tensors are serialized without torch's zip
        CRC-32 (:func:`without_zip_crc32`)."""
        with without_zip_crc32():
            yield from self._packed(prefix, items, planner, open_object)

    def _packed(
        self,
        prefix: str,
        items: list[WriteItem],
        planner: SavePlanner,
        open_object: Callable[[str, int], _Obj],
    ) -> Iterator[tuple[_Obj, list[DcpWriteResult]]]:
        count = 0
        templates = ItemTemplates()
        obj: _Obj | None = None
        results: list[DcpWriteResult] = []
        hint = self.separation_hint

        def order(item: WriteItem) -> tuple[bool, bool]:
            separated = bool(hint) and item.index.fqn.startswith(hint or "")
            return separated, planned_size(item) >= SMALL_ITEM_BYTES

        grouped = sorted(items, key=order)
        group = False
        remaining = sum(planned_size(item) for item in grouped)  # sizes the objects
        for item in grouped:
            data = planner.resolve_data(item)
            estimate = estimated_size(data)
            remaining -= planned_size(item)
            separated = bool(hint) and item.index.fqn.startswith(hint or "")
            full = obj is not None and obj.size and obj.size + estimate > self.object_size
            if obj is not None and (full or separated != group):
                yield obj, results
                obj, results = None, []
            group = separated
            if obj is None:
                capacity = max(estimate, min(self.object_size, estimate + remaining))
                # separated objects' names start with the hint, as Megatron-Core's files
                name = f"{hint if separated else ''}{prefix}{count}{DATA_SUFFIX}"
                obj = open_object(self._object_path(name), capacity)
                count += 1
            info = obj.append(data, templates)
            results.append(DcpWriteResult(item.index, info.length, info))
        if obj is not None:
            yield obj, results

    def _object_path(self, name: str) -> str:
        """``name``, below a hashed prefix when the config asks for one
        (``hashed_key_prefix`` hex digits: ``3f/__0_0.distcp``), so that one
        checkpoint's requests spread over many S3 prefixes (partitions)."""
        digits = self.storage.config.hashed_key_prefix
        if not digits:
            return name
        return f"{hashlib.sha256(name.encode()).hexdigest()[:digits]}/{name}"

    def _upload(self, objects: list[BufferedObject]) -> None:
        if objects:
            payloads = [(o.path, o.payload()) for o in objects]  # serialized here: ours
            self.results += self.storage.write_many(payloads, owned=True)

    def finish(self, metadata: Metadata, results: list[list[DcpWriteResult]]) -> None:
        """Write ``.metadata`` as a plain DCP ``Metadata`` (a planner's subclass, such as
        :class:`MCoreMetadata`, is unwrapped: no cloudckpt class is pickled into a
        checkpoint that other readers must unpickle) with the merged ``mcore_data``,
        which also records where each tensor item's elements lie within the item
        (:data:`~cloudckpt.formats.dcp.ranges.TENSOR_DATA_KEY`, as
        :func:`~cloudckpt.formats.dcp.ranges.with_records` merges them).

        One pass over the item results builds ``storage_data`` and the records; equal
        offsets and sizes are made one object (:func:`_share_sizes`), so that the pickle
        refers to each once: the same ``Metadata`` when unpickled, in fewer bytes and
        less time on both sides."""
        extra = {**(getattr(metadata, "mcore_data", None) or {}), **self.mcore_data}
        if type(metadata) is not Metadata:
            metadata = Metadata(**{f.name: getattr(metadata, f.name) for f in fields(Metadata)})
        metadata.version = DCP_VERSION
        sizes = _share_sizes(metadata)
        keys = {key: key for key in metadata.state_dict_metadata}
        metadata.storage_data, tables = _storage_data(results, sizes, keys)
        for key, table in tables.items():
            extra[key] = {**extra.get(key, {}), TENSOR_DATA_KEY: table}
        metadata.storage_meta = self.storage_meta()
        if extra:
            metadata.mcore_data = extra  # type: ignore[attr-defined]
        self.metadata = metadata
        if self.write_metadata:
            self.results.append(self.storage.write(METADATA_FNAME, dumps_metadata(metadata)))

    def finish_columns(
        self,
        metadata: Metadata,
        keys: Sequence[PlanKeys],
        results: Sequence[ItemResultColumns | list[DcpWriteResult]],
        chunks: ChunkColumns | None = None,
    ) -> None:
        """:meth:`finish` for results sent in columns (:mod:`~cloudckpt.formats.
        dcp.columns`), ``keys`` naming each rank's items: ``.metadata`` is written from
        the columns (:func:`~cloudckpt.formats.dcp.metadata_pickle.
        dumps_metadata_columns`), the same ``Metadata`` when unpickled, without the
        per-item objects; with ``chunks`` (the coordinator's step on columns) the
        metadata's chunk lists too. :attr:`metadata` then holds the global metadata without
        ``storage_data`` (None), :attr:`storage_columns` its columns; its chunk lists stay
        empty where ``chunks`` wrote them (:meth:`~cloudckpt.formats.dcp.columns.
        ChunkColumns.fill` fills them), and so do the record tables of its ``mcore_data``
        (:attr:`record_columns`, whose ``fill`` fills them). Where a rank sent
        objects, or no ``.metadata`` is written (``write_metadata=False``: the
        ``Metadata`` is kept whole), this is :meth:`finish`."""
        columns = [r for r in results if isinstance(r, ItemResultColumns)]
        if not self.write_metadata or len(columns) != len(results):
            if chunks is not None:
                chunks.fill()  # the metadata whole: its chunk lists as objects
            objects = [as_write_results(k, r) for k, r in zip(keys, results, strict=True)]
            self.finish(metadata, objects)
            return
        extra = {**(getattr(metadata, "mcore_data", None) or {}), **self.mcore_data}
        if type(metadata) is not Metadata:
            metadata = Metadata(**{f.name: getattr(metadata, f.name) for f in fields(Metadata)})
        metadata.version = DCP_VERSION
        sizes = {} if chunks is not None else _share_sizes(metadata)  # else: one pool
        shared = {key: key for key in metadata.state_dict_metadata}
        joined = join_columns(keys, columns, shared, sizes)
        if joined is None:
            raise CheckpointingException(
                f"checkpoint {self.storage.uri!r}: the item results do not match the plans"
            )
        storage, records = joined
        for key, table in records.by_name().items():
            extra[key] = {**extra.get(key, {}), TENSOR_DATA_KEY: table}
        metadata.storage_meta = self.storage_meta()
        metadata.storage_data = None
        if extra:
            metadata.mcore_data = extra  # type: ignore[attr-defined]
        self.metadata = metadata
        self.storage_columns = storage
        self.record_columns = records
        raw = dumps_metadata_columns(metadata, storage, chunks, records)
        self.results.append(self.storage.write(METADATA_FNAME, raw))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.uri, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.storage.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


@dataclass
class MCoreMetadata(Metadata):
    """DCP ``Metadata`` with Megatron-Core's per-tensor data (``mcore_data``).

    Megatron-Core 0.15 pickles its ``.metadata`` as this class; cloudckpt reads such
    files with or without Megatron-Core installed (:func:`read_metadata`) and writes
    plain ``Metadata`` with an ``mcore_data`` attribute, which every Megatron-Core
    version reads.
    """

    mcore_data: dict[str, dict[str, Any]] | None = None


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    """A DCP ``SavePlan`` carrying Megatron-Core's per-tensor data (``mcore_data``)."""

    mcore_data: dict[str, dict[str, Any]] | None = None


#: Where Megatron-Core defines the DCP classes it pickles into ``.metadata``.
_MCORE_TORCH_MODULE = "megatron.core.dist_checkpointing.strategies.torch"


#: Megatron-Core's classes, read as cloudckpt's when Megatron-Core is not importable
#: (trusted) and always when restricted (they carry only metadata).
_MCORE_ALIASES: dict[tuple[str, str], Any] = {
    (_MCORE_TORCH_MODULE, "MCoreMetadata"): MCoreMetadata,
    (_MCORE_TORCH_MODULE, "MCoreSavePlan"): MCoreSavePlan,
}


def read_metadata(storage: CheckpointStorage, weights_only: bool | None = None) -> Metadata:
    """The checkpoint's DCP ``.metadata``, unpickled restricted to DCP's metadata types
    unless trusted (:mod:`cloudckpt.formats.dcp.unpickler`).

    Raises:
        CheckpointNotFoundError: there is none.
        UnsafePickleError: it names a global outside DCP's metadata types.
        MalformedCheckpointError: it is not a DCP Metadata (not a pickle, truncated).
    """
    where = storage.child_uri(METADATA_FNAME)
    try:
        raw = storage.read(METADATA_FNAME)
    except CheckpointNotFoundError as exc:
        raise CheckpointNotFoundError(
            f"checkpoint {storage.uri!r} has no {METADATA_FNAME} (PyTorch DCP metadata)"
        ) from exc
    try:
        metadata = load_dcp_metadata(raw, where, weights_only, _MCORE_ALIASES)
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise MalformedCheckpointError(
            f"{where} is not a PyTorch DCP metadata file: {exc}"
        ) from exc
    if not isinstance(metadata, Metadata):
        raise MalformedCheckpointError(f"{where} holds a {type(metadata).__name__}, not Metadata")
    return metadata
