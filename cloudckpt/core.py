"""The checkpoint's ``metadata.json``: which backends wrote it (Megatron-Core's keys).

``metadata.json`` holds exactly Megatron-Core's four keys - Megatron-Core 0.15
refuses unknown ones - and is written last, so its presence marks a checkpoint
whose every object was written.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from cloudckpt.errors import (  # CheckpointingException: Megatron-Core's core.py defines it
    CheckpointingException as CheckpointingException,  # noqa: PLC0414
)
from cloudckpt.errors import MalformedCheckpointError
from cloudckpt.storage import CheckpointStorage, WriteResult, open_checkpoint

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
        """Parse ``metadata.json``; ``where`` names it in errors. Every field must have
        its type (backends strings, versions integers): a list or a dict there would
        otherwise fail later as a raw ``TypeError`` (unhashable, in the strategy
        registry's lookup)."""
        try:
            config = cls(**json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise MalformedCheckpointError(
                f"{where} is not a valid checkpoint config: {exc}"
            ) from exc
        for name, kind in _FIELD_TYPES.items():
            value = getattr(config, name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise MalformedCheckpointError(
                    f"{where} is not a valid checkpoint config: field {name!r} is "
                    f"{value!r} ({type(value).__name__}), not {kind.__name__}"
                )
        return config


_FIELD_TYPES: dict[str, type] = {
    "sharded_backend": str,
    "sharded_backend_version": int,
    "common_backend": str,
    "common_backend_version": int,
}


#: Where a checkpoint is: a URI or path (``str`` / ``os.PathLike``), or opened storage.
CheckpointLocation = str | os.PathLike[str] | CheckpointStorage


def _storage(checkpoint_dir: CheckpointLocation) -> CheckpointStorage:
    """``checkpoint_dir`` as storage: opened from a URI or path, or as given."""
    if isinstance(checkpoint_dir, CheckpointStorage):
        return checkpoint_dir
    # imported here: strategies.base imports torch, which the CLI's commands avoid
    from cloudckpt.storage.location import checkpoint_uri  # noqa: PLC0415

    return open_checkpoint(checkpoint_uri(checkpoint_dir))


def save_config(config: CheckpointingConfig, checkpoint_dir: CheckpointLocation) -> WriteResult:
    """Write ``metadata.json`` (call once, on the coordinating rank, after all data).

    Args:
        config: the backends the checkpoint was written with.
        checkpoint_dir: the checkpoint: a URI, a local path (``str`` or ``pathlib.Path``),
            or a :class:`~cloudckpt.storage.CheckpointStorage` already opened.
    """
    return _storage(checkpoint_dir).write(CONFIG_FNAME, config.to_json())


def maybe_load_config(checkpoint_dir: CheckpointLocation) -> CheckpointingConfig | None:
    """The checkpoint's config, or None when ``metadata.json`` does not exist.

    Args:
        checkpoint_dir: as Megatron-Core, the checkpoint directory (``str`` URI or path,
            ``pathlib.Path``; an empty one gives None); or a
            :class:`~cloudckpt.storage.CheckpointStorage`. ``Path("s3://...")`` is
            refused (it lost the URI's ``//``).

    Raises:
        CheckpointingException: ``metadata.json`` exists but is not a valid config.
    """
    if not isinstance(checkpoint_dir, CheckpointStorage) and not checkpoint_dir:
        return None  # as Megatron-Core: no directory given, no config
    storage = _storage(checkpoint_dir)
    if not storage.exists(CONFIG_FNAME):
        return None
    return CheckpointingConfig.from_json(
        storage.read(CONFIG_FNAME), storage.child_uri(CONFIG_FNAME)
    )


def check_is_distributed_checkpoint(checkpoint_dir: CheckpointLocation) -> bool:
    """True when ``checkpoint_dir`` has a ``metadata.json`` (Megatron-Core's test).

    :func:`cloudckpt.serialization.check_is_distributed_checkpoint` is stricter: it
    also requires the manifest of a checkpoint cloudckpt wrote (a committed one).
    """
    return maybe_load_config(checkpoint_dir) is not None
