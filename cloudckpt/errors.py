"""Exceptions raised by cloudckpt.

Every error derives from :class:`CheckpointingException`. Where a built-in exception
describes the situation too, the error mixes it in, so callers can catch either
(``except FileNotFoundError`` keeps working for a missing checkpoint).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from cloudckpt.redact import redact_text


class CheckpointingException(Exception):
    """Base class of every error raised by cloudckpt.

    Its string arguments go through :func:`cloudckpt.redact.redact_text`: whatever a
    message quotes (a client's error text, a URI), it shows no secret.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact_text(a) if isinstance(a, str) else a for a in args))


class ShardingValidationError(CheckpointingException, ValueError):
    """The sharding of a state dict is inconsistent (overlaps, gaps, mismatched metadata).

    ``violations`` lists every problem found, one human-readable line each.
    """

    def __init__(self, message: str, violations: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.violations = violations

    def __reduce__(self) -> tuple[Any, ...]:
        # to the other ranks with its violations (the coordinator checks for all)
        return type(self), (str(self), self.violations)


class InvalidKeyError(CheckpointingException, ValueError):
    """A state dict key cannot be used as an object path (``..``, empty segment, leading ``/``)."""


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """No checkpoint (or no object of it) exists at the given URI."""


class CheckpointKeyNotFoundError(CheckpointingException, KeyError):
    """A key requested by a load is not stored in an existing checkpoint.

    Deliberately not a ``FileNotFoundError``: the usual ``except FileNotFoundError:
    start fresh`` of a training loop must not silently restart from scratch because
    the model gained a parameter. ``keys`` lists the missing keys.
    """

    keys: tuple[str, ...] = ()

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""

    @classmethod
    def of(
        cls, what: str, keys: Iterable[str], uri: str, rank: int, detail: str = ""
    ) -> CheckpointKeyNotFoundError:
        """``rank R: <what> [keys] requested by the load are not stored in checkpoint
        'URI'<detail>``; ``uri`` must be redacted already."""
        missing = tuple(sorted(keys))
        return cls(
            f"rank {rank}: {what} {list(missing)} requested by the load are not stored in "
            f"checkpoint {uri!r}{detail}",
            missing,
        )

    def __reduce__(self) -> tuple[type[CheckpointKeyNotFoundError], tuple[str, tuple[str, ...]]]:
        return (type(self), (str(self), self.keys))


class UncommittedCheckpointError(CheckpointingException):
    """The checkpoint exists but was never committed (its ``metadata.json`` is missing)."""


class IncompatibleCheckpointError(CheckpointingException):
    """The checkpoint was written by a backend or version this strategy cannot read."""


class StrategyNotFoundError(CheckpointingException, KeyError):
    """No strategy is registered for a (action, backend, version) triple."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0]) if self.args else ""


class MissingKeysError(CheckpointingException, KeyError):
    """The checkpoint holds keys that no rank's load requested (``strict=RAISE_ALL``);
    Megatron-Core's "missing keys"."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(CheckpointingException, KeyError):
    """Keys this rank's load requested are not in the checkpoint (``strict=RAISE_*``);
    Megatron-Core's "unexpected keys". When keys are also missing (``RAISE_ALL``), the
    message lists both."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StorageError(CheckpointingException, OSError):
    """An object could not be written, read, listed or deleted."""


class StorageUnreachableError(StorageError, ConnectionError):
    """The object store's endpoint cannot be reached (connection refused, DNS, timeout).

    The message names the URI (redacted), the endpoint tried and the settings that
    choose it (environment, ``--storage-option``, the config's ``storage_options``).
    """


class StorageAccessDeniedError(StorageError, PermissionError):
    """The object store refused the credentials (unknown key, bad signature, access
    denied, expired token) or none were found; the message names the settings to fix."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the object already there."""


class ConfigError(CheckpointingException, ValueError):
    """A checkpoint configuration value, section or file is invalid."""


class CommitConflictError(CheckpointingException, FileExistsError):
    """Another job claimed or committed the same checkpoint URI."""


class CheckpointRemovedError(CommitConflictError):
    """A removal (``cloudckpt gc``, ``cloudckpt rm``) took the checkpoint while its save
    was writing it: nothing was committed, and the save deleted what it wrote."""


class CorruptObjectError(StorageError):
    """An object's size or CRC-32C differs from what the manifest recorded."""


class DistributedCheckpointError(CheckpointingException):
    """One or more ranks failed; ``failures`` maps rank -> error message.

    ``errors`` maps rank -> the exception that rank raised, for those that could be
    sent between processes. Raised on every rank of a collective operation, so a
    failure on one rank never leaves the others waiting. When every failed rank
    raised one kind of error, the raised class also derives from that kind (see
    :func:`distributed_variant`).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})
        self.errors: dict[int, BaseException] = {}

    def __reduce__(self) -> tuple[type[DistributedCheckpointError], tuple[str, dict[int, str]]]:
        # Variants are made at run time and cannot be pickled by name: travel as the base.
        return (DistributedCheckpointError, (str(self), self.failures))


_VARIANTS: dict[type[CheckpointingException], type[DistributedCheckpointError]] = {}


def distributed_variant(kind: type[CheckpointingException]) -> type[DistributedCheckpointError]:
    """``DistributedCheckpointError`` that is also a ``kind`` (same name as ``kind``).

    ``distributed_variant(CommitConflictError)`` is raised on every rank when the
    coordinator lost a commit race, so ``except CommitConflictError`` (and
    ``except FileExistsError``) work on every rank.
    """
    if issubclass(kind, DistributedCheckpointError):
        return kind
    if kind not in _VARIANTS:  # one class per kind, so repeated failures compare equal
        namespace = {"__module__": kind.__module__, "__qualname__": kind.__qualname__}
        _VARIANTS[kind] = type(kind.__name__, (DistributedCheckpointError, kind), namespace)
    return _VARIANTS[kind]


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage request (with its retries) or a whole save or load passed its deadline
    (:class:`cloudckpt.config.RetryPolicy`); the message names the rank, the object's
    URI and the deadline that passed."""


class CollectiveError(DistributedCheckpointError):
    """A collective of cloudckpt could not complete because some rank is gone or silent;
    ``failures`` maps each such rank to why. Raised on every rank that is still running.
    The process group is unusable afterwards (its ranks disagree on what comes next):
    end the job, as after any collective timeout."""

    @property
    def ranks(self) -> list[int]:
        """The ranks named, sorted."""
        return sorted(self.failures)


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """Some ranks did not reach one of cloudckpt's collectives within
    ``collective_timeout_s`` (:class:`~cloudckpt.config.CheckpointConfig`); the message
    names them and the collective."""


class RankLostError(CollectiveError, ConnectionError):
    """A rank died or stopped responding (killed, crashed, frozen): its heartbeat
    stopped for ``heartbeat_timeout_s``, or its connection closed in a collective; the
    message names it."""


class UnsafePickleError(CheckpointingException, pickle.UnpicklingError):
    """A checkpoint's pickle (``common.pt``, a ShardedObject, DCP ``.metadata``) needs a
    global outside the allow-list, so it was not loaded: unpickling it could run code.

    The message names the object's URI (redacted), what it holds, the rank and the
    global; ``forbidden`` is that global's dotted name. To load the checkpoint anyway,
    when it is trusted: :func:`cloudckpt.add_safe_globals` for that type, or
    ``weights_only=False`` / ``CLOUDCKPT_TRUST_PICKLES=1`` (see :mod:`cloudckpt.safe_pickle`).
    """

    forbidden: str = ""

    def __init__(self, message: str, forbidden: str = "") -> None:
        super().__init__(message)
        self.forbidden = forbidden

    def __reduce__(self) -> tuple[type[UnsafePickleError], tuple[str, str]]:
        return (type(self), (str(self), self.forbidden))


# -- bad input ---------------------------------------------------------------------------


class KeyCollisionError(InvalidKeyError):
    """Keys of one save would be stored at the same object path, or one inside another's
    (``a`` and ``a/0`` in the zarr layout), or at the path of one of cloudckpt's own
    files (``manifest.json``, ``metadata.json``, ``common.pt``, the claim)."""


class InvalidURIError(CheckpointingException, ValueError):
    """A checkpoint URI is malformed or names an unknown protocol (``s3:/b/x``, ``://x``,
    ``foo://x``, ``s3://`` without a bucket): refused, never taken as a local path."""


class BucketNotFoundError(CheckpointNotFoundError):
    """The bucket a URI names does not exist (``bucket``: its name)."""

    def __init__(self, message: str, bucket: str = "") -> None:
        super().__init__(message)
        self.bucket = bucket

    def __reduce__(self) -> tuple[type[BucketNotFoundError], tuple[str, str]]:
        return (type(self), (str(self), self.bucket))


class CommonStateError(CheckpointingException, TypeError):
    """The common state cannot be serialized (a lambda, a lock, an open file...); raised
    before anything is written. ``key_path`` is the dotted path of the first value found
    that cannot be (``""`` when none alone is to blame)."""

    def __init__(self, message: str, key_path: str = "") -> None:
        super().__init__(message)
        self.key_path = key_path

    def __reduce__(self) -> tuple[type[CommonStateError], tuple[str, str]]:
        return (type(self), (str(self), self.key_path))


class UnknownAsyncStrategyError(CheckpointingException, TypeError):
    """``async_strategy`` is neither "nvrx" nor "mcore" (Megatron-Core 0.19 raises a
    ``TypeError`` there too)."""


class IntegrityCheckError(CorruptObjectError):
    """``load(..., verify_integrity=True)``: the checkpoint does not match its integrity
    record (cloudckpt's manifest, or Megatron-Core 0.19's ``integrity.json``; every
    problem listed), or it has neither to check against."""


class MalformedCheckpointError(IncompatibleCheckpointError, ValueError):
    """A checkpoint's own file cannot be parsed: ``metadata.json``, ``manifest.json``, a
    ``.zarray`` or the DCP ``.metadata`` (not JSON, not the expected document, truncated)."""


class TensorMismatchError(CheckpointingException, ValueError):
    """A stored tensor's dtype or global shape differs from the one a load requests
    (a shape difference is allowed with ``allow_shape_mismatch=True``)."""


class ServerStartError(CheckpointingException, RuntimeError):
    """A throwaway object-store server (``cloudckpt bench --server``, the tests') did not
    become ready; the message carries its log."""
