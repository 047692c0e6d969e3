"""Strategies bound to an open checkpoint: the interface a save or load session uses.

The seeds fix every strategy's signature as ``save(sharded_state_dict,
checkpoint_dir)`` / ``load(...)``: each call names the checkpoint by URI, so each would
resolve its own storage. cloudckpt's storage-backed strategies instead implement the
methods below, which take the :class:`~cloudckpt.storage.CheckpointStorage` the
session opened once (with the manifest's checks bound to it). The seeds' signatures
remain, as thin wrappers (the ``*Mixin`` classes) that open a storage for the URI and
call the same methods, for callers that use a strategy directly.

A strategy that has only the seeds' signatures (one written for Megatron-Core) is
adapted by :func:`bind_sharded_saver` and its siblings: it then does its own I/O from
the URI, as in Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from cloudckpt.config import CheckpointConfig
from cloudckpt.storage import CheckpointStorage, FileSystem, WriteResult, open_checkpoint
from cloudckpt.strategies.base import checkpoint_uri

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cloudckpt.manifest import TensorEntry
    from cloudckpt.mapping import ShardedStateDict, ShardedTensor, StateDict
    from cloudckpt.strategies.base import (
        CheckpointDir,
        LoadCommonStrategy,
        LoadShardedStrategy,
        SaveCommonStrategy,
        SaveShardedStrategy,
    )


# -- what a session calls -----------------------------------------------------------------


@runtime_checkable
class ShardedSaver(Protocol):
    """Writes this rank's sharded tensors (and objects, when it handles them)."""

    def save_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> list[WriteResult]:
        """Write the main replicas; return one result per object written."""
        ...

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        """The manifest's description of ``tensors`` (shape, dtype, chunking)."""
        ...


class StagedSave(Protocol):
    """A sharded save whose data sits in host memory (see :class:`StagingSaver`)."""

    def upload(self) -> None:
        """Serialize and upload this rank's part (no collective: a background thread)."""
        ...

    def finish(self) -> list[WriteResult]:
        """After every rank's upload succeeded: the last writes (collective); this
        rank's write results, uploads included."""
        ...


@runtime_checkable
class StagingSaver(Protocol):
    """A sharded saver whose async save copies the state to host memory and plans in
    the caller's thread, and leaves serializing and uploading to the background (the
    training loop then blocks only for the copy and the planning)."""

    def stage_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> StagedSave:
        """Copy this rank's main replicas to host memory and plan (collective)."""
        ...


@runtime_checkable
class CommonSaver(Protocol):
    """Writes the common state (coordinator) and sharded objects (every rank)."""

    def save_common_to(self, storage: CheckpointStorage, common: StateDict) -> list[WriteResult]:
        """Write the common state."""
        ...

    def save_objects_to(
        self, storage: CheckpointStorage, objects: ShardedStateDict
    ) -> list[WriteResult]:
        """Write this rank's main-replica ShardedObjects."""
        ...


@runtime_checkable
class SerializingCommonSaver(CommonSaver, Protocol):
    """A common saver that serializes the common state apart from writing it, so that
    a save serializes it before its claim (a value that cannot be serialized then
    fails before anything is written)."""

    def serialize_common(self, common: StateDict) -> bytes:
        """The bytes of the common state, as :meth:`write_serialized_common` stores them."""
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
        """The state dict with every ShardedTensor replaced by its data."""
        ...

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{key: ShardedTensor without data}`` for every stored tensor."""
        ...

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """Stored tensors and (when it handles them) objects, without data."""
        ...

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        """Delete every stored tensor whose key starts with ``key_prefix``."""
        ...


@runtime_checkable
class CommonLoader(Protocol):
    """Reads the common state and sharded objects."""

    def load_common_from(self, storage: CheckpointStorage) -> StateDict:
        """The common state dict."""
        ...

    def load_objects_from(self, storage: CheckpointStorage, objects: ShardedStateDict) -> StateDict:
        """The state dict with every ShardedObject replaced by its stored value."""
        ...

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{unique_key: ShardedObject without data}`` for every stored object."""
        ...


# -- the seeds' signatures over the bound methods ------------------------------------------


class StorageBackedMixin:
    """For strategies doing I/O through :mod:`cloudckpt.storage`.

    Holds an optional filesystem (``fs``), fsspec ``storage_options`` and a
    :class:`~cloudckpt.config.CheckpointConfig`, which a session uses to open the
    checkpoint; the seeds' URI methods open one per call from the same settings.
    """

    fs: FileSystem | None = None
    storage_options: dict[str, Any] | None = None
    config: CheckpointConfig | None = None

    def _set_storage(
        self,
        fs: FileSystem | None,
        storage_options: dict[str, Any] | None,
        config: CheckpointConfig | None = None,
    ) -> None:
        self.fs = fs
        self.storage_options = storage_options
        self.config = config

    def _storage(
        self, checkpoint_dir: CheckpointDir, expected: Mapping[str, WriteResult] | None = None
    ) -> CheckpointStorage:
        return open_checkpoint(
            checkpoint_uri(checkpoint_dir),
            self.fs,
            self.storage_options,
            config=self.config,
            expected=expected,
        )


class ShardedSaveMixin(StorageBackedMixin):
    """``save(sharded_state_dict, checkpoint_dir)`` over :meth:`save_to`."""

    def save_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> list[WriteResult]:
        raise NotImplementedError

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> list[WriteResult]:
        """Write this rank's main replicas to ``checkpoint_dir``; one result per object."""
        return self.save_to(self._storage(checkpoint_dir), sharded_state_dict)


class CommonSaveMixin(StorageBackedMixin):
    """``save_common`` / ``save_sharded_objects`` over the bound methods."""

    def save_common_to(self, storage: CheckpointStorage, common: StateDict) -> list[WriteResult]:
        raise NotImplementedError

    def save_objects_to(
        self, storage: CheckpointStorage, objects: ShardedStateDict
    ) -> list[WriteResult]:
        raise NotImplementedError

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str) -> list[WriteResult]:
        """Write the common state (call on the coordinating rank only)."""
        return self.save_common_to(self._storage(checkpoint_dir), common_state_dict)

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str
    ) -> list[WriteResult]:
        """Write this rank's main-replica ShardedObjects."""
        return self.save_objects_to(self._storage(checkpoint_dir), sharded_objects_state_dict)


class ShardedLoadMixin(StorageBackedMixin):
    """``load`` / ``load_tensors_metadata`` / ``load_sharded_metadata`` /
    ``remove_sharded_tensors`` over the bound methods."""

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        raise NotImplementedError

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        raise NotImplementedError

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        return self.tensors_metadata_from(storage)

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        raise NotImplementedError

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> StateDict:
        """Return ``sharded_state_dict`` with its stored values loaded from ``checkpoint_dir``."""
        return self.load_from(self._storage(checkpoint_dir), sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """``{key: ShardedTensor}`` (meta-device data) for every stored tensor."""
        return self.tensors_metadata_from(self._storage(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """Stored tensors and (when this strategy handles them) objects, without data."""
        return self.sharded_metadata_from(self._storage(checkpoint_dir))

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Delete every stored tensor whose key starts with ``key_prefix``."""
        self.remove_tensors_from(self._storage(checkpoint_dir), key_prefix)


class CommonLoadMixin(StorageBackedMixin):
    """``load_common`` / ``load_sharded_objects`` / ``load_sharded_metadata`` over the
    bound methods."""

    def load_common_from(self, storage: CheckpointStorage) -> StateDict:
        raise NotImplementedError

    def load_objects_from(self, storage: CheckpointStorage, objects: ShardedStateDict) -> StateDict:
        raise NotImplementedError

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        raise NotImplementedError

    def load_common(self, checkpoint_dir: str) -> StateDict:
        """The common state dict saved in ``checkpoint_dir``."""
        return self.load_common_from(self._storage(checkpoint_dir))

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str
    ) -> StateDict:
        """Return the state dict with every ShardedObject replaced by its stored value."""
        return self.load_objects_from(self._storage(checkpoint_dir), sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """``{unique_key: ShardedObject}`` (no data) for every stored ShardedObject."""
        return self.sharded_metadata_from(self._storage(checkpoint_dir))


# -- strategies with only the seeds' signatures -------------------------------------------


@dataclass(frozen=True)
class _UriShardedSaver:
    strategy: SaveShardedStrategy
    uri: str

    def save_to(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
    ) -> list[WriteResult]:
        return list(self.strategy.save(sharded_state_dict, self.uri) or [])

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        from cloudckpt.manifest import TensorEntry  # noqa: PLC0415 - typing-only above

        return [
            TensorEntry(sh.key, tuple(sh.global_shape), str(sh.dtype).removeprefix("torch."))
            for sh in tensors
        ]


@dataclass(frozen=True)
class _UriCommonSaver:
    strategy: SaveCommonStrategy
    uri: str

    def save_common_to(self, storage: CheckpointStorage, common: StateDict) -> list[WriteResult]:
        return list(self.strategy.save_common(common, self.uri) or [])

    def save_objects_to(
        self, storage: CheckpointStorage, objects: ShardedStateDict
    ) -> list[WriteResult]:
        return list(self.strategy.save_sharded_objects(objects, self.uri) or [])


@dataclass(frozen=True)
class _UriShardedLoader:
    strategy: LoadShardedStrategy
    uri: str

    def load_from(
        self, storage: CheckpointStorage, sharded_state_dict: ShardedStateDict
    ) -> StateDict:
        return self.strategy.load(sharded_state_dict, self.uri)

    def tensors_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        return self.strategy.load_tensors_metadata(self.uri)

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        return self.strategy.load_sharded_metadata(self.uri)

    def remove_tensors_from(self, storage: CheckpointStorage, key_prefix: str) -> None:
        self.strategy.remove_sharded_tensors(self.uri, key_prefix)


@dataclass(frozen=True)
class _UriCommonLoader:
    strategy: LoadCommonStrategy
    uri: str

    def load_common_from(self, storage: CheckpointStorage) -> StateDict:
        return self.strategy.load_common(self.uri)

    def load_objects_from(self, storage: CheckpointStorage, objects: ShardedStateDict) -> StateDict:
        return self.strategy.load_sharded_objects(objects, self.uri)

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        return self.strategy.load_sharded_metadata(self.uri)


def bind_sharded_saver(strategy: SaveShardedStrategy, uri: str) -> ShardedSaver:
    """``strategy`` as a :class:`ShardedSaver` (adapted when it has only ``save``)."""
    return strategy if isinstance(strategy, ShardedSaver) else _UriShardedSaver(strategy, uri)


def bind_common_saver(strategy: SaveCommonStrategy, uri: str) -> CommonSaver:
    """``strategy`` as a :class:`CommonSaver`."""
    return strategy if isinstance(strategy, CommonSaver) else _UriCommonSaver(strategy, uri)


def bind_sharded_loader(strategy: LoadShardedStrategy, uri: str) -> ShardedLoader:
    """``strategy`` as a :class:`ShardedLoader`."""
    return strategy if isinstance(strategy, ShardedLoader) else _UriShardedLoader(strategy, uri)


def bind_common_loader(strategy: LoadCommonStrategy, uri: str) -> CommonLoader:
    """``strategy`` as a :class:`CommonLoader`."""
    return strategy if isinstance(strategy, CommonLoader) else _UriCommonLoader(strategy, uri)
