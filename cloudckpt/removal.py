"""Removing one checkpoint (``cloudckpt rm``, and ``cloudckpt gc`` for each it removes):
the commit protocol in reverse, and exclusive with a commit.

1. **Take ``manifest.json``'s slot** with a tombstone, create-only
   (:mod:`cloudckpt.tombstone`), before anything is deleted. A save that commits later
   finds it and raises :class:`~cloudckpt.errors.CheckpointRemovedError` on every
   rank, deleting what it wrote; a manifest found there instead means the save
   committed first: the removal of what it took for an uncommitted checkpoint stops
   with :class:`~cloudckpt.errors.CommitConflictError`, having deleted nothing. Removing
   a checkpoint already known to be committed replaces its manifest with the tombstone
   (the save's last check after ``metadata.json`` sees that).
2. ``metadata.json``, the open multipart uploads, every data object.
3. A second listing: what a losing save wrote while the removal ran goes too.
4. The claim, then the tombstone, last: until then no other save can start here, and
   the remains of a removal cut short are still listed as a checkpoint, which a second
   removal finishes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cloudckpt.commit import read_tombstone
from cloudckpt.commit_state import no_checkpoint_error
from cloudckpt.core import CONFIG_FNAME
from cloudckpt.errors import CommitConflictError, ObjectExistsError
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME
from cloudckpt.storage import CheckpointStorage, open_checkpoint
from cloudckpt.tombstone import Tombstone

__all__ = ["COMMIT_FILES", "Removed", "remove"]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]

COMMIT_FILES = (CONFIG_FNAME, MANIFEST_FNAME, CLAIM_FNAME)


@dataclass(frozen=True)
class Removed:
    """What :func:`remove` did: objects deleted, multipart uploads aborted."""

    deleted: int
    aborted: int


def remove(
    storage: CheckpointStorage,
    raw_uri: str,
    *,
    committed: bool | None = None,
    progress: ProgressFn | None = None,
) -> Removed:
    """Remove the checkpoint ``storage`` is opened on (``raw_uri``: its URI as given,
    for the empty local directories it leaves).

    Args:
        committed: whether the caller removes it knowing its commit was decided (its
            manifest or ``metadata.json`` existed when it chose to remove it); None:
            as this call's own first listing shows. A checkpoint taken for uncommitted
            whose save commits before the tombstone is written is kept.
        progress: called with 1 after each delete.

    Raises:
        CheckpointNotFoundError: no checkpoint at the URI (nothing, or objects but no
            commit file: a parent prefix?); nothing is deleted.
        CommitConflictError: the checkpoint was committed while this removal began
            (only when it was taken for uncommitted); nothing is deleted.
        StorageError: a delete or listing failed (naming the object).
    """
    listing = storage.list()
    if not any(name in listing for name in COMMIT_FILES):  # nothing removed
        raise no_checkpoint_error(storage, len(listing))
    if committed is None:
        committed = CONFIG_FNAME in listing or MANIFEST_FNAME in listing
    _take_slot(storage, Tombstone.new(), committed)
    counter = _Counter(progress)
    if CONFIG_FNAME in listing:  # first: no longer loadable
        storage.delete(CONFIG_FNAME)
        counter.add()
    aborted = _abort_uploads(storage)
    _delete_all(storage, [p for p in listing if p not in COMMIT_FILES], counter)
    # what a save that lost wrote meanwhile (its metadata.json included)
    late = [p for p in storage.list() if p not in (CLAIM_FNAME, MANIFEST_FNAME)]
    _delete_all(storage, late, counter)
    aborted += _abort_uploads(storage)
    if CLAIM_FNAME in listing:  # then no other save could start here until now
        storage.delete(CLAIM_FNAME)
        counter.add()
    storage.delete(MANIFEST_FNAME)  # the tombstone, last
    if MANIFEST_FNAME in listing:  # (in place of the manifest)
        counter.add()
    _remove_empty_prefix(storage, raw_uri)
    logger.info(
        "removed %s: %d objects deleted, %d multipart uploads aborted",
        storage.uri,
        counter.count,
        aborted,
    )
    return Removed(counter.count, aborted)


def _take_slot(storage: CheckpointStorage, tombstone: Tombstone, committed: bool) -> None:
    """Write ``tombstone`` into ``manifest.json``'s slot: create-only, or over the
    manifest of a checkpoint removed as committed (see the module docstring)."""
    body = tombstone.to_json()
    for _ in range(3):  # a slot emptied meanwhile (another removal finished) is retaken
        try:
            storage.write(MANIFEST_FNAME, body, exclusive=True)
            return
        except ObjectExistsError:
            pass
        if read_tombstone(storage) is not None:
            logger.info("%s: finishing an earlier removal", storage.uri)
            return
        if not storage.exists(MANIFEST_FNAME):
            continue
        if not committed:
            raise CommitConflictError(
                f"checkpoint {storage.uri!r} was committed while it was being removed "
                f"(its save created {MANIFEST_FNAME} first); nothing was deleted. It is kept: "
                "`cloudckpt rm` removes it as a committed checkpoint"
            )
        storage.write(MANIFEST_FNAME, body)
        return
    raise CommitConflictError(
        f"checkpoint {storage.uri!r}: {MANIFEST_FNAME} kept appearing and disappearing "
        "while it was being removed (another removal or save running?); nothing was deleted"
    )


def _abort_uploads(storage: CheckpointStorage) -> int:
    uploads = storage.open_uploads()
    for upload in uploads:
        storage.abort_upload(upload)
    return len(uploads)


def _delete_all(storage: CheckpointStorage, paths: list[str], counter: _Counter) -> None:
    def delete(path: str) -> None:
        storage.delete(path)
        counter.add()

    storage.map(delete, paths)


class _Counter:
    """Counts deletions and reports each to ``progress`` (thread-safe)."""

    def __init__(self, progress: ProgressFn | None) -> None:
        self.count = 0
        self._progress = progress
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1
            if self._progress is not None:
                self._progress(1)


def _remove_empty_prefix(storage: CheckpointStorage, raw_uri: str) -> None:
    """Remove the directories a local (or memory://) checkpoint leaves once its objects
    are gone; object stores have none. Only when no object remains below the prefix."""
    parent_uri, _, name = raw_uri.rstrip("/").rpartition("/")
    if not parent_uri or not name or parent_uri.endswith(":/"):
        return
    parent = open_checkpoint(parent_uri, fs=storage.fs, config=storage.config)
    if parent.full_path(name) != storage.root or parent.list(name):
        return
    parent.delete(name, recursive=True)
