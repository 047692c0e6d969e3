"""The checkpoint's ``metadata.json``: which backends wrote it (Megatron-Core's keys).

``metadata.json`` holds exactly Megatron-Core's four keys - Megatron-Core 0.15
refuses unknown ones - and is written last, so its presence marks a checkpoint
whose every object was written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

from cloudckpt.errors import MalformedCheckpointError
from cloudckpt.storage import CheckpointStorage, WriteResult

logger = logging.getLogger(__name__)

CONFIG_FNAME = "metadata.json"


@dataclass(frozen=True)
class CheckpointingConfig:
    """Backends and versions a checkpoint was written with.

    Attributes:
        sharded_backend: backend of the sharded tensors ("zarr", "torch_dist").
        sharded_backend_version: format version of that backend.
        common_backend: backend of the common state ("torch").
        common_backend_version: format version of the common backend.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1

    def to_json(self) -> bytes:
        """The ``metadata.json`` document."""
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> CheckpointingConfig:
        """Parse ``metadata.json``; ``where`` names it in errors."""
        try:
            doc = json.loads(raw)
            return cls(**doc)
        except (ValueError, TypeError) as exc:
            raise MalformedCheckpointError(
                f"{where} is not a valid checkpoint config: {exc}"
            ) from exc


def save_config(config: CheckpointingConfig, storage: CheckpointStorage) -> WriteResult:
    """Write ``metadata.json`` (call once, on the coordinating rank, after all data)."""
    return storage.write(CONFIG_FNAME, config.to_json())


def maybe_load_config(storage: CheckpointStorage) -> CheckpointingConfig | None:
    """The checkpoint's config, or None when ``metadata.json`` does not exist."""
    if not storage.exists(CONFIG_FNAME):
        return None
    return CheckpointingConfig.from_json(
        storage.read(CONFIG_FNAME), storage.child_uri(CONFIG_FNAME)
    )
