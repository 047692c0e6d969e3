"""The format protocol: what a save or load session drives, one implementation per engine.

A save of one checkpoint runs, on every rank, in this order:

1. :meth:`SaveFormat.plan` (collective: the format's own collectives, every rank enters
   each): decide what this rank writes. With ``staged=True`` (an async save) a format
   whose traits say :attr:`FormatTraits.stages_itself` copies the tensors to host memory
   here, so that the training loop may change its own once ``plan`` returned; a format
   that does not stage itself writes into the storage it is given, which the session
   makes a host-memory staging view for an async save. Returns a :class:`PlannedWrite`.
2. :meth:`PlannedWrite.write` (no collective): serialize and upload this rank's objects;
   inline for a sync save, in a background thread for an async one. Returns a
   :class:`Written`: the write results and a payload for the coordinator.
3. :meth:`PlannedWrite.finish` (the coordinator only, once every rank's write
   succeeded, before the commit): write the format's last objects from every rank's
   payload (torch_dist: ``.metadata``) and return their results. The payloads travel
   with the commit records (:mod:`cloudckpt.session`), so the finish costs no
   collective of its own.

The session then commits (:mod:`cloudckpt.commit`). A sync save is this sequence run
inline; an async save returns step 2 as its request's function and steps 3 and the
commit as its finalization. A load reads with :meth:`ShardedLoader.load_from`, which
reshards to the requested layout.

What the core needs to know of a format is declared, never inferred from its name: its
:class:`FormatTraits`. The common state (``common.pt``) and, for formats that do not
write them, the ShardedObjects are a :class:`CommonSaver`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cloudckpt.config import CheckpointConfig
    from cloudckpt.manifest import TensorEntry
    from cloudckpt.mapping import ShardedStateDict, ShardedTensor, StateDict
    from cloudckpt.storage import CheckpointStorage, WriteResult


@dataclass(frozen=True)
class FormatTraits:
    """What the core needs to know of a format.

    Attributes:
        name: the backend name ``metadata.json`` records (Megatron-Core's).
        version: the format version recorded with it.
        tensor_dirs: a tensor key owns the directory ``<key>/`` (zarr); False: tensors
            are items inside shared objects (torch_dist). Fixes the key checks' layout.
        writes_objects: the format writes the ShardedObjects too (else the common
            saver writes each as a file of its own).
        regular_grid: every tensor must be stored on a regular grid of equal chunks
            (no uneven shards); the validation checks it before anything is written.
        stages_itself: ``plan(staged=True)`` copies the tensors to host memory and
            ``write`` serializes them later; else an async save runs ``write`` into
            host memory before it returns.
        async_capable: the format writes only through the storage it is handed, so
            its writes can be staged (a strategy written for Megatron-Core's URI
            signatures cannot: it does its own I/O).
    """

    name: str
    version: int
    tensor_dirs: bool
    writes_objects: bool
    regular_grid: bool = False
    stages_itself: bool = False
    async_capable: bool = True


@dataclass(frozen=True)
class Written:
    """What :meth:`PlannedWrite.write` did on this rank.

    Attributes:
        results: one write result per object written.
        payload: what the coordinator's :meth:`PlannedWrite.finish` needs of this rank
            (picklable; None where the format needs nothing).
    """

    results: list[WriteResult] = field(default_factory=list)
    payload: Any = None


class PlannedWrite(Protocol):
    """One rank's part of a planned save (see the module docstring for the order)."""

    def write(self) -> Written:
        """Serialize and upload this rank's objects (no collective)."""
        ...

    def finish(self, payloads: Sequence[Any]) -> list[WriteResult]:
        """The coordinator's: write the format's last objects from every rank's
        :attr:`Written.payload` (by rank); their results."""
        ...


@runtime_checkable
class SaveFormat(Protocol):
    """A format's save side (see the module docstring for the call order)."""

    @property
    def traits(self) -> FormatTraits:
        """What the core needs to know of this format."""
        ...

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        """The manifest's description of ``tensors`` (shape, dtype, chunking)."""
        ...

    def plan(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
        *,
        staged: bool = False,
    ) -> PlannedWrite:
        """Plan this rank's writes of its main replicas (collective)."""
        ...


@runtime_checkable
class HasSaveFormat(Protocol):
    """A save strategy whose writes are a :class:`SaveFormat` (every cloudckpt one)."""

    def save_format(self) -> SaveFormat:
        """The format this strategy saves in, with its settings."""
        ...


class BatchWriter(Protocol):
    """Writes one checkpoint in several batches from one process
    (:func:`cloudckpt.convert.convert`)."""

    def add(self, sharded_state_dict: ShardedStateDict) -> list[WriteResult]:
        """Write one batch; its write results."""
        ...

    def finish(self) -> WriteResult:
        """Write what describes every batch added (torch_dist: ``.metadata``)."""
        ...


@runtime_checkable
class BatchWritingFormat(Protocol):
    """A format that writes a checkpoint batch by batch (else each batch is a save of
    its own, :func:`cloudckpt.formats.run.save_uncommitted`)."""

    def batch_writer(
        self, storage: CheckpointStorage, config: CheckpointConfig | None = None
    ) -> BatchWriter:
        """A writer of this checkpoint in several batches."""
        ...


@runtime_checkable
class CommonSaver(Protocol):
    """Writes the common state (coordinator) and ShardedObjects as files."""

    def save_common_to(self, storage: CheckpointStorage, common: StateDict) -> list[WriteResult]:
        """Write the common state dict."""
        ...

    def save_objects_to(
        self, storage: CheckpointStorage, objects: ShardedStateDict
    ) -> list[WriteResult]:
        """Write this rank's main-replica ShardedObjects."""
        ...


@runtime_checkable
class SerializingCommonSaver(CommonSaver, Protocol):
    """A :class:`CommonSaver` that serializes the common state separately from writing
    it, so that a save can fail on a value that cannot be serialized before the claim."""

    def serialize_common(self, common: StateDict) -> bytes:
        """The bytes :meth:`write_serialized_common` writes."""
        ...

    def write_serialized_common(self, storage: CheckpointStorage, raw: bytes) -> list[WriteResult]:
        """Write bytes made by :meth:`serialize_common`."""
        ...


@runtime_checkable
class ShardedLoader(Protocol):
    """Reads sharded tensors (and objects, when it handles them), resharding."""

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        """Return ``sharded_state_dict`` with its stored values loaded."""
        ...

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (meta-device data) for every stored tensor."""
        ...

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """Stored tensors and (when this loader handles them) objects, without data."""
        ...

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        """Delete every stored tensor whose key starts with ``key_prefix``."""
        ...


@runtime_checkable
class CommonLoader(Protocol):
    """Reads the common state and ShardedObjects stored as files."""

    def load_common_from(self, storage: CheckpointStorage) -> StateDict:
        """The common state dict."""
        ...

    def load_objects_from(self, storage: CheckpointStorage, objects: ShardedStateDict) -> StateDict:
        """``objects`` with every ShardedObject replaced by its stored value."""
        ...

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{unique_key: ShardedObject}`` (no data) for every stored ShardedObject."""
        ...


__all__ = [
    "BatchWriter",
    "BatchWritingFormat",
    "CommonLoader",
    "CommonSaver",
    "FormatTraits",
    "HasSaveFormat",
    "PlannedWrite",
    "SaveFormat",
    "SerializingCommonSaver",
    "ShardedLoader",
    "Written",
]
