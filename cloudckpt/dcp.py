"""PyTorch DCP's door to cloudckpt: a storage writer and reader for any DCP trainer.

``torch.distributed.checkpoint`` (FSDP2, torchtitan, any loop calling ``dcp.save``)
takes them as its own::

    import torch.distributed.checkpoint as dcp
    from cloudckpt.dcp import CloudStorageReader, CloudStorageWriter

    dcp.save(state_dict, storage_writer=CloudStorageWriter("s3://bucket/run/step-100"))
    dcp.async_save(state_dict, storage_writer=CloudStorageWriter(uri))  # DCP's stagers
    dcp.load(state_dict, storage_reader=CloudStorageReader(uri))

A checkpoint written this way is a cloudckpt checkpoint, in DCP's own layout
(``.metadata`` and ``__{rank}_{n}.distcp``, which stock ``dcp.load`` reads):

- the coordinator claims the URI, create-only, when DCP's global plan is made, before
  any rank writes (a destination that holds anything is refused, on every rank);
- every rank streams its items through cloudckpt's storage layer (multipart uploads,
  CRC-32C of every 1 MiB block, retries with deadlines) and sends the coordinator its
  objects' sizes and CRCs with its DCP write results;
- the coordinator's ``finish`` writes ``.metadata``, then commits: ``manifest.json``
  (every object, its CRCs, the tensors' shapes) and ``metadata.json``, create-only (see
  :mod:`cloudckpt.commit`). A rank's failure reaches every rank through DCP's own
  collectives, and then ``finish`` does not run: nothing is committed, and ``cloudckpt
  gc`` removes what was written.

So ``cloudckpt verify / ls / inspect / gc / latest`` work on it. The reader checks every
range it reads against the manifest's block CRCs; it also reads what stock ``dcp.save``
wrote (no manifest: then the bytes are not checked against any CRC, only their DCP
metadata is used, and it says so once in the log). A load reads of each stored chunk
only the bytes of the region it needs (:mod:`cloudckpt.formats.dcp.ranges`), where
cloudckpt wrote the chunk; a chunk written by another writer is read whole.

Bounds: DCP's collectives are its own, so a rank that dies (rather than raises) leaves
the others waiting for the process group's timeout, as with any DCP writer; cloudckpt's
own ``save`` bounds that (``heartbeat_timeout_s``).
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult
from torch.futures import Future

from cloudckpt.commit import commit_gathered, require_empty, tensor_piece, write_claim
from cloudckpt.commit_state import open_committed
from cloudckpt.config import CheckpointConfig
from cloudckpt.core import CheckpointingConfig
from cloudckpt.errors import CheckpointingException, CheckpointNotFoundError
from cloudckpt.formats.dcp.ranges import Piece, RegionPlan, assemble, plan_reads, records_of
from cloudckpt.formats.dcp.save import DcpFormat
from cloudckpt.formats.dcp.storage import DEFAULT_OBJECT_SIZE, read_metadata
from cloudckpt.formats.dcp.storage import CloudStorageWriter as _ItemWriter
from cloudckpt.formats.dcp.storage_reader import CloudStorageReader as _ItemReader
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME, item_request, load_tensor_item
from cloudckpt.formats.geometry import Box
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.manifest import CommitRecord, TensorEntry
from cloudckpt.redact import redact_uri
from cloudckpt.storage import CheckpointStorage, ReadRequest, WriteResult, open_checkpoint
from cloudckpt.storage.location import checkpoint_uri

logger = logging.getLogger(__name__)

TORCH_DIST = CheckpointingConfig("torch_dist")
"""What ``metadata.json`` records: DCP's layout, cloudckpt's torch_dist format."""

_RECORD_FQN = "__cloudckpt_objects__"
"""The key of the extra write result each rank adds to DCP's: its stored objects (taken
out again by the coordinator before ``.metadata`` is made)."""


@dataclass(frozen=True)
class _RankObjects:
    """What one rank wrote: its rank and the write results of its objects."""

    rank: int
    results: tuple[WriteResult, ...]


class CloudStorageWriter(_ItemWriter):
    """DCP storage writer to a cloudckpt checkpoint at ``uri`` (see the module docstring).

    Args:
        uri: the checkpoint, a new location (``s3://``, ``gs://``, a local path, any
            fsspec URI); ``dcp.save(checkpoint_id=...)`` may name another one.
        storage_options: fsspec options (endpoint, credentials); default: the
            environment's.
        config: cloudckpt's settings (part size, requests in flight, retries,
            ``chunk_size``: the target size of one ``.distcp`` object).
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
    ) -> None:
        self._options = storage_options
        self._config = config
        self._uri = checkpoint_uri(uri)
        storage = open_checkpoint(self._uri, None, storage_options, config=config)
        fmt, settings = DcpFormat(DEFAULT_OBJECT_SIZE), storage.config
        super().__init__(storage, fmt.chunk_size(settings), fmt.batch_bytes(settings))
        self._claimed: WriteResult | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save (DCP calls it first); to ``checkpoint_id`` when it names one."""
        super().reset(checkpoint_id)
        self._claimed = None
        if checkpoint_id is not None and checkpoint_uri(checkpoint_id) != self._uri:
            self._uri = checkpoint_uri(checkpoint_id)
            self.storage = open_checkpoint(self._uri, None, self._options, config=self._config)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator's: claim the URI (create-only), refusing one that holds
        anything, before any rank writes; DCP raises a failure here on every rank."""
        require_empty(self.storage)
        self._claimed = write_claim(self.storage)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[DcpWriteResult]]:
        """Write this rank's items; its objects' sizes and CRCs travel to the coordinator
        with its DCP write results (one extra result, taken out in :meth:`finish`)."""
        results = super().write_data(plan, planner).value()
        objects = _RankObjects(_rank(), tuple(self.results))
        extra = DcpWriteResult(MetadataIndex(_RECORD_FQN), 0, objects)
        future: Future[list[DcpWriteResult]] = Future()
        future.set_result([*results, extra])
        return future

    def finish(self, metadata: Metadata, results: list[list[DcpWriteResult]]) -> None:
        """The coordinator's: write ``.metadata``, then commit (``manifest.json`` and
        ``metadata.json``)."""
        items: list[list[DcpWriteResult]] = []
        sent: list[_RankObjects] = []
        for rank_results in results:
            items.append([r for r in rank_results if r.index.fqn != _RECORD_FQN])
            sent += [r.storage_data for r in rank_results if r.index.fqn == _RECORD_FQN]
        if len(sent) != len(results):
            raise CheckpointingException(
                f"checkpoint {self.storage.uri!r}: {len(results) - len(sent)} rank(s) sent no "
                "record of their objects (a storage writer other than cloudckpt's on them?)"
            )
        super().finish(metadata, items)  # .metadata: this rank's results gain it
        own, me = tuple(self.results), _rank()
        finished = self.metadata if self.metadata is not None else metadata
        tensors, byte_keys = tensor_entries_of(finished)
        records = [
            CommitRecord.of(
                [*([self._claimed] if self._claimed else []), *own] if r.rank == me else r.results,
                tensors if r.rank == me else [],
                byte_keys if r.rank == me else [],
            )
            for r in sent
        ]
        digests = [record.digest for record in records]  # equal entries: a piece each
        records = [record.piece(*tensor_piece(digests, i)) for i, record in enumerate(records)]
        commit_gathered(self.storage, records, TORCH_DIST, self._claimed)

    def __getstate__(self) -> dict[str, Any]:
        """For DCP's process-based async executor: the storage is opened again there."""
        state = dict(self.__dict__)
        state["storage"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.storage = open_checkpoint(self._uri, None, self._options, config=self._config)


class CloudStorageReader(_ItemReader):
    """DCP storage reader of a checkpoint at ``uri``, its reads checked against the
    manifest's CRC-32Cs (see the module docstring).

    Bytes items go to the planner as they are: DCP's ``DefaultLoadPlanner`` unpickles
    them with ``torch.load(weights_only=False)``, so with an untrusted checkpoint, pass
    a planner that does not.

    Args:
        uri: the checkpoint; ``dcp.load(checkpoint_id=...)`` may name another one.
        storage_options: fsspec options (endpoint, credentials).
        config: cloudckpt's settings (requests in flight, retries).
        verify_checksums: also read every object that is read in part whole, to check
            its whole CRC-32C (the block CRCs check every range read anyway).
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        config: CheckpointConfig | None = None,
        verify_checksums: bool = False,
    ) -> None:
        self._options = storage_options
        self._config = config
        self._verify = verify_checksums
        self._uri = checkpoint_uri(uri)
        super().__init__(open_checkpoint(self._uri, None, storage_options, config=config))

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.metadata = None
        if checkpoint_id is not None and checkpoint_uri(checkpoint_id) != self._uri:
            self._uri = checkpoint_uri(checkpoint_id)
            self.storage = open_checkpoint(self._uri, None, self._options, config=self._config)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata`` (restricted unpickling), after the commit objects: a committed
        checkpoint's reads are then checked against its manifest; an uncommitted one is
        refused; one without any (stock DCP's) is read unchecked."""
        self.storage = _checked(self.storage, self._verify)
        metadata = self._metadata_of(self.storage)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def _metadata_of(self, storage: CheckpointStorage) -> Metadata:
        """The checked checkpoint's ``.metadata`` (a subclass may cache it)."""
        return read_metadata(storage)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items in checked ranged reads: a whole recorded chunk's
        elements straight into its target tensor where the target takes them as they
        are (contiguous, same dtype); of any other tensor item, the bytes of the region
        it needs, copied in; of a bytes item, the item."""
        metadata = self.metadata
        if metadata is None:
            raise CheckpointingException("read_data called before set_up_storage_reader")
        regions = [_region(self.storage, metadata, item) for item in plan.items]
        direct: list[tuple[ReadItem, torch.Tensor, ReadRequest]] = []
        rest: list[tuple[ReadItem, _Region, torch.Tensor | None]] = []
        for item, region in zip(plan.items, regions, strict=True):
            target = None
            if item.type == LoadItemType.TENSOR:
                target = planner.resolve_tensor(item).detach()
                if region.elements is not None and _takes_as_is(target, region):
                    direct.append((item, target, region.elements))
                    continue
            rest.append((item, region, target))
        self.storage.read_into_many([(req, tensor_bytes(t)) for _, t, req in direct])
        for item, target, _ in direct:
            planner.commit_tensor(item, target)
        requests = {request for _, region, _ in rest for request in region.requests}
        ordered = sorted(requests, key=lambda r: (r.path, r.start))
        fetched = dict(zip(ordered, self.storage.read_many(ordered), strict=True))
        for item, region, target in rest:
            if target is None:
                planner.load_bytes(item, io.BytesIO(fetched[region.requests[0]]))
                continue
            where = self.storage.child_uri(region.requests[0].path)
            target.copy_(region.tensor(fetched, where))
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def __getstate__(self) -> dict[str, Any]:
        """Picklable as the writer is: the storage is opened again where it lands."""
        return {**self.__dict__, "storage": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.storage = open_checkpoint(self._uri, None, self._options, config=self._config)


@dataclass(frozen=True)
class _Region:
    """What one read item needs: the reads of its region of a stored chunk
    (``plan``: None for a bytes item, read whole by ``requests[0]``)."""

    requests: tuple[ReadRequest, ...]
    plan: RegionPlan | None = None
    dtype: torch.dtype | None = None
    needed: Box | None = None
    elements: ReadRequest | None = None
    """The whole chunk's elements, where the item needs all of them and the chunk has
    a record of where they lie."""

    def tensor(self, fetched: dict[ReadRequest, bytes], where: str) -> torch.Tensor:
        """The item's elements, shaped as the plan's region of the chunk."""
        assert self.plan is not None and self.dtype is not None and self.needed is not None
        region = assemble(
            self.plan, self.dtype, fetched, lambda _, raw: load_tensor_item(raw, where)
        )
        box = self.plan.box
        for dim, (offset, size) in enumerate(zip(*self.needed, strict=True)):
            region = region.narrow(dim, offset - box[0][dim], size)
        return region


def _region(storage: CheckpointStorage, metadata: Metadata, item: ReadItem) -> _Region:
    """The reads of one read item: a bytes item whole; of a tensor item, only the bytes
    of the region of its chunk it needs where the chunk has a record of where its
    elements lie, else the chunk's item whole."""
    index = item.storage_index
    whole = item_request(storage, metadata, index)
    if item.type == LoadItemType.BYTE_IO:
        return _Region((whole,))
    meta = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(meta, TensorStorageMetadata):
        raise CheckpointNotFoundError(
            f"checkpoint {storage.uri!r}: {index.fqn!r} is not a stored tensor"
        )
    chunk_offsets = tuple(index.offset or ())
    shape = next((tuple(c.sizes) for c in meta.chunks if tuple(c.offsets) == chunk_offsets), None)
    if shape is None:
        raise CheckpointNotFoundError(
            f"checkpoint {storage.uri!r}: no chunk of {index.fqn!r} at offset {chunk_offsets}"
        )
    numel = 1
    for size in shape:
        numel *= size
    record = records_of(getattr(metadata, "mcore_data", None), index.fqn).get(chunk_offsets)
    needed = Box(tuple(item.storage_offsets), tuple(item.lengths))
    dtype = meta.properties.dtype
    plan = plan_reads(
        shape,
        needed,
        [Piece(index, 0, numel)],
        dtype.itemsize,
        lambda _: (whole, record),
    )
    elements = None
    length = (whole.end or 0) - whole.start
    if (
        record is not None
        and needed == Box((0,) * len(shape), shape)
        and record[1] == numel * dtype.itemsize
        and record[0] + record[1] <= length
    ):
        start = whole.start + record[0]
        elements = ReadRequest(whole.path, start, start + record[1])
    requests = tuple(read.request for read in plan.reads)
    return _Region(requests, plan, dtype, needed, elements)


def _takes_as_is(target: torch.Tensor, region: _Region) -> bool:
    """Whether the chunk's elements can be read straight into ``target``'s memory."""
    return (
        target.device.type == "cpu"
        and target.is_contiguous()
        and target.dtype == region.dtype
        and region.needed is not None
        and tuple(target.shape) == region.needed[1]
    )


def tensor_entries_of(metadata: Metadata) -> tuple[list[TensorEntry], list[str]]:
    """The manifest's tensor entries (global shape, dtype) of a DCP ``Metadata``, and
    the keys of its bytes items (the manifest's common keys)."""
    tensors: list[TensorEntry] = []
    byte_keys: list[str] = []
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            dtype = str(meta.properties.dtype).removeprefix("torch.")
            tensors.append(TensorEntry(key, tuple(meta.size), dtype, None))
        elif isinstance(meta, BytesStorageMetadata):
            byte_keys.append(key)
    return tensors, byte_keys


def _checked(storage: CheckpointStorage, verify: bool) -> CheckpointStorage:
    """``storage`` with its reads checked against the manifest of a committed
    checkpoint; as it is for one without commit objects (stock DCP's: said once).

    Raises:
        UncommittedCheckpointError: a cloudckpt save that did not commit.
        CheckpointNotFoundError: neither commit objects nor ``.metadata``.
    """
    try:
        committed = open_committed(storage)
    except CheckpointNotFoundError:
        if not storage.exists(METADATA_FNAME):
            raise
        logger.warning(
            "%s has no manifest (not written by cloudckpt): its objects' bytes are not "
            "checked against any CRC-32C, only read as its .metadata describes them",
            redact_uri(storage.uri),
        )
        return storage
    return storage.with_expected(committed.expected_objects(), verify)


def _rank() -> int:
    import torch.distributed as torch_dist  # noqa: PLC0415 - only with a process group

    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


__all__ = ["CloudStorageReader", "CloudStorageWriter"]
