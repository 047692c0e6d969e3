"""The checkpoints of a training run: list them, find the latest, remove old ones.

A run writes its checkpoints side by side under one parent prefix (``.../run/iter_0001000``,
``.../run/iter_0002000``). A child prefix is a checkpoint when it holds ``metadata.json``,
``manifest.json`` or cloudckpt's claim; it is *committed* when the commit protocol finished
(:mod:`cloudckpt.commit`), so :func:`latest` advances only once a save has committed.

**Age of an uncommitted checkpoint.** A save in progress is uncommitted too, so
:func:`collect_garbage` removes an uncommitted checkpoint only when its newest sign of
activity is older than ``grace_s``. The storage listing has no modification times, so the
signs are the claim's time (the start of the save), the manifest's time and the start of
any multipart upload open under it; with none of them it counts as old. ``grace_s`` must
therefore exceed the longest save of the run.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from cloudckpt.commit_state import read_commit_state
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CheckpointNotFoundError, CommitConflictError
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME, Manifest, ManifestError
from cloudckpt.redact import redact_uri
from cloudckpt.removal import remove
from cloudckpt.storage import CheckpointStorage, OpenUpload, open_checkpoint
from cloudckpt.tombstone import Tombstone

__all__ = [
    "CheckpointInfo",
    "GcAction",
    "GcReport",
    "collect_garbage",
    "latest",
    "list_checkpoints",
    "remove_checkpoint",
]

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]

REASON_UNCOMMITTED = "uncommitted"
REASON_STALE_UPLOAD = "stale multipart upload"
REASON_COMMITTED_UPLOAD = "multipart upload under a committed checkpoint"
REASON_COMMITTED_MEANWHILE = "committed while gc ran"
_TRAILING_INT = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a parent prefix.

    Attributes:
        uri: ``parent_uri.rstrip("/") + "/" + name``.
        name: the child prefix's name, e.g. ``"iter_0001000"``.
        iteration: the name's trailing integer (``iter_0001000`` -> 1000), else None.
        committed: the commit protocol finished (see :class:`~cloudckpt.commit_state.CommitState`).
        foreign: written by Megatron-Core or PyTorch (``metadata.json`` only).
        size: bytes of the objects the manifest lists (None without a manifest).
        created: the manifest's commit time, ISO 8601 UTC ("" without one).
        world_size: ranks of the job that wrote it, per the manifest (None without one).
        removing: a removal (``gc``, ``rm``) took it and has not finished (a tombstone
            holds ``manifest.json``'s slot; see :mod:`cloudckpt.removal`).
    """

    uri: str
    name: str
    iteration: int | None
    committed: bool
    foreign: bool
    size: int | None
    created: str
    world_size: int | None
    removing: bool = False


def _child_uri(parent_uri: str, name: str) -> str:
    return parent_uri.rstrip("/") + "/" + name


def _child(parent: CheckpointStorage, parent_uri: str, name: str) -> CheckpointStorage:
    """The storage of a child prefix, on the parent's filesystem instance (one client)."""
    return open_checkpoint(_child_uri(parent_uri, name), fs=parent.fs, config=parent.config)


def _iteration(name: str) -> int | None:
    match = _TRAILING_INT.search(name)
    return int(match.group(1)) if match else None


def _read_info(parent: CheckpointStorage, parent_uri: str, name: str) -> CheckpointInfo | None:
    child = _child(parent, parent_uri, name)
    state = read_commit_state(child)
    if not (state.metadata or state.manifest or state.claim):
        return None
    manifest, removing = None, False
    if state.manifest:
        try:
            raw = child.read(MANIFEST_FNAME)
            removing = Tombstone.from_json(raw) is not None
            if not removing:
                manifest = Manifest.from_json(raw, child.child_uri(MANIFEST_FNAME))
        except (ManifestError, CheckpointNotFoundError) as exc:
            logger.warning("%s: %s", child.uri, exc)
    return CheckpointInfo(
        uri=_child_uri(parent_uri, name),
        name=name,
        iteration=_iteration(name),
        committed=state.committed,
        foreign=state.foreign,
        size=manifest.total_size if manifest is not None else None,
        created=manifest.created if manifest is not None else "",
        world_size=manifest.world_size if manifest is not None else None,
        removing=removing,
    )


def _list(parent: CheckpointStorage, parent_uri: str) -> list[CheckpointInfo]:
    names = parent.list_children()
    found = parent.map(lambda name: _read_info(parent, parent_uri, name), names)
    infos = [info for info in found if info is not None]
    return sorted(infos, key=lambda i: (i.iteration is None, i.iteration or 0, i.name))


def list_checkpoints(
    parent_uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> list[CheckpointInfo]:
    """Every checkpoint directly under ``parent_uri``, committed or not.

    A child prefix counts when it holds ``metadata.json``, ``manifest.json`` or
    ``.cloudckpt-claim.json``; other prefixes are skipped. Sorted by iteration (names
    without one last), then name.
    """
    parent = open_checkpoint(parent_uri, storage_options=storage_options, config=config)
    return _list(parent, parent_uri)


def _newest_first(infos: Sequence[CheckpointInfo]) -> list[CheckpointInfo]:
    """Committed checkpoints, newest first: highest iteration, then newest, then name."""
    committed = [i for i in infos if i.committed]
    return sorted(
        committed,
        key=lambda i: (i.iteration is not None, i.iteration or 0, i.created, i.name),
        reverse=True,
    )


def latest(
    parent_uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    collective: bool = False,
) -> str | None:
    """URI of the committed checkpoint with the highest iteration (then the newest commit
    time, then the greatest name) under ``parent_uri``, or None. Uncommitted checkpoints
    (a save running or failed) never count: the answer advances only after a commit.

    With ``collective=True`` (call it on every rank of the default process group), rank
    0 lists the prefix once and every rank gets its answer, or its error; so every rank
    resumes from the same checkpoint.
    """
    if collective:
        from cloudckpt import dist  # noqa: PLC0415 - torch only when called collectively

        return dist.run_on_coordinator(
            lambda: latest(parent_uri, storage_options=storage_options, config=config),
            f"finding the latest checkpoint under {redact_uri(parent_uri)!r}",
        )
    infos = list_checkpoints(parent_uri, storage_options=storage_options, config=config)
    ordered = _newest_first(infos)
    return ordered[0].uri if ordered else None


# -- removal -----------------------------------------------------------------------------


def remove_checkpoint(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    progress: ProgressFn | None = None,
) -> int:
    """Delete a checkpoint and abort the multipart uploads open under it; -> objects deleted.

    The removal first takes ``manifest.json``'s slot with a create-only tombstone, so a
    save still writing the checkpoint can no longer commit it (it raises
    :class:`~cloudckpt.errors.CheckpointRemovedError` and deletes what it wrote); then
    ``metadata.json`` goes, so a removal cut short leaves a visibly uncommitted checkpoint
    (``load`` refuses it), then the data, what a losing save wrote meanwhile, the claim and
    the tombstone last, so the remains of a removal cut short are still listed as a
    checkpoint and a second call (or :func:`collect_garbage`) finishes the job
    (:mod:`cloudckpt.removal`). ``progress(1)`` follows each delete.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``uri``: nothing is stored there, or
            objects but no ``metadata.json``, ``manifest.json`` or claim (a parent
            prefix?); nothing is deleted.
        CommitConflictError: it was uncommitted when the removal began, and its save
            committed before the tombstone was written: it is kept, nothing is deleted.
        StorageError: a delete failed (naming the object).
    """
    storage = open_checkpoint(uri, storage_options=storage_options, config=config)
    return remove(storage, uri, progress=progress).deleted


# -- garbage collection -------------------------------------------------------------------


@dataclass(frozen=True)
class GcAction:
    """One thing :func:`collect_garbage` did (or, in a dry run, would do): ``uri`` is the
    checkpoint removed or the object whose upload was aborted; ``reason`` is
    ``"uncommitted"``, ``"older than the newest N"`` (N: ``keep_last``) or
    ``"stale multipart upload"``; ``detail`` gives iteration, size, age or upload id."""

    uri: str
    reason: str
    detail: str


@dataclass(frozen=True)
class GcReport:
    """What :func:`collect_garbage` kept (checkpoint URIs) and did (or, with ``dry_run``,
    would do). ``kept_why`` says why each kept checkpoint (and each open multipart
    upload left alone) was kept: ``reason`` is ``"committed, among the newest N"``,
    ``"uncommitted, younger than the grace period G"`` or ``"multipart upload younger
    than the grace period G"``; ``detail`` gives its age and how to remove it now."""

    parent_uri: str
    dry_run: bool
    kept: tuple[str, ...]
    actions: tuple[GcAction, ...]
    kept_why: tuple[GcAction, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (actions as dicts)."""
        doc = asdict(self)
        return {
            **doc,
            "kept": list(self.kept),
            "actions": list(doc["actions"]),
            "kept_why": list(doc["kept_why"]),
        }


@dataclass(frozen=True)
class _Plan:
    kept: tuple[str, ...]
    removals: tuple[tuple[GcAction, CheckpointInfo], ...]
    aborts: tuple[tuple[GcAction, OpenUpload], ...]
    kept_why: tuple[GcAction, ...] = ()


def collect_garbage(
    parent_uri: str,
    keep_last: int,
    *,
    grace_s: float = 3600.0,
    dry_run: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    progress: ProgressFn | None = None,
) -> GcReport:
    """Keep the newest ``keep_last`` committed checkpoints under ``parent_uri``; remove
    the older committed ones and the uncommitted ones idle for ``grace_s`` seconds;
    abort multipart uploads under ``parent_uri`` started more than ``grace_s`` ago.

    Args:
        keep_last: committed checkpoints to keep (>= 1), newest by :func:`latest`'s order.
        grace_s: an uncommitted checkpoint (its save may still run: see the module
            docstring) or an open upload younger than this is left alone; so are the
            uploads under a young uncommitted checkpoint.
        dry_run: only report what would be done.
        progress: called with 1 for each object deleted.

    Raises:
        ValueError: ``keep_last`` < 1.
        StorageError: a listing, delete or abort failed.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    parent = open_checkpoint(parent_uri, storage_options=storage_options, config=config)
    plan = _plan(parent, parent_uri, keep_last, grace_s, time.time())
    removed, kept_late = (
        _carry_out(parent, parent_uri, plan, progress) if not dry_run else (plan.removals, [])
    )
    actions = tuple(a for a, _ in removed) + tuple(a for a, _ in plan.aborts)
    kept = plan.kept + tuple(a.uri for a in kept_late)
    logger.info(
        "gc of %s%s: kept %d checkpoints, %d actions",
        parent.uri,
        " (dry run)" if dry_run else "",
        len(kept),
        len(actions),
    )
    return GcReport(parent_uri, dry_run, kept, actions, plan.kept_why + tuple(kept_late))


def _carry_out(
    parent: CheckpointStorage, parent_uri: str, plan: _Plan, progress: ProgressFn | None
) -> tuple[list[tuple[GcAction, CheckpointInfo]], list[GcAction]]:
    """Remove and abort what ``plan`` says; -> (the removals made, the checkpoints kept
    because their save committed while gc ran)."""
    removed, kept = [], []
    for action, info in plan.removals:
        child = _child(parent, parent_uri, info.name)
        try:  # a commit won before the tombstone: kept (see cloudckpt.removal)
            remove(child, info.uri, committed=_commit_decided(info), progress=progress)
        except CommitConflictError as exc:
            kept.append(GcAction(info.uri, REASON_COMMITTED_MEANWHILE, str(exc)))
            continue
        removed.append((action, info))
    for _, upload in plan.aborts:
        parent.abort_upload(upload)
    return removed, kept


def _commit_decided(info: CheckpointInfo) -> bool:
    """Whether the listing showed the commit decided: ``metadata.json``, or a readable
    manifest (its save won the create-only write of ``manifest.json``)."""
    return info.committed or info.size is not None


def _plan(
    parent: CheckpointStorage, parent_uri: str, keep_last: int, grace_s: float, now: float
) -> _Plan:
    infos = _list(parent, parent_uri)
    uploads = parent.open_uploads()
    ordered = _newest_first(infos)
    keep = {i.name for i in ordered[:keep_last]}
    grace = _format_grace(grace_s)
    why: dict[str, GcAction] = {
        i.name: GcAction(i.uri, f"committed, among the newest {keep_last}", _describe(i))
        for i in ordered[:keep_last]
    }
    reason_old = f"older than the newest {keep_last}"
    removals = [
        (GcAction(i.uri, reason_old, _describe(i)), i) for i in reversed(ordered[keep_last:])
    ]
    young: set[str] = set()  # uncommitted, maybe still being saved
    for info in infos:
        if info.committed:
            continue
        age = now - _last_activity(parent, parent_uri, info, uploads)
        under = _uploads_under(info.name, uploads)
        commit_due = _commit_due(info, now, parent.config)
        if commit_due or _within_grace(age, grace_s):
            young.add(info.name)
            why[info.name] = GcAction(
                info.uri,
                f"uncommitted, younger than the grace period {grace}",
                f"{_describe(info)}; {under}; last activity {_format_age(age)} ago; its save may "
                f"still be running; {_remove_now_hint(commit_due)}",
            )
            continue
        detail = f"{_describe(info)}; {under}; last activity {_format_age(age)} ago"
        removals.append((GcAction(info.uri, REASON_UNCOMMITTED, detail), info))
    # uploads of removed checkpoints go with them; a young checkpoint's are its save's;
    # under a committed checkpoint no save can be writing, so its open ones go now
    spared = young | {info.name for _, info in removals}
    committed = {info.name for info in infos if info.committed}
    aborts, kept_uploads = [], []
    for upload in uploads:
        name = upload.path.split("/", 1)[0]
        if name in spared:
            continue
        if name in committed:
            aborts.append((_abort_action(parent_uri, upload, now, REASON_COMMITTED_UPLOAD), upload))
        elif _within_grace(now - _timestamp(upload.initiated), grace_s):
            kept_uploads.append(_young_upload(parent_uri, upload, now, grace))
        else:
            aborts.append((_abort_action(parent_uri, upload, now), upload))
    keep |= young
    kept = tuple(i.uri for i in infos if i.name in keep)
    kept_why = tuple(why[i.name] for i in infos if i.name in why) + tuple(kept_uploads)
    return _Plan(kept, tuple(removals), tuple(aborts), kept_why)


def _remove_now_hint(commit_due: bool) -> str:
    if commit_due:
        return (
            "its manifest is written (the commit's last step is due); `cloudckpt rm` removes it now"
        )
    return "`cloudckpt gc --grace 0` or `cloudckpt rm` removes it now"


def _commit_due(info: CheckpointInfo, now: float, config: CheckpointConfig) -> bool:
    """Whether the manifest of an uncommitted checkpoint was created less than three
    request deadlines ago (``--grace 0`` included): its save won the commit's
    create-only write, and its last requests (the claim's check, ``metadata.json``)
    end within that time, with the commit or with an error."""
    if info.size is None or info.removing:
        return False
    return now - _timestamp(info.created) < 3 * config.retry.request_timeout_s


def _within_grace(age: float, grace_s: float) -> bool:
    """Whether something ``age`` seconds old is spared; with no grace (0) nothing is,
    even when the store's clock runs ahead of this machine's (a negative age)."""
    return grace_s > 0 and age < grace_s


def _uploads_under(name: str, uploads: Sequence[OpenUpload]) -> str:
    count = sum(1 for u in uploads if u.path.startswith(name + "/"))
    return f"{count} open multipart upload{'' if count == 1 else 's'}"


def _young_upload(parent_uri: str, upload: OpenUpload, now: float, grace: str) -> GcAction:
    age = _format_age(now - _timestamp(upload.initiated))
    return GcAction(
        _child_uri(parent_uri, upload.path),
        f"multipart upload younger than the grace period {grace}",
        f"upload {upload.upload_id} started {upload.initiated} ({age} ago); "
        "`cloudckpt gc --grace 0` aborts it now",
    )


def _describe(info: CheckpointInfo) -> str:
    parts = [] if info.iteration is None else [f"iteration {info.iteration}"]
    if info.size is not None:
        parts.append(f"{info.size} bytes")
    if info.created:
        parts.append(f"committed {info.created}" if info.committed else f"manifest {info.created}")
    return ", ".join(parts) or info.name


def _abort_action(
    parent_uri: str, upload: OpenUpload, now: float, reason: str = REASON_STALE_UPLOAD
) -> GcAction:
    started = upload.initiated or "at an unknown time"
    age = now - _timestamp(upload.initiated)
    detail = f"upload {upload.upload_id} started {started} ({_format_age(age)} ago)"
    return GcAction(_child_uri(parent_uri, upload.path), reason, detail)


def _last_activity(
    parent: CheckpointStorage, parent_uri: str, info: CheckpointInfo, uploads: Sequence[OpenUpload]
) -> float:
    """POSIX time of the newest sign of activity of an uncommitted checkpoint
    (claim, manifest, open uploads); -inf when none is known."""
    times = [_timestamp(info.created), _claim_time(_child(parent, parent_uri, info.name))]
    times += [_timestamp(u.initiated) for u in uploads if u.path.startswith(info.name + "/")]
    return max(times)


def _claim_time(storage: CheckpointStorage) -> float:
    try:
        doc = json.loads(storage.read(CLAIM_FNAME))
    except CheckpointNotFoundError:
        return float("-inf")
    except ValueError as exc:
        logger.warning("%s: unreadable claim: %s", storage.child_uri(CLAIM_FNAME), exc)
        return float("-inf")
    return _timestamp(str(doc.get("claimed", ""))) if isinstance(doc, dict) else float("-inf")


def _timestamp(iso: str) -> float:
    """POSIX time of an ISO 8601 string (naive means UTC); -inf when empty or invalid."""
    try:
        parsed = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return float("-inf")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def _format_grace(seconds: float) -> str:
    """``1 h``, ``30 min`` or ``45 s``."""
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def _format_age(seconds: float) -> str:
    if seconds == float("inf"):
        return "an unknown time"
    return f"{seconds:.0f} s" if seconds < 7200 else f"{seconds / 3600:.1f} h"
