"""cloudckpt: Megatron-style distributed checkpoints on object storage and local disks.

The API follows Megatron-Core's ``dist_checkpointing``: describe each rank's state
with :class:`ShardedTensor` / :class:`ShardedObject` / :class:`ShardedTensorFactory`
and call :func:`save` / :func:`load` with a URI (a local path, ``s3://``, ``gs://``
or any other fsspec protocol). A save commits with a manifest; :func:`verify`,
:func:`latest` and :func:`list_checkpoints` check and find checkpoints.

The names below are imported on first use (PEP 562), so that ``import cloudckpt`` and
the command lines that need no tensors (``cloudckpt ls``, ``verify``, ``gc``, ``rm``)
do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloudckpt import config
    from cloudckpt.checker import ConsistencyReport, Problem, verify
    from cloudckpt.config import CheckpointConfig
    from cloudckpt.core import CheckpointingConfig
    from cloudckpt.errors import (
        BucketNotFoundError,
        CheckpointingException,
        CheckpointKeyNotFoundError,
        CheckpointNotFoundError,
        CheckpointRemovedError,
        CollectiveError,
        CollectiveTimeoutError,
        CommitConflictError,
        CommonStateError,
        CorruptObjectError,
        DistributedCheckpointError,
        IncompatibleCheckpointError,
        InvalidKeyError,
        InvalidURIError,
        KeyCollisionError,
        MalformedCheckpointError,
        MissingKeysError,
        RankLostError,
        ShardingValidationError,
        StorageAccessDeniedError,
        StorageError,
        StorageUnreachableError,
        TensorMismatchError,
        UncommittedCheckpointError,
        UnexpectedKeysError,
        UnsafePickleError,
    )
    from cloudckpt.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
        apply_factory_merges,
        is_main_replica,
    )
    from cloudckpt.safe_pickle import add_safe_globals
    from cloudckpt.serialization import (
        check_is_distributed_checkpoint,
        load,
        load_common_state_dict,
        load_content_metadata,
        load_plain_tensors,
        load_sharded_metadata,
        load_tensors_metadata,
        remove_sharded_tensors,
        save,
    )
    from cloudckpt.tracker import CheckpointInfo, latest, list_checkpoints
    from cloudckpt.validation import StrictHandling

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY: dict[str, str] = {
    "config": "cloudckpt.config",
    **dict.fromkeys(("ConsistencyReport", "Problem", "verify"), "cloudckpt.checker"),
    "CheckpointConfig": "cloudckpt.config",
    "CheckpointingConfig": "cloudckpt.core",
    **dict.fromkeys(
        (
            "BucketNotFoundError",
            "CheckpointingException",
            "CheckpointKeyNotFoundError",
            "CheckpointNotFoundError",
            "CheckpointRemovedError",
            "CollectiveError",
            "CollectiveTimeoutError",
            "CommitConflictError",
            "CommonStateError",
            "CorruptObjectError",
            "DistributedCheckpointError",
            "IncompatibleCheckpointError",
            "InvalidKeyError",
            "InvalidURIError",
            "KeyCollisionError",
            "MalformedCheckpointError",
            "MissingKeysError",
            "RankLostError",
            "ShardingValidationError",
            "StorageAccessDeniedError",
            "StorageError",
            "StorageUnreachableError",
            "TensorMismatchError",
            "UncommittedCheckpointError",
            "UnexpectedKeysError",
            "UnsafePickleError",
        ),
        "cloudckpt.errors",
    ),
    **dict.fromkeys(
        (
            "LocalNonpersistentObject",
            "ShardedObject",
            "ShardedTensor",
            "ShardedTensorFactory",
            "apply_factories",
            "apply_factory_merges",
            "is_main_replica",
        ),
        "cloudckpt.mapping",
    ),
    "add_safe_globals": "cloudckpt.safe_pickle",
    **dict.fromkeys(
        (
            "check_is_distributed_checkpoint",
            "load",
            "load_common_state_dict",
            "load_content_metadata",
            "load_plain_tensors",
            "load_sharded_metadata",
            "load_tensors_metadata",
            "remove_sharded_tensors",
            "save",
        ),
        "cloudckpt.serialization",
    ),
    **dict.fromkeys(("CheckpointInfo", "latest", "list_checkpoints"), "cloudckpt.tracker"),
    "StrictHandling": "cloudckpt.validation",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562) and cache the name."""
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == "config" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BucketNotFoundError",
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointKeyNotFoundError",
    "CheckpointNotFoundError",
    "CheckpointRemovedError",
    "CheckpointingConfig",
    "CheckpointingException",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CommitConflictError",
    "CommonStateError",
    "ConsistencyReport",
    "CorruptObjectError",
    "DistributedCheckpointError",
    "IncompatibleCheckpointError",
    "InvalidKeyError",
    "InvalidURIError",
    "KeyCollisionError",
    "LocalNonpersistentObject",
    "MalformedCheckpointError",
    "MissingKeysError",
    "Problem",
    "RankLostError",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingValidationError",
    "StorageAccessDeniedError",
    "StorageError",
    "StorageUnreachableError",
    "StrictHandling",
    "TensorMismatchError",
    "UncommittedCheckpointError",
    "UnexpectedKeysError",
    "UnsafePickleError",
    "__version__",
    "add_safe_globals",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "config",
    "is_main_replica",
    "latest",
    "list_checkpoints",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "verify",
]
