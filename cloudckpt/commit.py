"""The commit protocol: object stores have no atomic rename, so a checkpoint is
committed by two small create-once writes after all data is stored.

1. :func:`claim` — before any data, the coordinator creates ``.cloudckpt-claim.json``
   create-only: a second job writing the same URI fails here, before it overwrites
   anything.
2. Every rank uploads its objects; each write returns (path, size, crc32c).
3. :func:`commit` gathers the write results on the coordinator over torch.distributed
   (nothing is read back from the store), which creates ``manifest.json`` create-only,
   then writes ``metadata.json`` (Megatron-Core's marker, exactly its keys) last. Each
   rank sends one :class:`~cloudckpt.manifest.CommitRecord` (its results in columns);
   ranks with equal tensor entries (replicas) send them once, a piece each, told
   apart by an all-gather of their 16-byte digests, so the coordinator's merge grows
   with the objects and the distinct tensors, not with ranks x tensors.

:func:`read_commit_state` tells committed, uncommitted and foreign (Megatron-Core or
PyTorch-written: ``metadata.json`` without a claim or manifest) checkpoints apart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cloudckpt.core import CONFIG_FNAME, CheckpointingConfig, save_config
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CommitConflictError,
    ObjectExistsError,
    UncommittedCheckpointError,
)
from cloudckpt.huge_pages import without_huge_page_advice
from cloudckpt.manifest import (
    CLAIM_FNAME,
    INTEGRITY_FNAME,
    MANIFEST_FNAME,
    MANIFEST_VERSION,
    CommitRecord,
    Manifest,
    TensorEntry,
    merge_records,
)
from cloudckpt.storage import CheckpointStorage, WriteResult, crc32c
from cloudckpt.tombstone import PEEK_BYTES, Tombstone, is_tombstone

logger = logging.getLogger(__name__)

COORDINATOR = 0


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


def no_checkpoint_error(uri: str, objects: int) -> CheckpointNotFoundError:
    """Megatron-Core's ``Checkpoint directory URI does not exist`` (nothing there) or
    ``URI is not a distributed checkpoint`` (``objects`` objects, no commit record), with
    cloudckpt's ``no checkpoint at URI: ...`` appended; ``uri`` redacted."""
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
        return no_checkpoint_error(storage.uri, len(storage.list()))
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


# -- removal: the protocol in reverse ------------------------------------------------------


def uncommit(storage: CheckpointStorage, listing: Iterable[str]) -> list[str]:
    """Delete ``metadata.json``, then ``manifest.json`` (those of ``listing`` present):
    the checkpoint stops loading before any of its data goes. Returns what was deleted."""
    present = set(listing)
    deleted = [name for name in (CONFIG_FNAME, MANIFEST_FNAME) if name in present]
    for name in deleted:
        storage.delete(name)
    return deleted


def release_claim(storage: CheckpointStorage, listing: Iterable[str]) -> list[str]:
    """Delete the claim, last of all: until then no other job can write this URI."""
    if CLAIM_FNAME not in set(listing):
        return []
    storage.delete(CLAIM_FNAME)
    return [CLAIM_FNAME]


# -- writing -----------------------------------------------------------------------------


def require_empty(storage: CheckpointStorage) -> None:
    """Refuse a save into a location that holds anything (the coordinator checks).

    Raises:
        CommitConflictError: it holds a committed checkpoint, or another save's claim.
        CheckpointingException: it holds other objects.
    """
    if storage.is_empty():
        return
    where = f"checkpoint destination {storage.uri!r} is not empty"
    if read_commit_state(storage).committed:
        raise CommitConflictError(
            f"{where}: it holds a committed checkpoint; refusing to overwrite (choose a new "
            "URI or remove it with `cloudckpt rm`)"
        )
    if storage.exists(CLAIM_FNAME):
        raise CommitConflictError(
            f"{where}: another save claimed it ({describe_claim(storage)}); it is still "
            "running, or it failed and left an uncommitted checkpoint (`cloudckpt gc` "
            "removes those)"
        )
    raise CheckpointingException(
        f"{where}; refusing to overwrite (choose a new URI or remove what is there)"
    )


def claim(storage: CheckpointStorage) -> WriteResult | None:
    """Create the claim object (coordinator only; collective). Returns its write result
    on the coordinator, None elsewhere.

    Raises:
        CommitConflictError: on every rank, when another job claimed the URI first.
    """
    from cloudckpt import dist  # noqa: PLC0415 - torch only for saves, not for ls/verify/gc

    result = None
    with dist.agree(f"claiming checkpoint {storage.uri!r}"):
        if dist.get_rank() == COORDINATOR:
            result = write_claim(storage)
    return result


def write_claim(storage: CheckpointStorage) -> WriteResult:
    """Create the claim object, create-only (the coordinator's part of :func:`claim`,
    for a caller that lets every rank learn of its failure in its own collective).

    Raises:
        CommitConflictError: another job claimed the URI first.
    """
    _warn_if_not_exclusive(storage)
    try:
        return storage.write(CLAIM_FNAME, _claim_document(), exclusive=True)
    except ObjectExistsError as exc:
        raise CommitConflictError(
            f"checkpoint {storage.uri!r} is already being written or was written by "
            f"another job ({CLAIM_FNAME} exists: {describe_claim(storage)}); choose "
            "a new URI"
        ) from exc


def commit(
    storage: CheckpointStorage,
    results: Sequence[WriteResult],
    backends: CheckpointingConfig,
    tensors: Sequence[TensorEntry] = (),
    common_keys: Sequence[str] = (),
    *,
    claimed: WriteResult | None = None,
    digests: Sequence[bytes] | None = None,
) -> Manifest | None:
    """Gather every rank's write results on the coordinator (the only rank that needs
    them), which writes ``manifest.json`` (create-only) and then ``metadata.json``.
    Collective: an all-gather of each rank's 16-byte tensor digest (ranks with equal
    tensor entries send them once, a piece each; skipped when the caller gathered
    ``digests`` in a collective of its own), then a gather of each rank's
    :class:`~cloudckpt.manifest.CommitRecord` on the coordinator.

    Args:
        results: this rank's write results.
        backends: what ``metadata.json`` records.
        tensors: this rank's tensors (merged over ranks by key).
        common_keys: the common state's key paths (from the rank that saved it).
        claimed: the coordinator's claim; the commit is refused when the claim was
            removed or replaced meanwhile (``cloudckpt gc``, another job).
        digests: every rank's :func:`~cloudckpt.manifest.tensors_digest` of its
            ``tensors``, by rank, when the caller gathered them.

    Returns:
        The manifest on the coordinator, None on the other ranks.

    Raises:
        CommitConflictError: on every rank, when ``manifest.json`` already exists.
    """
    from cloudckpt import dist  # noqa: PLC0415 - torch only for saves, not for ls/verify/gc

    manifest = None
    with dist.paused_gc():  # every rank's records, unpickled and merged by the coordinator
        record = CommitRecord.of(results, tensors, common_keys)
        # ranks with equal tensor entries (replicas) send them once, a piece each
        if digests is None:
            digests = dist.all_gather_object(
                record.digest, what=f"committing checkpoint {storage.uri!r}: tensor digests"
            )
        record = record.piece(*tensor_piece(digests, dist.get_rank()))
        # only the coordinator merges them: the other ranks send, and receive nothing
        gathered = dist.gather_object(record, COORDINATOR)
        with dist.agree(f"committing checkpoint {storage.uri!r}"):
            if gathered is not None:  # the coordinator
                manifest = commit_gathered(storage, gathered, backends, claimed)
        del gathered  # before the collector runs again
    return manifest


def commit_gathered(
    storage: CheckpointStorage,
    gathered: Sequence[CommitRecord],
    backends: CheckpointingConfig,
    claimed: WriteResult | None,
) -> Manifest:
    """The coordinator's part of a commit: merge every rank's commit record (by rank),
    create ``manifest.json`` (create-only: the one write that decides against a removal,
    see :mod:`cloudckpt.tombstone`), check that its claim is still the one it wrote,
    write ``metadata.json``, and check that no removal replaced the manifest meanwhile.
    Then abort what this save left open (an upload whose creation was answered but the
    answer lost), since nothing else can be writing under a committed prefix.

    Raises:
        CheckpointRemovedError: a removal (``cloudckpt gc``, ``rm``) took the checkpoint
            first; the objects this save wrote are deleted before it is raised.
        CommitConflictError: another job committed the checkpoint or replaced the claim.
    """
    manifest = build_manifest(gathered, backends)
    try:
        _write_commit(storage, manifest, backends, claimed)
    except CheckpointRemovedError:
        withdraw(storage, manifest)
        raise
    abort_open_uploads(storage, "left open by its save")
    return manifest


def tensor_piece(digests: Sequence[bytes], rank: int) -> tuple[int, int]:
    """Which piece of its tensor text ``rank`` sends: ``(index, count)``, its place among
    the ranks with its digest and their number (``digests``: every rank's, by rank)."""
    mine = digests[rank]
    return list(digests[:rank]).count(mine), list(digests).count(mine)


@without_huge_page_advice()
def build_manifest(gathered: Sequence[CommitRecord], backends: CheckpointingConfig) -> Manifest:
    """The coordinator's merge of every rank's commit record (indexed by rank) into the
    manifest (pure).

    Raises:
        ManifestError: two ranks report different results for one object path.
    """
    objects, tensors, common_keys = merge_records(gathered)
    return Manifest(
        objects=tuple(objects),
        tensors=tuple(tensors),
        common_keys=tuple(common_keys),
        world_size=len(gathered),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        backends=asdict(backends),
    )


def _claim_state(storage: CheckpointStorage, claimed: WriteResult) -> str:
    """``"ours"``, ``"gone"`` (removed: a removal deletes it before its tombstone) or
    ``"replaced"`` (another job's claim)."""
    try:
        current = storage.read(CLAIM_FNAME)
    except CheckpointNotFoundError:
        return "gone"
    if crc32c(current) == claimed.crc32c and len(current) == claimed.size:
        return "ours"
    return "replaced"


def _write_commit(
    storage: CheckpointStorage,
    manifest: Manifest,
    backends: CheckpointingConfig,
    claimed: WriteResult | None,
) -> None:
    """Create ``manifest.json``, check the claim, write ``metadata.json``, check the
    manifest is still there (a removal of a committed checkpoint replaces it)."""
    uri = storage.uri
    try:
        storage.write(MANIFEST_FNAME, manifest.to_json(), exclusive=True)
    except ObjectExistsError as exc:
        removal = read_tombstone(storage)
        if removal is not None:
            raise CheckpointRemovedError(
                f"checkpoint {uri!r} was removed while this save wrote it (a removal took "
                f"{MANIFEST_FNAME} first: {removal.describe()}); not committed, and this "
                "save's objects are deleted"
            ) from exc
        raise CommitConflictError(
            f"checkpoint {uri!r} was committed by another job ({MANIFEST_FNAME} "
            "exists); this job's commit is refused"
        ) from exc
    claim_state = "ours" if claimed is None else _claim_state(storage, claimed)
    if claim_state != "ours":
        if read_tombstone(storage) is None:  # still this save's manifest: take it back
            storage.delete(MANIFEST_FNAME)
        if claim_state == "gone":
            raise CheckpointRemovedError(
                f"checkpoint {uri!r}: this save's {CLAIM_FNAME} was removed while it wrote "
                "(by `cloudckpt gc` or `cloudckpt rm`); not committed, and this save's "
                "objects are deleted"
            )
        raise CommitConflictError(
            f"checkpoint {uri!r}: this save's {CLAIM_FNAME} was replaced while it wrote "
            f"(another job claimed the URI: {describe_claim(storage)}); not committing"
        )
    save_config(backends, storage)
    if not _holds_manifest(storage):  # a removal took the committed checkpoint meanwhile
        storage.delete(CONFIG_FNAME)
        raise CheckpointRemovedError(
            f"checkpoint {uri!r} was removed while it was being committed (its "
            f"{MANIFEST_FNAME} was replaced by a removal's); not committed"
        )
    logger.info(
        "committed %s: %d objects, %.1f MB from %d ranks",
        uri,
        len(manifest.objects),
        manifest.total_size / 1e6,
        manifest.world_size,
    )


def read_tombstone(storage: CheckpointStorage) -> Tombstone | None:
    """The removal's tombstone in ``manifest.json``'s slot, or None (a manifest there,
    or nothing). Reads the object's first bytes only."""
    head = _manifest_head(storage)
    return (
        Tombstone.from_json(storage.read(MANIFEST_FNAME)) if head and is_tombstone(head) else None
    )


def _holds_manifest(storage: CheckpointStorage) -> bool:
    """Whether ``manifest.json`` exists and is a manifest, not a tombstone."""
    head = _manifest_head(storage)
    return head is not None and not is_tombstone(head)


def _manifest_head(storage: CheckpointStorage) -> bytes | None:
    try:
        return storage.read(MANIFEST_FNAME, 0, PEEK_BYTES)
    except CheckpointNotFoundError:
        return None


def withdraw(storage: CheckpointStorage, manifest: Manifest) -> None:
    """Delete what a save that lost to a removal wrote (the objects of its records,
    written before or while the removal ran; the claim is the removal's to delete) and
    abort the uploads open under the checkpoint. Failures are logged: the removal, or
    the next ``cloudckpt gc``, finishes the job."""
    paths = [e.path for e in manifest.objects if e.path != CLAIM_FNAME]
    try:
        storage.map(storage.delete, paths)
        abort_open_uploads(storage, "of a save that lost to a removal")
    except CheckpointingException as exc:
        logger.warning("%s: could not delete all of this save's objects: %s", storage.uri, exc)
        return
    logger.warning(
        "%s was removed while this save wrote it: deleted its %d objects", storage.uri, len(paths)
    )


def abort_open_uploads(storage: CheckpointStorage, why: str) -> int:
    """Abort every multipart upload open under the checkpoint (S3; other stores have
    none); failures are logged, not raised. Returns how many were aborted."""
    try:
        uploads = storage.open_uploads()
        for upload in uploads:
            storage.abort_upload(upload)
    except CheckpointingException as exc:
        logger.warning(
            "%s: could not abort the multipart uploads open under it (`cloudckpt gc` "
            "aborts them): %s",
            storage.uri,
            exc,
        )
        return 0
    if uploads:
        logger.info("%s: aborted %d multipart uploads %s", storage.uri, len(uploads), why)
    return len(uploads)


def _claim_document() -> bytes:
    from cloudckpt import dist  # noqa: PLC0415 - torch only for saves, not for ls/verify/gc

    doc = {
        "job": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "world_size": dist.get_world_size(),
        "claimed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return (json.dumps(doc, sort_keys=True) + "\n").encode()


def describe_claim(storage: CheckpointStorage) -> str:
    """Who claimed the checkpoint, for messages."""
    try:
        doc: Mapping[str, Any] = json.loads(storage.read(CLAIM_FNAME))
        return f"host {doc.get('host')}, pid {doc.get('pid')}, at {doc.get('claimed')}"
    except Exception:  # noqa: BLE001 - a description for a message only
        return "claim unreadable"


def _warn_if_not_exclusive(storage: CheckpointStorage) -> None:
    enforced = storage.enforces_exclusive_writes
    if enforced:
        return
    what = "ignores create-only writes" if enforced is False else "may not enforce create-only"
    logger.warning(
        "the store of %s %s (e.g. the GCS emulator and ifGenerationMatch=0): two jobs "
        "writing this URI at once would not be detected",
        storage.uri,
        what,
    )


def integrity_sources(storage: CheckpointStorage) -> list[tuple[str, int]]:
    """``(path, size)`` of every object of a committed checkpoint that Megatron-Core
    0.19's ``integrity.json`` lists (all but itself), largest first: what
    :func:`sha256_digests` reads, a share per rank. Coordinator only."""
    listing = storage.list_sizes()
    items = [(path, size) for path, size in listing.items() if path != INTEGRITY_FNAME]
    return sorted(items, key=lambda item: (-item[1], item[0]))


def sha256_digests(storage: CheckpointStorage, items: Sequence[tuple[str, int]]) -> dict[str, str]:
    """Hex SHA-256 of each ``(path, size)`` object, read back ``max_in_flight`` at once."""
    digests = storage.map(lambda item: storage.sha256(*item), list(items))
    return {path: digest for (path, _), digest in zip(items, digests, strict=True)}


def write_integrity_record(storage: CheckpointStorage, digests: Mapping[str, str]) -> WriteResult:
    """Megatron-Core 0.19's ``integrity.json``, ``{"algorithm": "sha256", "files": ...}``,
    written create-only: what ``save(..., verify_integrity=True)`` adds after the commit,
    as Megatron-Core does after ``metadata.json``, so that its ``load(...,
    verify_integrity=True)`` can check cloudckpt's checkpoints too. Coordinator only.

    Raises:
        ObjectExistsError: the checkpoint has an integrity record already.
    """
    payload = {"algorithm": "sha256", "files": dict(sorted(digests.items()))}
    written = storage.write(INTEGRITY_FNAME, json.dumps(payload, indent=2).encode(), exclusive=True)
    logger.info("wrote %s: SHA-256 of %d objects at %s", INTEGRITY_FNAME, len(digests), storage.uri)
    return written
