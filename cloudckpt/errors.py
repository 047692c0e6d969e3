"""Exceptions raised by cloudckpt.

Every error derives from :class:`CheckpointingException`. Where a built-in exception
describes the situation too, the error mixes it in, so callers can catch either
(``except FileNotFoundError`` keeps working for a missing checkpoint).
"""

from __future__ import annotations


class CheckpointingException(Exception):
    """Base class of every error raised by cloudckpt."""


class ShardingValidationError(CheckpointingException, ValueError):
    """The sharding of a state dict is inconsistent (overlaps, gaps, mismatched metadata).

    ``violations`` lists every problem found, one human-readable line each.
    """

    def __init__(self, message: str, violations: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.violations = violations


class InvalidKeyError(CheckpointingException, ValueError):
    """A state dict key cannot be used as an object path (``..``, empty segment, leading ``/``)."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """No checkpoint (or no object of it) exists at the given URI."""


class UncommittedCheckpointError(CheckpointingException):
    """The checkpoint exists but was never committed (its ``metadata.json`` is missing)."""


class IncompatibleCheckpointError(CheckpointingException):
    """The checkpoint was written by a backend or version this strategy cannot read."""


class StrategyNotFoundError(CheckpointingException, KeyError):
    """No strategy is registered for a (action, backend, version) triple."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class MissingKeysError(CheckpointingException, KeyError):
    """Keys requested by a load are absent from the checkpoint (strict loading)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(CheckpointingException, KeyError):
    """The checkpoint holds keys the load did not request (strict loading)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageError(CheckpointingException, OSError):
    """An object could not be written, read, listed or deleted."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there."""


class CommitConflictError(CheckpointingException, FileExistsError):
    """Another job claimed or committed the same checkpoint URI."""


class CorruptObjectError(StorageError):
    """An object's size or CRC-32C differs from what the manifest recorded."""


class DistributedCheckpointError(CheckpointingException):
    """One or more ranks failed; ``failures`` maps rank -> error message."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
