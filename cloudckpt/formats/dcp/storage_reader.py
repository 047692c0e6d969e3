"""PyTorch DCP ``StorageReader`` over :class:`~cloudckpt.storage.CheckpointStorage`
(:class:`CloudStorageReader`), for ``torch.distributed.checkpoint.load``: the
counterpart of the writer in :mod:`.storage`."""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from cloudckpt.errors import CheckpointingException
from cloudckpt.formats.dcp.columns import StorageColumns
from cloudckpt.formats.dcp.storage import read_metadata
from cloudckpt.formats.dcp.stored_items import item_request, load_tensor_item
from cloudckpt.storage import CheckpointStorage


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
        self.storage_columns: StorageColumns | None = None

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
