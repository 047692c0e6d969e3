"""Strategy interfaces and the registry of default strategies.

A *strategy* reads or writes one part of a checkpoint in one format (a *backend*
with a format *version*): the common part (``common.pt`` and sharded objects) or
the sharded tensors. Concrete strategies live one per module under
``cloudckpt/strategies/`` and register themselves at import time with
:func:`register_default_strategy`; :func:`get_default_strategy` imports a backend's
module on first use.

Checkpoint locations are ``str`` URIs (``"s3://bucket/run/step_100"``) or local
paths, and the ``checkpoint_dir`` parameters below are typed ``str``. Strategies
should still accept ``os.PathLike`` local paths at run time and convert them with
:func:`checkpoint_uri` (``os.fspath``); never wrap a URI in :class:`pathlib.Path`,
which turns ``s3://b/k`` into ``s3:/b/k``.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from typing import TYPE_CHECKING, Any

from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import (
    IncompatibleCheckpointError,
    StrategyNotFoundError,
)
from cloudckpt.formats.run import save_uncommitted
from cloudckpt.storage import CheckpointStorage, FileSystem, WriteResult, open_checkpoint
from cloudckpt.storage.location import CheckpointDir, checkpoint_uri
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cloudckpt.formats.protocol import SaveFormat
    from cloudckpt.mapping import ShardedStateDict, StateDict

logger = logging.getLogger(__name__)


class StrategyAction(Enum):
    """What a strategy does: save or load, the common or the sharded part."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


default_strategies: defaultdict[str, dict[tuple[str, int], Any]] = defaultdict(dict)
"""Registry: ``default_strategies[action.value][(backend, version)] -> strategy``."""

async_calls = AsyncCallsQueue()
"""Process-wide queue for async saves (starts no thread until a request is scheduled)."""

_BACKEND_MODULES: dict[str, str] = {
    "zarr": "cloudckpt.strategies.zarr",
    "torch": "cloudckpt.strategies.common",
    "torch_dist": "cloudckpt.strategies.torch",
}
"""Module that registers each backend's default strategies when imported."""


def _as_action(action: StrategyAction | str) -> StrategyAction:
    try:
        return StrategyAction(action)
    except ValueError:
        valid = ", ".join(a.value for a in StrategyAction)
        raise StrategyNotFoundError(
            f"unknown strategy action {action!r}; expected one of: {valid}"
        ) from None


def _import_backend(action: StrategyAction, backend: str, version: int) -> None:
    """Import the module that registers ``backend``'s strategies, if one is known."""
    module = _BACKEND_MODULES.get(backend)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name or module
        raise StrategyNotFoundError(
            f"cannot load a default strategy for {(action.value, backend, version)}: "
            f"importing {module} failed because module {missing!r} is missing ({exc})"
        ) from exc


def get_default_strategy(action: StrategyAction | str, backend: str, version: int) -> Any:
    """Return the strategy registered for ``(action, backend, version)``.

    When nothing is registered for the triple yet, the backend's module (``zarr``,
    ``torch``, ``torch_dist``) is imported first, which registers its strategies.

    Args:
        action: what the strategy must do (a :class:`StrategyAction` or its value).
        backend: the backend name, as stored in ``metadata.json``.
        version: the backend's format version.

    Returns:
        The registered strategy instance.

    Raises:
        StrategyNotFoundError: the backend's module cannot be imported (the message
            names the missing module), or no strategy is registered for the triple
            (the message lists what is registered for ``action``).
    """
    action = _as_action(action)
    registered = default_strategies[action.value]
    if (backend, version) not in registered:
        _import_backend(action, backend, version)
    try:
        return registered[(backend, version)]
    except KeyError:
        available = ", ".join(f"{b!r} v{v}" for b, v in sorted(registered)) or "nothing"
        raise StrategyNotFoundError(
            f"no default strategy for {(action.value, backend, version)}; "
            f"registered for {action.value!r}: {available}"
        ) from None


def register_default_strategy(
    action: StrategyAction | str,
    backend: str,
    version: int,
    strategy: SaveStrategyBase | LoadStrategyBase,
) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``.

    A later registration for the same triple replaces the earlier one.

    Args:
        action: what the strategy does (a :class:`StrategyAction` or its value).
        backend: backend the strategy becomes a default for.
        version: format version the strategy becomes a default for.
        strategy: the strategy instance.
    """
    action = _as_action(action)
    previous = default_strategies[action.value].get((backend, version))
    if previous is not None and previous is not strategy:
        logger.debug(
            "replacing default %s strategy for (%s, %s): %s -> %s",
            action.value,
            backend,
            version,
            previous,
            strategy,
        )
    default_strategies[action.value][(backend, version)] = strategy


class LoadStrategyBase(ABC):
    """Base of load strategies: a strategy must say which stored formats it can read.

    The loader reads ``metadata.json`` and calls :func:`check_compatibility` (both
    checks below) before any ``load*`` method.
    """

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Check that this strategy can read data stored by ``loaded_backend``.

        Raises:
            IncompatibleCheckpointError: it cannot. Returning normally means it can.
        """

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Check that this strategy can read format version ``loaded_version``.

        Raises:
            IncompatibleCheckpointError: it cannot. Returning normally means it can.
        """

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also loads ShardedObjects (False by default)."""
        return False


class SaveStrategyBase(ABC):
    """Base of save strategies: a strategy writes one backend at one format version.

    Args:
        backend: the backend name written to ``metadata.json`` (e.g. ``"zarr"``).
        version: the format version written to ``metadata.json``.
    """

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy also saves ShardedObjects (False by default)."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part of a checkpoint and its sharded objects."""

    @abstractmethod
    def load_common(self, checkpoint_dir: str) -> StateDict:
        """Return the common state dict saved in the checkpoint at ``checkpoint_dir``."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str
    ) -> StateDict:
        """Load the ShardedObjects of ``sharded_objects_state_dict``.

        Returns:
            The same nested dict with every ShardedObject replaced by its loaded value.
        """

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """Return the ShardedObjects stored in the checkpoint, keyed by sharded key.

        The default suits a strategy that cannot load sharded objects: it returns
        ``{}``. A strategy that can must override it.

        Raises:
            NotImplementedError: the strategy handles sharded objects but does not
                override this method.
        """
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError(
            f"{type(self).__name__} handles sharded objects and must implement "
            "load_sharded_metadata"
        )


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded tensors of a checkpoint (and, if able, its sharded objects)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> StateDict:
        """Load every ShardedTensor of ``sharded_state_dict`` from ``checkpoint_dir``.

        Returns:
            The same nested dict with every ShardedTensor replaced by its tensor.
        """

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """Describe the stored tensors: ``{sharded key: ShardedTensor without data}``.

        Keys are ShardedTensor keys, not state dict keys; each value carries the
        global shape and dtype only (no data, no sharding).
        """

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Delete from the checkpoint every tensor whose key starts with ``key_prefix``.

        Not abstract, as in Megatron-Core: a strategy that cannot remove tensors (a
        load-only one written for Megatron) need not define it.

        Raises:
            NotImplementedError: the strategy does not override it.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot remove tensors from {checkpoint_dir!r}"
        )

    def load_sharded_metadata(self, checkpoint_dir: str) -> ShardedStateDict:
        """Describe the stored tensors and objects, keyed by sharded key.

        The default suits a strategy that cannot load sharded objects: it returns
        :meth:`load_tensors_metadata`. A strategy that can must override it.

        Raises:
            NotImplementedError: the strategy handles sharded objects but does not
                override this method.
        """
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(
            f"{type(self).__name__} handles sharded objects and must implement "
            "load_sharded_metadata"
        )


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) part of a state dict and its sharded objects."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: str) -> Any:
        """Save ``common_state_dict`` (called on the coordinator rank only).

        Returns:
            A backend-defined record of what was written (cloudckpt's strategies
            return their storage write results, for the manifest), or None.
        """

    @abstractmethod
    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str
    ) -> Any:
        """Save the main replicas of the ShardedObjects in ``sharded_objects_state_dict``.

        Returns:
            A backend-defined record of what was written, or None (as for
            :meth:`save_common`).
        """


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded tensors of a state dict (called on every rank)."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> Any:
        """Save this rank's main-replica shards of ``sharded_state_dict``.

        Returns:
            A backend-defined record of what this rank wrote (cloudckpt's strategies
            return their storage write results, for the manifest), or None.
        """


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save that can run in the background.

    :meth:`async_save` does the blocking part (staging the shards in host memory)
    and returns an :class:`AsyncRequest` for the rest; the caller schedules it, e.g.
    on :data:`async_calls`. :meth:`save` runs the same request synchronously.
    """

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> AsyncRequest:
        """Prepare the save of ``sharded_state_dict`` and return it as a request.

        Returns:
            The request whose ``async_fn`` writes the data and whose ``finalize_fns``
            complete the save; scheduling it is the caller's job.
        """

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        """Save synchronously: run :meth:`async_save`'s request to completion here.

        A collective (see :meth:`AsyncRequest.execute_sync`): call it on every rank.
        """
        self.async_save(sharded_state_dict, checkpoint_uri(checkpoint_dir)).execute_sync()


def check_compatibility(
    strategy: LoadStrategyBase, backend: str, version: int, checkpoint_dir: CheckpointDir
) -> None:
    """Check that ``strategy`` can read a checkpoint stored as ``backend`` v``version``.

    Args:
        strategy: the load strategy about to be used.
        backend: the backend recorded in the checkpoint's ``metadata.json``.
        version: the version recorded in the checkpoint's ``metadata.json``.
        checkpoint_dir: the checkpoint, named in the error.

    Raises:
        IncompatibleCheckpointError: either check failed; the message names the URI,
            the stored backend and version and the strategy, chained to the check's error.
    """
    uri = checkpoint_uri(checkpoint_dir)
    try:
        strategy.check_backend_compatibility(backend)
        strategy.check_version_compatibility(version)
    except IncompatibleCheckpointError as exc:
        raise IncompatibleCheckpointError(
            f"checkpoint {uri} was written by backend {backend!r} version {version}, "
            f"which {type(strategy).__name__} cannot load: {exc}"
        ) from exc


class SingleFormatLoadMixin:
    """Real compatibility checks for a load strategy that reads one (backend, version).

    The class sets ``backend`` and ``version``; a checkpoint recording anything else
    is refused with :class:`IncompatibleCheckpointError`.
    """

    backend: str
    version: int

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise unless ``loaded_backend`` is this strategy's backend."""
        if loaded_backend != self.backend:
            raise IncompatibleCheckpointError(
                f"{type(self).__name__} reads backend {self.backend!r}, "
                f"checkpoint has {loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise unless ``loaded_version`` is this strategy's format version."""
        if loaded_version != self.version:
            raise IncompatibleCheckpointError(
                f"{type(self).__name__} reads {self.backend!r} format version {self.version}, "
                f"checkpoint has version {loaded_version!r}"
            )


# -- Megatron-Core's signatures over cloudckpt's storage ----------------------------------


class StorageBackedMixin:
    """For strategies doing I/O through :mod:`cloudckpt.storage`.

    Holds an optional filesystem (``fs``), fsspec ``storage_options`` and a
    :class:`~cloudckpt.config.CheckpointConfig`, which a session uses to open the
    checkpoint; Megatron-Core's URI methods open one per call from the same settings.
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


class FormatSaveMixin(StorageBackedMixin):
    """``save(sharded_state_dict, checkpoint_dir)`` over the strategy's format: plan,
    write and finish, without a commit (:func:`cloudckpt.formats.run.save_uncommitted`)."""

    def save_format(self) -> SaveFormat:
        raise NotImplementedError

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> list[WriteResult]:
        """Write this rank's main replicas to ``checkpoint_dir``; one result per object."""
        storage = self._storage(checkpoint_dir)
        return save_uncommitted(self.save_format(), storage, sharded_state_dict)


class CommonSaveMixin(StorageBackedMixin):
    """``save_common`` / ``save_sharded_objects`` over the storage methods."""

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
    ``remove_sharded_tensors`` over the storage methods."""

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
    storage methods."""

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
