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

Reading the commit objects back (:func:`~cloudckpt.commit_state.read_commit_state`
tells committed, uncommitted and foreign - Megatron-Core or PyTorch-written:
``metadata.json`` without a claim or manifest - checkpoints apart) is
:mod:`cloudckpt.commit_state`; Megatron-Core 0.19's ``integrity.json`` is
:mod:`cloudckpt.integrity_record`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from cloudckpt.commit_state import read_commit_state
from cloudckpt.core import CONFIG_FNAME, CheckpointingConfig, save_config
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CommitConflictError,
    ObjectExistsError,
)
from cloudckpt.manifest import (
    CLAIM_FNAME,
    MANIFEST_FNAME,
    CommitRecord,
    Manifest,
    TensorEntry,
    merge_records,
)
from cloudckpt.storage import CheckpointStorage, WriteResult, crc32c
from cloudckpt.tombstone import PEEK_BYTES, Tombstone, is_tombstone

__all__ = [
    "COORDINATOR",
    "abort_open_uploads",
    "build_manifest",
    "claim",
    "commit",
    "commit_gathered",
    "describe_claim",
    "read_tombstone",
    "release_claim",
    "require_empty",
    "tensor_piece",
    "uncommit",
    "withdraw",
    "write_claim",
]

logger = logging.getLogger(__name__)

COORDINATOR = 0


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
        _take_back_manifest(storage)
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
    try:
        save_config(backends, storage)
    except CheckpointingException:  # not committed: no manifest without its metadata.json
        _take_back_manifest(storage)
        raise
    if not _holds_manifest(storage):  # a removal took the committed checkpoint meanwhile
        storage.delete(CONFIG_FNAME)
        raise CheckpointRemovedError(
            f"checkpoint {uri!r} was removed while it was being committed (its "
            f"{MANIFEST_FNAME} was replaced by a removal's); not committed"
        )
    logger.debug(  # DEBUG, as Megatron-Core's save: its training loop logs its own lines
        "committed %s: %d objects, %.1f MB from %d ranks",
        uri,
        len(manifest.objects),
        manifest.total_size / 1e6,
        manifest.world_size,
    )


def _take_back_manifest(storage: CheckpointStorage) -> None:
    """Delete ``manifest.json`` while it is still this save's (not a removal's tombstone):
    the commit did not complete, and the checkpoint is left clearly uncommitted. A
    failure to delete it is logged; the caller raises what stopped the commit."""
    try:
        if read_tombstone(storage) is None:
            storage.delete(MANIFEST_FNAME)
    except CheckpointingException as exc:
        logger.warning(
            "%s: its commit failed, and its %s could not be taken back: %s",
            storage.uri,
            MANIFEST_FNAME,
            exc,
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
