"""PyTorch DCP ``StorageWriter`` / ``StorageReader`` over :class:`CheckpointStorage`.

The files are those of DCP's ``FileSystemWriter``: ``.metadata`` (the pickled
:class:`~torch.distributed.checkpoint.metadata.Metadata`) and ``__<rank>_<i>.distcp``
data objects, each a concatenation of items - tensors as ``torch.save`` bytes, other
values as the bytes the planner produced - whose offsets and lengths ``.metadata``
records. So DCP's own ``FileSystemReader`` reads what this writer wrote. Where each
tensor item's elements lie within its ``torch.save`` bytes is recorded too, in
``mcore_data`` (:mod:`cloudckpt.strategies._dcp_ranges`), so that a resharded load can
read just the part of an item it needs.

Memory stays bounded: ``torch.save`` copies each tensor once into host memory (into
the buffer of the object being assembled), so items are packed into objects of about
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
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import uuid
from collections.abc import Iterator
from concurrent.futures import Future as TaskFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from contextlib import contextmanager
from dataclasses import InitVar, dataclass, field, fields, replace
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult
from torch.futures import Future

from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    MalformedCheckpointError,
    UnsafePickleError,
)
from cloudckpt.safe_pickle import load_torch_pickle
from cloudckpt.storage import CheckpointStorage, ReadRequest, WriteResult
from cloudckpt.storage.blocks import BLOCK_SIZE
from cloudckpt.strategies._append_buffer import AppendBuffer
from cloudckpt.strategies._dcp_ranges import (
    Record,
    RecordedStorageInfo,
    plain_info,
    storage_record,
    with_records,
)
from cloudckpt.strategies._dcp_unpickler import load_dcp_metadata
from cloudckpt.strategies._host_copies import HOST_COPIES
from cloudckpt.strategies._torch_save_template import TEMPLATES

METADATA_FNAME = ".metadata"
DATA_SUFFIX = ".distcp"
DCP_VERSION = "1.0.0"
DEFAULT_OBJECT_SIZE = 256 * 1024 * 1024
DEFAULT_BATCH_BYTES = 512 * 1024 * 1024
ITEM_OVERHEAD = 2048  # torch.save's zip records around a tensor's bytes: 1.55-1.58 KB (torch 2.13)
SMALL_ITEM_BYTES = BLOCK_SIZE  # items below one CRC block go first in their object


def _estimated_size(data: torch.Tensor | io.BytesIO) -> int:
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size() + ITEM_OVERHEAD
    return data.getbuffer().nbytes


@contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the CRC-32 of each zip record (torch >= 2.6).

    Serializing a tensor into memory ran at 0.95 GB/s with it and 3.0 GB/s without it
    (256 MiB float32, this machine): the CRC was two thirds of the work, and of an async
    save's blocking time. PyTorch's reader never checks it (its miniz is built with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS``, since before 1.10), so ``torch.load``,
    PyTorch DCP and Megatron-Core read these items as before; cloudckpt checks every
    byte against its own CRC-32Cs (manifest, blocks). Python's ``zipfile`` would
    refuse to extract such a record (it checks): no reader of DCP items uses it. The
    switch is torch's process-wide setting, restored afterwards; a ``torch.save`` in
    another thread meanwhile also skips its CRCs, and is read by torch just as well.
    """
    set_options = getattr(torch.serialization, "set_crc32_options", None)
    get_options = getattr(torch.serialization, "get_crc32_options", None)
    if set_options is None or get_options is None:
        yield
        return
    before = get_options()
    set_options(False)
    try:
        yield
    finally:
        set_options(before)


def _planned_size(item: WriteItem) -> int:
    """The bytes a tensor item will take in its object, from the plan (a bytes item's
    size is known only once it is serialized: 0)."""
    if item.tensor_data is None:
        return 0
    return (
        math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize
        + ITEM_OVERHEAD
    )


@dataclass
class _Object:
    """One ``.distcp`` object being assembled: items appended to one buffer."""

    path: str
    capacity: InitVar[int] = 0
    buffer: AppendBuffer = field(init=False)

    def __post_init__(self, capacity: int) -> None:
        self.buffer = AppendBuffer(capacity)

    @property
    def size(self) -> int:
        return self.buffer.tell()

    def append(self, data: torch.Tensor | io.BytesIO | Any) -> RecordedStorageInfo:
        """Append one resolved write item; returns where it lies in the object (and,
        for a tensor, where its elements lie within the item: see
        :mod:`cloudckpt.strategies._dcp_ranges`)."""
        offset = self.size
        record = None
        if isinstance(data, torch.Tensor):
            with HOST_COPIES.host(data) as host, _without_zip_crc32():
                record = self._append_tensor(host, offset)
        elif isinstance(data, io.BytesIO):
            self.buffer.write(data.getbuffer())
        else:
            raise CheckpointingException(f"cannot store a {type(data).__name__} as a DCP item")
        return RecordedStorageInfo(self.path, offset, self.size - offset, record=record)

    def _append_tensor(self, tensor: torch.Tensor, offset: int) -> Record | None:
        """Append ``tensor``'s ``torch.save`` bytes (cached records around its elements
        where :mod:`._torch_save_template` can, else ``torch.save`` itself)."""
        saved = TEMPLATES.saved(tensor)
        if saved is not None:
            self.buffer.reserve(saved.nbytes)
            for part in (saved.head, saved.elements, saved.tail):
                self.buffer.write(part)
            return saved.record
        self.buffer.reserve(_estimated_size(tensor))  # torch.save writes in one pass
        torch.save(tensor, cast(IO[bytes], self.buffer))  # it only writes
        with self.buffer.view(offset, self.size) as item:
            return storage_record(item)

    def payload(self) -> memoryview:
        return self.buffer.view()


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
            after the other items (Megatron-Core's ``separation_hint``: e.g. the
            optimizer state apart from the model weights).
    """

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
        return replace(plan, storage_data=self.mcore_data)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        for plan in plans:
            if isinstance(plan.storage_data, dict):
                self.mcore_data.update(plan.storage_data)
        return [
            replace(p, storage_data=_StoragePrefix(f"__{i}_{self.part}"))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[DcpWriteResult]]:
        """Serialize this rank's items into objects and upload them, a batch uploading
        in the background while the next is serialized (two half batches: at most
        about ``batch_bytes`` held)."""
        prefix: _StoragePrefix = plan.storage_data
        out: list[DcpWriteResult] = []
        pending: list[_Object] = []
        with ThreadPoolExecutor(1, thread_name_prefix="cloudckpt-dcp-upload") as uploader:
            uploading: TaskFuture[None] | None = None
            try:
                for obj, items in self._objects(prefix.prefix, plan.items, planner):
                    out += items
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
        future: Future[list[DcpWriteResult]] = Future()
        future.set_result(out)
        return future

    def _objects(
        self, prefix: str, items: list[WriteItem], planner: SavePlanner
    ) -> Iterator[tuple[_Object, list[DcpWriteResult]]]:
        """Pack the items into objects of about ``object_size`` bytes, in plan order
        (the items of the separation hint after the others, in objects of their own),
        items under one block first: a load that needs many small items of an object
        (layer norms, biases) reads the few blocks they share in one ranged GET instead
        of one block per item."""
        count = 0
        obj: _Object | None = None
        results: list[DcpWriteResult] = []
        hint = self.separation_hint

        def order(item: WriteItem) -> tuple[bool, bool]:
            separated = bool(hint) and item.index.fqn.startswith(hint or "")
            return separated, _planned_size(item) >= SMALL_ITEM_BYTES

        grouped = sorted(items, key=order)
        group = False
        remaining = sum(_planned_size(item) for item in grouped)  # sizes the objects
        for item in grouped:
            data = planner.resolve_data(item)
            estimate = _estimated_size(data)
            remaining -= _planned_size(item)
            separated = bool(hint) and item.index.fqn.startswith(hint or "")
            full = obj is not None and obj.size and obj.size + estimate > self.object_size
            if obj is not None and (full or separated != group):
                yield obj, results
                obj, results = None, []
            group = separated
            if obj is None:
                capacity = max(estimate, min(self.object_size, estimate + remaining))
                obj = _Object(self._object_path(f"{prefix}{count}{DATA_SUFFIX}"), capacity)
                count += 1
            info = obj.append(data)
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

    def _upload(self, objects: list[_Object]) -> None:
        if objects:
            payloads = [(o.path, o.payload()) for o in objects]  # serialized here: ours
            self.results += self.storage.write_many(payloads, owned=True)

    def finish(self, metadata: Metadata, results: list[list[DcpWriteResult]]) -> None:
        """Write ``.metadata`` as a plain DCP ``Metadata`` (a planner's subclass, such as
        :class:`MCoreMetadata`, is unwrapped: no cloudckpt class is pickled into a
        checkpoint that other readers must unpickle) with the merged ``mcore_data``,
        which also records where each tensor item's elements lie within the item
        (:func:`~cloudckpt.strategies._dcp_ranges.with_records`)."""
        extra = {**(getattr(metadata, "mcore_data", None) or {}), **self.mcore_data}
        if type(metadata) is not Metadata:
            metadata = Metadata(**{f.name: getattr(metadata, f.name) for f in fields(Metadata)})
        metadata.version = DCP_VERSION
        metadata.storage_data = {
            wr.index: plain_info(wr.storage_data) for rank in results for wr in rank
        }
        extra = with_records(extra, results)
        metadata.storage_meta = self.storage_meta()
        if extra:
            metadata.mcore_data = extra  # type: ignore[attr-defined]
        self.metadata = metadata
        if self.write_metadata:
            self.results.append(self.storage.write(METADATA_FNAME, pickle.dumps(metadata)))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.storage.uri, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.storage.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False


def merge_metadata(parts: list[Metadata]) -> Metadata:
    """One ``Metadata`` describing the items of several DCP saves into one checkpoint
    (their keys must be distinct)."""
    merged = parts[0]
    for part in parts[1:]:
        clash = set(merged.state_dict_metadata) & set(part.state_dict_metadata)
        if clash:
            raise CheckpointingException(f"keys saved twice: {sorted(clash)[:10]}")
        merged.state_dict_metadata.update(part.state_dict_metadata)
        merged.storage_data = {**(merged.storage_data or {}), **(part.storage_data or {})}
        extra = getattr(part, "mcore_data", None)
        if extra:
            merged.mcore_data = {**getattr(merged, "mcore_data", {}), **extra}  # type: ignore[attr-defined]
    return merged


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
    unless trusted (:mod:`cloudckpt.strategies._dcp_unpickler`).

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


def item_request(
    storage: CheckpointStorage, metadata: Metadata, index: MetadataIndex
) -> ReadRequest:
    """The ranged read of one stored item."""
    info = (metadata.storage_data or {}).get(index)
    if not isinstance(info, _StorageInfo):
        raise CheckpointNotFoundError(
            f"checkpoint {storage.uri!r}: no stored item for {index.fqn!r} at offset "
            f"{tuple(index.offset) if index.offset is not None else None}"
        )
    if info.transform_descriptors:
        raise CheckpointingException(
            f"checkpoint {storage.uri!r}: item {index.fqn!r} uses DCP stream transforms "
            f"{list(info.transform_descriptors)}, which cloudckpt does not read"
        )
    return ReadRequest(info.relative_path, info.offset, info.offset + info.length)


def load_tensor_item(raw: bytes, where: str) -> torch.Tensor:
    """Decode a tensor item (``torch.save`` bytes, tensors only)."""
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointingException(f"{where}: cannot decode the tensor item: {exc}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointingException(f"{where}: item holds a {type(tensor).__name__}")
    return tensor


def load_object_item(
    raw: bytes, where: str, weights_only: bool | None = None, what: str = "sharded object"
) -> Any:
    """Decode a bytes item as Megatron-Core writes it, ``torch.save([data])``: the
    one-element list is unwrapped (a ``BytesIO`` inside is decoded too). Restricted
    unless trusted (:func:`cloudckpt.safe_pickle.load_torch_pickle`); ``where`` and
    ``what`` name the item in an error."""
    value = load_torch_pickle(raw, where, what, weights_only)
    if isinstance(value, io.BytesIO):
        value = load_torch_pickle(value.getvalue(), where, what, weights_only)
    if isinstance(value, list) and value:
        value = value[0]
    return value


class CloudStorageReader(StorageReader):
    """DCP storage reader over cloudckpt's storage layer (any fsspec URI).

    For ``torch.distributed.checkpoint.load(state_dict, storage_reader=...)``: reads
    the items of the plan with concurrent ranged reads. ``.metadata`` is unpickled
    restricted (:func:`read_metadata`); bytes items go to the planner as they are, and
    DCP's ``DefaultLoadPlanner`` unpickles them with ``torch.load(weights_only=False)``:
    with an untrusted checkpoint, pass a planner that does not (cloudckpt's own loads
    do not use this reader for objects).
    """

    def __init__(self, storage: CheckpointStorage) -> None:
        super().__init__()
        self.storage = storage
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.storage)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = uuid.uuid4().hex
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self.metadata is None:
            raise CheckpointingException("read_data called before set_up_storage_reader")
        requests = [item_request(self.storage, self.metadata, r.storage_index) for r in plan.items]
        unique = sorted(set(requests), key=lambda r: (r.path, r.start))
        fetched = dict(zip(unique, self.storage.read_many(unique), strict=True))
        for item, request in zip(plan.items, requests, strict=True):
            raw = fetched[request]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(raw))
                continue
            tensor = load_tensor_item(raw, self.storage.child_uri(request.path))
            spans = zip(item.storage_offsets, item.lengths, strict=True)
            for dim, (start, length) in enumerate(spans):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.storage.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
