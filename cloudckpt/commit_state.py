"""A checkpoint's commit objects as they are read: which of them exist
(:class:`CommitState`, :func:`read_commit_state`), a committed checkpoint's
``metadata.json`` and ``manifest.json`` read once (:func:`open_committed`), the errors
for a URI that holds no checkpoint or an uncommitted one, and the edit of a committed
checkpoint's manifest (:func:`amend_manifest`). Writing them is :mod:`cloudckpt.commit`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cloudckpt.core import CONFIG_FNAME, CheckpointingConfig
from cloudckpt.errors import CheckpointNotFoundError, UncommittedCheckpointError
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME, MANIFEST_VERSION, Manifest
from cloudckpt.storage import CheckpointStorage, WriteResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitState:
    """Which of the commit objects exist under a checkpoint URI."""

    metadata: bool
    manifest: bool
    claim: bool

    @property
    def foreign(self) -> bool:
        """Written by Megatron-Core or PyTorch: ``metadata.json`` but no cloudckpt objects."""
        return self.metadata and not self.manifest and not self.claim

    @property
    def absent(self) -> bool:
        """No commit object at all: whatever is stored there is no checkpoint."""
        return not (self.metadata or self.manifest or self.claim)

    @property
    def committed(self) -> bool:
        """``metadata.json`` and, for a cloudckpt checkpoint, ``manifest.json``."""
        return self.metadata and (self.manifest or not self.claim)

    def missing(self) -> list[str]:
        """The commit objects whose absence makes the checkpoint uncommitted."""
        absent = [] if self.metadata else [CONFIG_FNAME]
        if self.claim and not self.manifest:
            absent.insert(0, MANIFEST_FNAME)
        return absent

    @classmethod
    def from_names(cls, names: Iterable[str]) -> CommitState:
        """The state that a listing of the checkpoint's objects shows (no request)."""
        present = set(names)
        return cls(CONFIG_FNAME in present, MANIFEST_FNAME in present, CLAIM_FNAME in present)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint's commit records, read once (see :func:`open_committed`).

    Attributes:
        uri: the checkpoint (redacted).
        backends: what ``metadata.json`` records.
        manifest: the manifest; None for a foreign checkpoint (Megatron-Core, PyTorch).
    """

    uri: str
    backends: CheckpointingConfig
    manifest: Manifest | None

    def expected_objects(self) -> dict[str, WriteResult] | None:
        """Path -> (size, CRC-32C) of every object the manifest lists (None: foreign)."""
        if self.manifest is None:
            return None
        return {e.path: e for e in self.manifest.objects}


def read_commit_state(storage: CheckpointStorage) -> CommitState:
    """Look up the commit objects (three small requests, no data read)."""
    return CommitState(
        metadata=storage.exists(CONFIG_FNAME),
        manifest=storage.exists(MANIFEST_FNAME),
        claim=storage.exists(CLAIM_FNAME),
    )


def open_committed(storage: CheckpointStorage) -> CommittedCheckpoint:
    """Read a committed checkpoint's ``metadata.json`` and ``manifest.json``, once.

    Two reads for a cloudckpt checkpoint, three for a foreign one (the claim's absence
    is what tells it from one whose manifest was lost).

    Raises:
        CheckpointNotFoundError: no checkpoint at the URI (no commit object there).
        UncommittedCheckpointError: a claim or manifest without ``metadata.json``, or a
            claim and ``metadata.json`` without the manifest; names what is missing.
        CheckpointingException: ``metadata.json`` or ``manifest.json`` is malformed.
    """
    raw_config = _read_if_exists(storage, CONFIG_FNAME)
    raw_manifest = _read_if_exists(storage, MANIFEST_FNAME)
    state = CommitState(raw_config is not None, raw_manifest is not None, claim=True)
    if raw_manifest is None:
        state = dataclasses.replace(state, claim=storage.exists(CLAIM_FNAME))
    if raw_config is None or not state.committed:
        raise _not_committed_error(storage, state)
    manifest = None
    if raw_manifest is not None:
        manifest = Manifest.from_json(raw_manifest, storage.child_uri(MANIFEST_FNAME))
    backends = CheckpointingConfig.from_json(raw_config, storage.child_uri(CONFIG_FNAME))
    return CommittedCheckpoint(storage.uri, backends, manifest)


def _read_if_exists(storage: CheckpointStorage, relpath: str) -> bytes | None:
    try:
        return storage.read(relpath)
    except CheckpointNotFoundError:
        return None


def no_checkpoint_error(storage: CheckpointStorage, objects: int) -> CheckpointNotFoundError:
    """Megatron-Core's ``Checkpoint directory URI does not exist`` (nothing there) or
    ``URI is not a distributed checkpoint`` (``objects`` objects but no commit record,
    or an empty directory on a local disk), with cloudckpt's ``no checkpoint at URI:
    ...`` appended; the URI redacted."""
    uri = storage.uri
    if not objects and storage.root_is_directory():
        return CheckpointNotFoundError(
            f"{uri} is not a distributed checkpoint "
            f"(no checkpoint at {uri!r}: the directory is empty)"
        )
    if not objects:
        return CheckpointNotFoundError(
            f"Checkpoint directory {uri} does not exist "
            f"(no checkpoint at {uri!r}: nothing is stored there)"
        )
    return CheckpointNotFoundError(
        f"{uri} is not a distributed checkpoint (no checkpoint at {uri!r}: it holds {objects} "
        f"object{'s' if objects != 1 else ''} but no {CONFIG_FNAME}, {MANIFEST_FNAME} or "
        f"{CLAIM_FNAME}: a parent prefix, or another kind of data?)"
    )


def _not_committed_error(
    storage: CheckpointStorage, state: CommitState
) -> CheckpointNotFoundError | UncommittedCheckpointError:
    """Why a checkpoint in ``state`` cannot be loaded: none there, or not committed
    (Megatron-Core's ``URI is not a distributed checkpoint``, with the details)."""
    if state.absent:
        return no_checkpoint_error(storage, len(storage.list()))
    return UncommittedCheckpointError(
        f"{storage.uri} is not a distributed checkpoint: checkpoint {storage.uri!r} is not "
        f"committed: {' and '.join(state.missing())} "
        f"{'is' if len(state.missing()) == 1 else 'are'} missing (the save failed, is still "
        "running, or the file was deleted); `cloudckpt verify` shows what is there"
    )


def read_manifest(storage: CheckpointStorage) -> Manifest | None:
    """The checkpoint's manifest, or None when it has none."""
    if not storage.exists(MANIFEST_FNAME):
        return None
    return Manifest.from_json(storage.read(MANIFEST_FNAME), storage.child_uri(MANIFEST_FNAME))


def amend_manifest(
    storage: CheckpointStorage,
    *,
    rewritten: Sequence[WriteResult] = (),
    deleted: Sequence[str] = (),
    removed_tensors: Sequence[str] = (),
) -> None:
    """Record an edit of a committed checkpoint (``remove_sharded_tensors``) in its
    manifest: objects rewritten or deleted, tensors removed. The manifest is replaced in
    place; this is the one write of ``manifest.json`` that is not create-only. A
    checkpoint without a manifest (foreign) is left as it is.
    """
    manifest = read_manifest(storage)
    if manifest is None:
        return
    new = {r.path: r for r in rewritten}
    gone = set(deleted)
    objects = tuple(
        new.pop(e.path, e)
        for e in manifest.objects
        if e.path not in gone and not any(e.path.startswith(d + "/") for d in gone)
    ) + tuple(new.values())
    tensors = tuple(t for t in manifest.tensors if t.key not in set(removed_tensors))
    # in the current version: rewritten objects come with block CRCs (a version-1
    # manifest's other entries have none, and are read as before)
    amended = dataclasses.replace(
        manifest, objects=objects, tensors=tensors, version=MANIFEST_VERSION
    )
    storage.write(MANIFEST_FNAME, amended.to_json())
    logger.info("amended %s: %d objects", storage.child_uri(MANIFEST_FNAME), len(objects))
