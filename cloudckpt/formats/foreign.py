"""Strategies written for Megatron-Core's signatures only (``save(sharded_state_dict,
checkpoint_dir)``, ``load(...)``), as the format protocol's parts: they do their own I/O
from the URI, as in Megatron-Core, so their writes cannot be staged (no async save) and
the checkpoint's manifest records what they return.

:func:`save_format_of` and its siblings give a session the protocol's view of any strategy:
cloudckpt's own (:class:`~cloudckpt.formats.protocol.HasSaveFormat`, the bound methods of
:class:`~cloudckpt.formats.protocol.CommonSaver` and the loaders) as they are, others
adapted here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloudckpt.formats.protocol import (
    CommonLoader,
    CommonSaver,
    FormatTraits,
    HasSaveFormat,
    SaveFormat,
    ShardedLoader,
    Written,
)

if TYPE_CHECKING:
    from cloudckpt.config import CheckpointConfig
    from cloudckpt.manifest import TensorEntry
    from cloudckpt.mapping import ShardedStateDict, ShardedTensor, StateDict
    from cloudckpt.storage import CheckpointStorage, WriteResult
    from cloudckpt.strategies.base import (
        LoadCommonStrategy,
        LoadShardedStrategy,
        SaveCommonStrategy,
        SaveShardedStrategy,
    )


def foreign_traits(strategy: Any) -> FormatTraits:
    """What a strategy without declared traits is taken to write: tensors under
    ``<key>/`` on a regular grid (as Megatron-Core's zarr backend), unless its backend
    is torch_dist (DCP items); ShardedObjects when it says it handles them."""
    dcp = strategy.backend == "torch_dist"
    return FormatTraits(
        strategy.backend,
        strategy.version,
        tensor_dirs=not dcp,
        writes_objects=bool(strategy.can_handle_sharded_objects),
        regular_grid=strategy.backend == "zarr",
        async_capable=False,
    )


@dataclass(frozen=True)
class UriFormat:
    """A save strategy with only ``save(sharded_state_dict, checkpoint_dir)``: its save
    runs in ``plan`` (it may be collective), into ``uri`` (default: the storage's)."""

    strategy: SaveShardedStrategy
    uri: str | None = None

    @property
    def traits(self) -> FormatTraits:
        return foreign_traits(self.strategy)

    def tensor_entries(
        self, tensors: list[ShardedTensor], config: CheckpointConfig | None = None
    ) -> list[TensorEntry]:
        from cloudckpt.manifest import TensorEntry  # noqa: PLC0415 - typing-only above

        return [
            TensorEntry(sh.key, tuple(sh.global_shape), str(sh.dtype).removeprefix("torch."))
            for sh in tensors
        ]

    def plan(
        self,
        storage: CheckpointStorage,
        sharded_state_dict: ShardedStateDict,
        config: CheckpointConfig | None = None,
        *,
        staged: bool = False,
    ) -> _DoneWrite:
        uri = self.uri if self.uri is not None else storage.uri
        return _DoneWrite(list(self.strategy.save(sharded_state_dict, uri) or []))


@dataclass(frozen=True)
class _DoneWrite:
    """A write that happened in the plan."""

    results: list[WriteResult]

    def write(self) -> Written:
        return Written(self.results)

    def finish(self, payloads: Sequence[Any]) -> list[WriteResult]:
        return []


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


def save_format_of(strategy: SaveShardedStrategy, uri: str | None = None) -> SaveFormat:
    """``strategy``'s format (adapted when it has only ``save``: into ``uri``, default the
    storage's)."""
    if isinstance(strategy, HasSaveFormat):
        return strategy.save_format()
    return UriFormat(strategy, uri)


def common_saver_of(strategy: SaveCommonStrategy, uri: str) -> CommonSaver:
    """``strategy`` as a :class:`CommonSaver`."""
    return strategy if isinstance(strategy, CommonSaver) else _UriCommonSaver(strategy, uri)


def sharded_loader_of(strategy: LoadShardedStrategy, uri: str) -> ShardedLoader:
    """``strategy`` as a :class:`ShardedLoader`."""
    return strategy if isinstance(strategy, ShardedLoader) else _UriShardedLoader(strategy, uri)


def common_loader_of(strategy: LoadCommonStrategy, uri: str) -> CommonLoader:
    """``strategy`` as a :class:`CommonLoader`."""
    return strategy if isinstance(strategy, CommonLoader) else _UriCommonLoader(strategy, uri)


__all__ = [
    "UriFormat",
    "common_loader_of",
    "common_saver_of",
    "foreign_traits",
    "save_format_of",
    "sharded_loader_of",
]
