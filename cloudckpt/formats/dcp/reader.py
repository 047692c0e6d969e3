"""Loading ShardedTensors and ShardedObjects out of a DCP checkpoint, with resharding.

A requested shard is a box of the global tensor. The reader picks the stored DCP
chunks overlapping it and reads, of each, the region the batch's shards overlap:
where cloudckpt recorded where an item's elements lie, only the byte ranges of that
region (:mod:`cloudckpt.formats.dcp.ranges`), else the whole item (one ranged
read of the ``.distcp`` object, decoded); all concurrently, through
:mod:`cloudckpt.storage`. It then copies the overlaps (boxes and overlaps:
:mod:`cloudckpt.formats.geometry`). Tensors stored in the N-D flattened layout (see
:mod:`cloudckpt.formats.dcp.checkpointable`) are reassembled into the grid chunks
they were cut from (of a chunk, only the pieces the region needs are read). Requests
are handled in batches of bounded size, so peak memory stays near one batch.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from cloudckpt import dist
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    MalformedCheckpointError,
    TensorMismatchError,
)
from cloudckpt.formats.dcp.metadata_check import check_orig_shape, check_tensor, check_top
from cloudckpt.formats.dcp.ranges import (
    Piece,
    PieceRead,
    Record,
    RegionPlan,
    assemble,
    needed_box,
    plan_reads,
    records_of,
)
from cloudckpt.formats.dcp.storage import read_metadata
from cloudckpt.formats.dcp.stored_items import (
    METADATA_FNAME,
    item_request,
    load_object_item,
    load_tensor_item,
)
from cloudckpt.formats.geometry import (
    Box,
    absolute,
    bounding,
    copy_overlap,
    grid_box,
    intersection,
    relative,
    shard_box,
)
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.mapping import ShardedObject, ShardedTensor
from cloudckpt.storage import CheckpointStorage, ReadRequest
from cloudckpt.validation import chunk_shape

logger = logging.getLogger(__name__)

DEFAULT_BATCH_BYTES = 512 * 1024 * 1024
ORIG_SHAPE_KEY = "nd_reformulated_orig_global_shape"
COMMON_STATE_ITEM = "common_state"


def is_common_state_item(key: str) -> bool:
    """Megatron-Core 0.19 keeps the common state as the object ``common_state``
    (item ``common_state/shard_0_1``); older drafts used a bare ``common_state``."""
    return key == COMMON_STATE_ITEM or key.startswith(COMMON_STATE_ITEM + "/")


class TorchDistKeyNotFoundError(CheckpointKeyNotFoundError, CheckpointException):
    """A requested key is not stored in a torch_dist checkpoint.

    Both cloudckpt's :class:`CheckpointKeyNotFoundError` (a ``KeyError``) and PyTorch's
    ``torch.distributed.checkpoint.CheckpointException``, which Megatron-Core's torch_dist
    load raises for such keys: code written for either catches it. ``failures`` maps the
    rank to ``(KeyError, stack)`` as PyTorch's does; ``str()`` is cloudckpt's message.
    Raised on every rank of a collective load (the
    :func:`~cloudckpt.errors.distributed_variant`), ``failures`` follows
    :class:`~cloudckpt.errors.DistributedCheckpointError` instead (rank -> summary).
    """

    @property
    def failures(self) -> dict[int, Any]:
        """Rank -> what failed there (see the class docstring)."""
        return self._failures

    @failures.setter
    def failures(self, value: dict[int, Any]) -> None:
        self._failures = value

    def __init__(self, message: str, keys: tuple[str, ...] = (), rank: int = 0) -> None:
        super().__init__(message, keys)
        self.rank = rank
        self._failures = {rank: (KeyError(message), traceback.StackSummary())}

    @classmethod
    def of(
        cls, what: str, keys: Iterable[str], uri: str, rank: int, detail: str = ""
    ) -> TorchDistKeyNotFoundError:
        """As :meth:`CheckpointKeyNotFoundError.of`, remembering ``rank``."""
        error = super().of(what, keys, uri, rank, detail)
        return cls(str(error), error.keys, rank)

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.keys, self.rank))


@dataclass(frozen=True)
class _Source:
    """A box of the global tensor made of stored items (one, or a flattened chunk's
    pieces: flat ranges of the box's C-order elements)."""

    key: str
    box: Box
    items: tuple[Piece, ...]


class DcpCheckpoint:
    """The DCP part of one checkpoint: its metadata and item reads.

    Args:
        storage: the checkpoint.
        batch_bytes: upper bound on the item bytes fetched per batch of requests.
        weights_only: unpickle ``.metadata`` and objects restricted (True), without
            restriction (False) or as the scope / environment says (None; see
            :mod:`cloudckpt.safe_pickle`).
        metadata: the checkpoint's ``.metadata`` when already read (else it is read).
    """

    def __init__(
        self,
        storage: CheckpointStorage,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        weights_only: bool | None = None,
        metadata: Metadata | None = None,
    ) -> None:
        self.storage = storage
        self.batch_bytes = batch_bytes
        self.weights_only = weights_only
        self.metadata: Metadata = (
            metadata if metadata is not None else read_metadata(storage, weights_only)
        )
        self._metadata_uri = storage.child_uri(METADATA_FNAME)
        check_top(self.metadata, self._metadata_uri)  # field types: _dcp_metadata_check
        self._checked: set[str] = set()  # tensor keys whose entries were checked
        self._record_cache: dict[str, dict[tuple[int, ...], Record]] = {}
        self._chunk_cache: dict[str, dict[tuple[int, ...], tuple[int, ...]]] = {}
        self._request_cache: dict[MetadataIndex, ReadRequest] = {}

    # -- metadata ---------------------------------------------------------------------

    def _where(self, key: str) -> str:
        return f"tensor {key!r} in checkpoint {self.storage.uri!r}"

    def _missing(self, what: str, keys: Sequence[str], detail: str = "") -> Exception:
        return TorchDistKeyNotFoundError.of(what, keys, self.storage.uri, dist.get_rank(), detail)

    def tensor_metadata(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if md is None:
            raise self._missing("tensor(s)", [key])
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointingException(f"{self._where(key)}: stored as bytes, not a tensor")
        if key not in self._checked:
            check_tensor(key, md, self._metadata_uri)
            self._checked.add(key)
        return md

    def global_shape(self, key: str) -> tuple[int, ...]:
        """The tensor's global shape (undoing an N-D flattened reformulation)."""
        shape = self.orig_shape(key)
        return shape if shape is not None else tuple(self.tensor_metadata(key).size)

    def orig_shape(self, key: str) -> tuple[int, ...] | None:
        extra = getattr(self.metadata, "mcore_data", None) or {}
        shape = extra.get(key, {}).get(ORIG_SHAPE_KEY)
        return check_orig_shape(key, shape, self._metadata_uri) if shape is not None else None

    def tensor_keys(self) -> list[str]:
        items = self.metadata.state_dict_metadata.items()
        return [k for k, md in items if isinstance(md, TensorStorageMetadata)]

    def object_keys(self) -> list[str]:
        items = self.metadata.state_dict_metadata.items()
        return [k for k, md in items if isinstance(md, BytesStorageMetadata)]

    # -- tensors ----------------------------------------------------------------------

    def _check(self, sh: ShardedTensor) -> None:
        md, where = self.tensor_metadata(sh.key), self._where(sh.key)
        if md.properties.dtype != sh.dtype:  # cast on copy, as DCP's load into sh.dtype does
            logger.debug("%s: stored as %s, loaded as %s", where, md.properties.dtype, sh.dtype)
        stored = self.global_shape(sh.key)
        if stored != tuple(sh.global_shape) and not sh.allow_shape_mismatch:
            raise TensorMismatchError(
                f"Global shape mismatch for loaded ({stored}) and expected "
                f"({tuple(sh.global_shape)}) tensor for key {sh.key} ({where}: stored global "
                f"shape {stored}, requested {tuple(sh.global_shape)}; set "
                "allow_shape_mismatch=True to cut or pad)"
            )

    def _sources(self, key: str) -> list[_Source]:
        md = self.tensor_metadata(key)
        orig = self.orig_shape(key)
        if orig is None:
            return [
                _Source(
                    key,
                    Box(tuple(c.offsets), tuple(c.sizes)),
                    (Piece(MetadataIndex(key, c.offsets), 0, math.prod(c.sizes)),),
                )
                for c in md.chunks
            ]
        return self._flat_sources(key, md, orig)

    def _flat_sources(
        self, key: str, md: TensorStorageMetadata, orig: tuple[int, ...]
    ) -> list[_Source]:
        """Grid chunks of an N-D flattened tensor, each with its stored flat pieces."""
        grid, numel = tuple(md.size[:-1]), md.size[-1]
        if len(grid) != len(orig) or any(g < 1 or n % g for n, g in zip(orig, grid, strict=True)):
            raise CheckpointingException(
                f"{self._where(key)}: stored flattened layout {tuple(md.size)} does not fit "
                f"global shape {orig}"
            )
        local = tuple(n // g for n, g in zip(orig, grid, strict=True))
        if math.prod(local) != numel:
            raise CheckpointingException(
                f"{self._where(key)}: chunks of {numel} elements cannot have shape {local}"
            )
        pieces: dict[tuple[int, ...], list[Piece]] = {}
        for c in md.chunks:
            piece = Piece(MetadataIndex(key, c.offsets), c.offsets[-1], c.sizes[-1])
            pieces.setdefault(tuple(c.offsets[:-1]), []).append(piece)
        return [_Source(key, grid_box(i, local), tuple(p)) for i, p in pieces.items()]

    def load_tensors(self, tensors: Sequence[ShardedTensor]) -> dict[int, torch.Tensor]:
        """Load every requested tensor; returns ``{id(sharded_tensor): tensor}``."""
        missing = {sh.key for sh in tensors} - set(self.metadata.state_dict_metadata)
        if missing:
            raise self._missing("tensor(s)", sorted(missing))
        for sh in tensors:
            self._check(sh)
        sources: dict[str, list[_Source]] = {}
        plans: list[tuple[ShardedTensor, list[_Source]]] = []
        for sh in tensors:
            exact = self._exact_source(sh)
            if exact is not None:
                plans.append((sh, [exact]))
                continue
            if sh.key not in sources:
                sources[sh.key] = self._sources(sh.key)
            plans.append((sh, self._plan(sh, sources[sh.key])))
        out: dict[int, torch.Tensor] = {}
        for batch in self._batches(plans):
            out.update(self._load_batch(batch))
        return out

    def _exact_source(self, sh: ShardedTensor) -> _Source | None:
        """The one stored chunk that is exactly the chunk ``sh`` needs (the common,
        unresharded case: found by its offsets, without planning the key's other
        chunks); None when there is none or the tensor is stored flattened."""
        if sh.flattened_range is not None or self.orig_shape(sh.key) is not None:
            return None
        box = shard_box(sh)
        if self._chunk_sizes(sh.key).get(box.offsets) != box.sizes:
            return None
        piece = Piece(MetadataIndex(sh.key, box.offsets), 0, math.prod(box.sizes))
        return _Source(sh.key, box, (piece,))

    def _chunk_sizes(self, key: str) -> dict[tuple[int, ...], tuple[int, ...]]:
        """``{offsets: sizes}`` of ``key``'s stored chunks."""
        table = self._chunk_cache.get(key)
        if table is None:
            chunks = self.tensor_metadata(key).chunks
            table = {tuple(c.offsets): tuple(c.sizes) for c in chunks}
            self._chunk_cache[key] = table
        return table

    def _request(self, index: MetadataIndex) -> ReadRequest:
        """The ranged read of one stored item (looked up once per item)."""
        request = self._request_cache.get(index)
        if request is None:
            request = item_request(self.storage, self.metadata, index)
            self._request_cache[index] = request
        return request

    def _plan(self, sh: ShardedTensor, sources: list[_Source]) -> list[_Source]:
        box = needed_box(sh)
        chosen = [s for s in sources if intersection(s.box, box) is not None]
        self._require_covered(sh.key, box, chosen)
        return chosen

    def _require_covered(self, key: str, box: Box, sources: list[_Source]) -> None:
        """The stored chunks must hold every element of ``box`` that the stored tensor
        has: a ``.metadata`` whose chunks leave a gap would load zeros there."""
        extent = Box((0,) * len(box.offsets), self.global_shape(key))
        wanted = intersection(box, extent) if len(extent.sizes) == len(box.offsets) else None
        need = math.prod(wanted.sizes) if wanted is not None else 0
        found = (intersection(s.box, box) for s in sources)
        held = sum(math.prod(f.sizes) for f in found if f is not None)
        if held < need:
            raise MalformedCheckpointError(
                f"{self._metadata_uri}: the stored chunks of tensor {key!r} hold {held} of "
                f"the {need} elements at offsets {box.offsets}, sizes {box.sizes}"
            )

    def _item_size(self, index: MetadataIndex) -> int:
        request = self._request(index)
        return (request.end or 0) - request.start

    def _batches(
        self, plans: list[tuple[ShardedTensor, list[_Source]]]
    ) -> Iterator[list[tuple[ShardedTensor, list[_Source]]]]:
        batch: list[tuple[ShardedTensor, list[_Source]]] = []
        size = 0
        for sh, sources in plans:
            nbytes = sum(self._item_size(p.index) for s in sources for p in s.items)
            if batch and size + nbytes > self.batch_bytes:
                yield batch
                batch, size = [], 0
            batch.append((sh, sources))
            size += nbytes
        if batch:
            yield batch

    def _load_batch(
        self, batch: list[tuple[ShardedTensor, list[_Source]]]
    ) -> dict[int, torch.Tensor]:
        direct = {id(sh): self._direct_read(sh, sources) for sh, sources in batch}
        out = self._read_direct([(sh, read) for sh, _ in batch if (read := direct[id(sh)])])
        rest = [(sh, sources) for sh, sources in batch if direct[id(sh)] is None]
        return out | self._read_regions(rest) if rest else out

    def _direct_read(self, sh: ShardedTensor, sources: list[_Source]) -> ReadRequest | None:
        """The byte range of the elements of the one stored item that is exactly the
        chunk ``sh`` needs (the common, unresharded case), when the writer recorded
        where they lie in the item; None when the chunk must be assembled."""
        if len(sources) != 1 or len(sources[0].items) != 1 or sh.flattened_range is not None:
            return None
        (source,), (piece,) = sources, sources[0].items
        if source.box != shard_box(sh):
            return None
        if self.tensor_metadata(sh.key).properties.dtype != sh.dtype:
            return None
        record = self._records(sh.key).get(tuple(piece.index.offset or ()))
        whole = self._request(piece.index)
        nbytes = piece.numel * sh.dtype.itemsize
        if (
            record is None
            or record[1] != nbytes
            or record[0] + nbytes > (whole.end or 0) - whole.start
        ):
            return None
        start = whole.start + record[0]
        return ReadRequest(whole.path, start, start + nbytes)

    def _read_direct(
        self, reads: list[tuple[ShardedTensor, ReadRequest]]
    ) -> dict[int, torch.Tensor]:
        """Read each chunk's elements straight into its tensor: one copy, checked
        against the block CRC-32Cs; no ``torch.load``, no intermediate bytes. The
        tensor is the request's own ``data`` where that can hold the chunk as it is
        (loaded in place, as Megatron-Core's torch_dist load and the fully parallel
        exchange do: no second allocation, and memory the caller already touched
        takes no page faults), else a new one (see :func:`_in_place_targets`)."""
        targets = _in_place_targets([sh for sh, _ in reads])
        tensors = {id(sh): _target_or_new(sh, targets) for sh, _ in reads}
        if reads:
            self.storage.read_into_many(
                [(request, tensor_bytes(tensors[id(sh)])) for sh, request in reads]
            )
        return {
            id(sh): tensors[id(sh)] if id(sh) in targets else _placed(sh, tensors[id(sh)])
            for sh, _ in reads
        }

    def _read_regions(
        self, batch: list[tuple[ShardedTensor, list[_Source]]]
    ) -> dict[int, torch.Tensor]:
        plans = {source: self._region_plan(source, box) for source, box in _regions(batch)}
        requests = {r.request for plan in plans.values() for r in plan.reads}
        unique = sorted(requests, key=lambda r: (r.path, r.start))
        fetched = dict(zip(unique, self.storage.read_many(unique), strict=True))
        regions: dict[_Source, tuple[Box, torch.Tensor]] = {}
        out = {}
        for sh, sources in batch:
            box = shard_box(sh)
            chunk = torch.zeros(box.sizes, dtype=sh.dtype)  # zeros pad a shape mismatch
            for source in sources:
                if source not in regions:
                    regions[source] = self._region(source, plans[source], fetched)
                region_box, region = regions[source]
                copy_overlap(chunk, box, region, region_box)
            out[id(sh)] = _placed(sh, chunk)
        return out

    def _region_plan(self, source: _Source, needed: Box) -> RegionPlan:
        """The reads of the part of ``source`` covering ``needed`` (global coordinates)."""
        dtype = self.tensor_metadata(source.key).properties.dtype
        records = self._records(source.key)

        def locate(piece: Piece) -> tuple[ReadRequest, Record | None]:
            request = self._request(piece.index)
            return request, records.get(tuple(piece.index.offset or ()))

        rel = relative(needed, source.box.offsets)
        return plan_reads(source.box.sizes, rel, source.items, dtype.itemsize, locate)

    def _records(self, key: str) -> dict[tuple[int, ...], Record]:
        """Where the elements of ``key``'s items lie within them, by chunk offsets;
        none when objects are read whole anyway (``verify_checksums``)."""
        if self.storage.verify_checksums:
            return {}
        if key not in self._record_cache:
            extra = getattr(self.metadata, "mcore_data", None)
            self._record_cache[key] = records_of(extra, key)
        return self._record_cache[key]

    def _region(
        self, source: _Source, plan: RegionPlan, fetched: dict[ReadRequest, bytes]
    ) -> tuple[Box, torch.Tensor]:
        """The planned region of ``source``: its global box and its tensor."""
        dtype = self.tensor_metadata(source.key).properties.dtype

        def decode(read: PieceRead, raw: bytes) -> torch.Tensor:
            where = f"{self.storage.child_uri(read.request.path)} (item {read.piece.index.fqn!r})"
            tensor = load_tensor_item(raw, where)
            if tensor.numel() != read.piece.numel:
                raise CheckpointingException(
                    f"{where}: the item holds {tensor.numel()} elements, the metadata says "
                    f"{read.piece.numel}"
                )
            return tensor

        return absolute(plan.box, source.box.offsets), assemble(plan, dtype, fetched, decode)

    # -- objects ----------------------------------------------------------------------

    def load_objects(self, objects: Sequence[ShardedObject]) -> dict[int, Any]:
        """Load every requested ShardedObject; returns ``{id(sharded_object): value}``."""
        keys = [o.unique_key for o in objects]
        missing = [k for k in keys if k not in self.metadata.state_dict_metadata]
        if missing:
            stored = sorted({k for k in self.object_keys() for o in objects if k.startswith(o.key)})
            raise self._missing(
                "sharded object(s)", missing, f"; stored shards of these keys: {stored or 'none'}"
            )
        values = self.read_objects(keys)
        return {id(o): values[o.unique_key] for o in objects}

    def read_objects(self, keys: Sequence[str]) -> dict[str, Any]:
        """``{key: value}`` of stored bytes items (``torch.save``'d objects)."""
        requests = [item_request(self.storage, self.metadata, MetadataIndex(k)) for k in keys]
        raws = self.storage.read_many(requests)
        return {
            key: load_object_item(
                raw,
                f"{self.storage.child_uri(request.path)} (item {key!r})",
                self.weights_only,
                "common state" if is_common_state_item(key) else "sharded object",
            )
            for key, request, raw in zip(keys, requests, raws, strict=True)
        }


def _regions(batch: list[tuple[ShardedTensor, list[_Source]]]) -> list[tuple[_Source, Box]]:
    """Each source of the batch with the box (global coordinates) covering what the
    batch's shards need of it."""
    regions: dict[_Source, Box] = {}
    for sh, sources in batch:
        box = needed_box(sh)
        for source in sources:
            needed = intersection(source.box, box)
            if needed is not None:
                known = regions.get(source)
                regions[source] = needed if known is None else bounding(known, needed)
    return list(regions.items())


def _in_place_target(sh: ShardedTensor) -> torch.Tensor | None:
    """``sh``'s own ``data`` when a chunk can be read straight into it: a plain CPU
    tensor of the shard's dtype and local shape, contiguous, of a whole chunk (no
    flattened range); None otherwise (a new tensor is allocated)."""
    data = sh.data
    if (
        data is None
        or type(data) not in (torch.Tensor, torch.nn.Parameter)
        or data.device.type != "cpu"
        or data.layout != torch.strided
        or data.dtype != sh.dtype
        or sh.flattened_range is not None
        or tuple(data.shape) != tuple(sh.local_shape)
        or not data.is_contiguous()
        or data.numel() == 0
    ):
        return None
    return data.detach()


def _in_place_targets(shards: Sequence[ShardedTensor]) -> dict[int, torch.Tensor]:
    """``{id(sh): tensor}`` of the shards read in place (:func:`_in_place_target`),
    keeping only tensors whose memory no other target's overlaps (two requests that
    share memory each get a new tensor, so neither overwrites the other)."""
    found = {id(sh): t for sh in shards if (t := _in_place_target(sh)) is not None}
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), key) for key, t in found.items()
    )
    shared: set[int] = set()
    end, last = -1, None
    for start, stop, key in spans:
        if start < end and last is not None:
            shared.update((key, last))
        if stop > end:
            end, last = stop, key
    return {key: t for key, t in found.items() if key not in shared}


def _target_or_new(sh: ShardedTensor, targets: dict[int, torch.Tensor]) -> torch.Tensor:
    target = targets.get(id(sh))
    return target if target is not None else torch.empty(chunk_shape(sh), dtype=sh.dtype)


def _placed(sh: ShardedTensor, chunk: torch.Tensor) -> torch.Tensor:
    """The loaded ``chunk`` (of ``chunk_shape(sh)``) as ``sh``'s value: its local
    shape, its flattened range, on its device."""
    result = chunk.reshape(tuple(sh.local_shape))
    if sh.flattened_range is not None:
        result = result.reshape(-1)[sh.flattened_range].clone()
    if sh.data is not None and sh.data.device.type not in ("cpu", "meta"):
        result = result.to(sh.data.device)
    return result
