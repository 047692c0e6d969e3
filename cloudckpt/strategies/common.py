"""Common-state backend ("torch", version 1): ``common.pt`` and ShardedObject files.

Rank 0 saves the common (non-sharded) state dict as ``<uri>/common.pt``; every rank
saves its main-replica ShardedObjects as ``<uri>/<key>/shard_<offsets>_<shape>.pt``
(the object's ``unique_key`` plus ``.pt``). Both are ``torch.save`` bytes, written
and read through :mod:`cloudckpt.storage`, the same layout as Megatron-Core.

Loading unpickles them restricted, as ``torch.load(weights_only=True)`` does, with
cloudckpt's allow-list (:mod:`cloudckpt.safe_pickle`): a pickle that would call
anything else raises :class:`~cloudckpt.errors.UnsafePickleError`. For a checkpoint
you trust, ``weights_only=False`` (or ``CLOUDCKPT_TRUST_PICKLES=1``) unpickles without
restriction, as Megatron-Core does.
"""

from __future__ import annotations

import io
import logging
import re
from typing import Any

import torch

from cloudckpt import dist
from cloudckpt.dict_utils import dict_list_map_outplace, nested_values
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    CheckpointNotFoundError,
)
from cloudckpt.mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from cloudckpt.safe_pickle import load_torch_pickle
from cloudckpt.storage import CheckpointStorage, FileSystem, ReadRequest, WriteResult
from cloudckpt.strategies.base import (
    CommonLoadMixin,
    CommonSaveMixin,
    LoadCommonStrategy,
    SaveCommonStrategy,
    SingleFormatLoadMixin,
    StrategyAction,
    register_default_strategy,
)

logger = logging.getLogger(__name__)

BACKEND = "torch"
VERSION = 1
COMMON_STATE_FNAME = "common.pt"
DCP_METADATA_FNAME = ".metadata"
DCP_COMMON_STATE_ITEM = "common_state"  # Megatron-Core 0.19+: common state inside DCP
_SHARD_FILE = re.compile(r"(^|/)shard_[0-9.]*_[0-9.]*\.pt$")


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_dcp_common_state(storage: CheckpointStorage, weights_only: bool | None = None) -> Any:
    """The common state Megatron-Core 0.19+ keeps as the DCP bytes item ``common_state``.

    Returns None when the checkpoint has no DCP ``.metadata`` or no such item.
    """
    if not storage.exists(DCP_METADATA_FNAME):
        return None
    # imported here: it loads torch.distributed.checkpoint, which common.pt users never need
    from cloudckpt.formats.dcp.reader import (  # noqa: PLC0415
        DcpCheckpoint,
        is_common_state_item,
    )

    checkpoint = DcpCheckpoint(storage, weights_only=weights_only)
    items = [key for key in checkpoint.object_keys() if is_common_state_item(key)]
    if not items:
        return None
    return checkpoint.read_objects(items[:1])[items[0]]


class TorchCommonSaveStrategy(CommonSaveMixin, SaveCommonStrategy):
    """Save common state and ShardedObjects with ``torch.save`` through the storage layer."""

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(backend, version)
        self._set_storage(fs, storage_options)

    @property
    def can_handle_sharded_objects(self) -> bool:
        """This strategy saves ShardedObjects."""
        return True

    def save_common_to(self, storage: CheckpointStorage, common: StateDict) -> list[WriteResult]:
        """Write ``common.pt`` (call on the coordinating rank only)."""
        return self.write_serialized_common(storage, self.serialize_common(common))

    def serialize_common(self, common: StateDict) -> bytes:
        """The bytes of ``common.pt`` (``torch.save``)."""
        return _dumps(common)

    def write_serialized_common(self, storage: CheckpointStorage, raw: bytes) -> list[WriteResult]:
        """Write ``common.pt`` from :meth:`serialize_common`'s bytes."""
        return [storage.write(COMMON_STATE_FNAME, raw)]

    def save_objects_to(
        self, storage: CheckpointStorage, objects: ShardedStateDict
    ) -> list[WriteResult]:
        """Write this rank's main-replica ShardedObjects, one object each."""
        writes = [
            (f"{obj.unique_key}.pt", _dumps(obj.data))
            for obj in nested_values(objects)
            if isinstance(obj, ShardedObject) and is_main_replica(obj.replica_id)
        ]
        return storage.write_many(writes)


class TorchCommonLoadStrategy(SingleFormatLoadMixin, CommonLoadMixin, LoadCommonStrategy):
    """Load ``common.pt`` and ShardedObjects.

    Args:
        weights_only: True unpickles restricted to the allow-list (see
            :mod:`cloudckpt.safe_pickle`); False without restriction (Megatron-Core's
            behaviour: for trusted checkpoints only); None (default) restricted unless
            the load call or ``CLOUDCKPT_TRUST_PICKLES=1`` says otherwise.
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        fs: FileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        weights_only: bool | None = None,
    ) -> None:
        self.backend = backend
        self.version = version
        self._set_storage(fs, storage_options)
        self.weights_only = weights_only

    @property
    def can_handle_sharded_objects(self) -> bool:
        """This strategy loads ShardedObjects."""
        return True

    def _loads(self, raw: bytes, where: str, what: str) -> Any:
        return load_torch_pickle(raw, where, what, self.weights_only)

    def load_common_from(self, storage: CheckpointStorage) -> StateDict:
        """Read and unpickle ``common.pt``."""
        try:
            raw = storage.read(COMMON_STATE_FNAME)
            where = storage.child_uri(COMMON_STATE_FNAME)
            state = self._loads(raw, where, "common state")
        except CheckpointNotFoundError as exc:
            state = load_dcp_common_state(storage, self.weights_only)
            if state is None:
                raise CheckpointNotFoundError(
                    f"checkpoint {storage.uri!r} has no {COMMON_STATE_FNAME} (common state)"
                ) from exc
            where = f"{storage.uri} (DCP item {DCP_COMMON_STATE_ITEM!r})"
        if not isinstance(state, dict):
            raise CheckpointingException(f"{where} holds a {type(state).__name__}, not a dict")
        return state

    def load_objects_from(self, storage: CheckpointStorage, objects: ShardedStateDict) -> StateDict:
        """Return ``objects`` with every ShardedObject replaced by its stored value."""
        requested = [o for o in nested_values(objects) if isinstance(o, ShardedObject)]
        try:
            raws = storage.read_many([ReadRequest(f"{o.unique_key}.pt") for o in requested])
        except CheckpointNotFoundError as exc:
            missing = self._missing_object_error(storage, requested)
            if missing is None:  # listed, yet unreadable: not a key the checkpoint lacks
                raise
            raise missing from exc
        loaded = {
            id(o): self._loads(
                raw, storage.child_uri(f"{o.unique_key}.pt"), f"sharded object {o.key!r}"
            )
            for o, raw in zip(requested, raws, strict=True)
        }

        def replace(value: Any) -> Any:
            return loaded[id(value)] if isinstance(value, ShardedObject) else value

        return dict_list_map_outplace(replace, objects)

    def _missing_object_error(
        self, storage: CheckpointStorage, objects: list[ShardedObject]
    ) -> CheckpointKeyNotFoundError | None:
        present = set(storage.list())
        missing = [o.unique_key for o in objects if f"{o.unique_key}.pt" not in present]
        keys = {o.key for o in objects}
        stored = sorted(
            p[:-3] for p in present if _SHARD_FILE.search(p) and p.rsplit("/", 1)[0] in keys
        )
        if not missing:
            return None
        return CheckpointKeyNotFoundError.of(
            "sharded object(s)",
            missing,
            storage.uri,
            dist.get_rank(),
            f"; stored shards of these keys: {stored or 'none'}",
        )

    def sharded_metadata_from(self, storage: CheckpointStorage) -> ShardedStateDict:
        """``{unique_key: ShardedObject}`` (no data) for every stored ShardedObject."""
        out: ShardedStateDict = {}
        for path in storage.list():
            if _SHARD_FILE.search(path) and "/" in path:
                obj = ShardedObject.empty_from_unique_key(path[: -len(".pt")])
                out[obj.unique_key] = obj
        return out


register_default_strategy(StrategyAction.SAVE_COMMON, BACKEND, VERSION, TorchCommonSaveStrategy())
register_default_strategy(StrategyAction.LOAD_COMMON, BACKEND, VERSION, TorchCommonLoadStrategy())
