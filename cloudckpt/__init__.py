"""cloudckpt: Megatron-style distributed checkpoints on object storage and local disks.

The API follows Megatron-Core's ``dist_checkpointing``: describe each rank's state
with :class:`ShardedTensor` / :class:`ShardedObject` / :class:`ShardedTensorFactory`
and call :func:`save` / :func:`load` with a URI (a local path, ``s3://``, ``gs://``
or any other fsspec protocol). A save commits with a manifest; :func:`verify`,
:func:`latest` and :func:`list_checkpoints` check and find checkpoints.
"""

from cloudckpt import config
from cloudckpt.checker import ConsistencyReport, Problem, verify
from cloudckpt.config import CheckpointConfig
from cloudckpt.core import CheckpointingConfig
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CommitConflictError,
    CorruptObjectError,
    DistributedCheckpointError,
    IncompatibleCheckpointError,
    InvalidKeyError,
    MissingKeysError,
    ShardingValidationError,
    StorageError,
    UncommittedCheckpointError,
    UnexpectedKeysError,
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
from cloudckpt.serialization import (
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from cloudckpt.tracker import CheckpointInfo, latest, list_checkpoints
from cloudckpt.validation import StrictHandling

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointingConfig",
    "CheckpointingException",
    "CommitConflictError",
    "ConsistencyReport",
    "CorruptObjectError",
    "DistributedCheckpointError",
    "IncompatibleCheckpointError",
    "InvalidKeyError",
    "LocalNonpersistentObject",
    "MissingKeysError",
    "Problem",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingValidationError",
    "StorageError",
    "StrictHandling",
    "UncommittedCheckpointError",
    "UnexpectedKeysError",
    "__version__",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "config",
    "is_main_replica",
    "latest",
    "list_checkpoints",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "remove_sharded_tensors",
    "save",
    "verify",
]
