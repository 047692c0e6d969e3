"""The consistency checker: compare what is stored under a checkpoint URI with its manifest.

:func:`verify` answers "is this checkpoint complete and intact?" without loading it:

* **shallow** (default): one listing with sizes, ``metadata.json``, ``manifest.json``
  and the open multipart uploads. No data object is read: every object listed in the
  manifest must exist with the recorded size.
* **deep**: also streams every object the manifest lists (``max_in_flight`` objects at
  once, ``part_size`` bytes at a time each, so memory stays at most
  ``max_in_flight x part_size``) and compares its CRC-32C with the manifest's.

What lies under a committed checkpoint's prefix besides its objects (a foreign object,
a multipart upload left open) does not make it wrong: the load never reads it. Such
leftovers are *notes* of the report (``cloudckpt gc`` aborts the uploads); with
``strict=True`` they are problems. An uncommitted checkpoint's open uploads are problems.

A checkpoint written by Megatron-Core or PyTorch (``metadata.json`` but no claim and no
manifest: *foreign*) has nothing to compare against; only its commit state is checked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cloudckpt.commit_state import CommitState, no_checkpoint_error
from cloudckpt.config import CheckpointConfig
from cloudckpt.core import CONFIG_FNAME, CheckpointingConfig
from cloudckpt.errors import CheckpointingException, CheckpointNotFoundError, IntegrityCheckError
from cloudckpt.manifest import (
    CLAIM_FNAME,
    INTEGRITY_FNAME,
    MANIFEST_FNAME,
    Manifest,
    ManifestEntry,
    ManifestError,
)
from cloudckpt.redact import redact_uri
from cloudckpt.storage import CheckpointStorage, OpenUpload, open_checkpoint
from cloudckpt.tombstone import Tombstone

__all__ = [
    "MEGATRON_INTEGRITY_FNAME",
    "PROBLEM_KINDS",
    "ConsistencyReport",
    "Problem",
    "IntegrityPlan",
    "LEFTOVER_KINDS",
    "check_integrity",
    "verify",
]

logger = logging.getLogger(__name__)

PROBLEM_KINDS = (
    "missing-metadata",  # metadata.json absent (uncommitted)
    "missing-manifest",  # cloudckpt claim present but manifest.json absent (uncommitted)
    "bad-manifest",  # manifest.json unparsable / wrong format
    "metadata-mismatch",  # metadata.json differs from the manifest's backends (or is invalid)
    "missing-object",  # listed in the manifest, not in the store
    "size-mismatch",  # store size != manifest size
    "checksum-mismatch",  # deep only: CRC-32C of the stored bytes != the manifest's
    "orphan-object",  # under the prefix, not in the manifest (nor metadata/manifest.json)
    "open-multipart-upload",  # a multipart upload under the prefix, never completed/aborted
    "being-removed",  # a removal (gc, rm) took manifest.json's slot and has not finished
)
LEFTOVER_KINDS = frozenset({"orphan-object", "open-multipart-upload"})
"""Kinds that are notes, not problems, of a committed checkpoint (unless ``strict``)."""

ProgressFn = Callable[[int], None]


@dataclass(frozen=True)
class Problem:
    """One inconsistency.

    Attributes:
        kind: one of :data:`PROBLEM_KINDS`.
        path: object path relative to the checkpoint root ("" when not about one object).
        detail: human-readable explanation, e.g. ``"size 100, manifest 120"``.
    """

    kind: str
    path: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        """``{"kind", "path", "detail"}``."""
        return {"kind": self.kind, "path": self.path, "detail": self.detail}


@dataclass(frozen=True)
class ConsistencyReport:
    """What :func:`verify` found.

    Attributes:
        uri: the checkpoint URI (secrets redacted).
        committed: ``metadata.json`` exists and, for a cloudckpt checkpoint, ``manifest.json``.
        foreign: written by Megatron-Core or PyTorch (no claim, no manifest): only the
            commit state was checked.
        deep: whether the objects' CRC-32Cs were checked.
        problems: every inconsistency found (empty for a good checkpoint).
        notes: what lies under a committed checkpoint's prefix but is not part of it
            (foreign objects, open multipart uploads): not problems unless ``strict``.
        objects: objects listed in the manifest (0 without one).
        total_bytes: their total size per the manifest, in bytes.
        checked_bytes: bytes read and checksummed (0 when shallow).
    """

    uri: str
    committed: bool
    foreign: bool
    deep: bool
    problems: tuple[Problem, ...]
    objects: int
    total_bytes: int
    checked_bytes: int
    notes: tuple[Problem, ...] = ()

    @property
    def ok(self) -> bool:
        """Committed and without problems."""
        return self.committed and not self.problems

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field, plus ``"ok"``; problems as dicts."""
        doc = asdict(self)
        doc["problems"] = [p.to_dict() for p in self.problems]
        doc["notes"] = [p.to_dict() for p in self.notes]
        doc["ok"] = self.ok
        return doc


def verify(
    uri: str,
    deep: bool = False,
    *,
    strict: bool = False,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    progress: ProgressFn | None = None,
    collective: bool = False,
) -> ConsistencyReport:
    """Check a checkpoint against its manifest.

    Args:
        uri: checkpoint URI or local path.
        deep: also read every object and compare its CRC-32C with the manifest's.
        strict: count the leftovers under a committed checkpoint's prefix (foreign
            objects, open multipart uploads) as problems, not notes.
        storage_options: fsspec options (credentials, endpoint); override the config's.
        config: part size (bytes per read) and ``max_in_flight`` (objects read at once).
        progress: called with a number of bytes as deep checksumming advances (from
            worker threads, one call at a time).
        collective: call on every rank of the default process group: rank 0 checks
            and sends the report to all, and its failure is raised on every rank
            (default: this rank alone).

    Returns:
        The report; ``report.ok`` is True for a committed checkpoint without problems.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``uri``: none of ``metadata.json``,
            ``manifest.json`` and the claim is there (nothing, or other data).
        StorageError: the store could not be listed or read.
    """
    if collective:
        from cloudckpt import dist  # noqa: PLC0415 - torch only when called collectively

        return dist.run_on_coordinator(
            lambda: verify(
                uri, deep, strict=strict, storage_options=storage_options, config=config
            ),
            f"verifying checkpoint {redact_uri(uri)!r}",
        )
    storage = open_checkpoint(uri, storage_options=storage_options, config=config)
    state, listing, manifest, problems = _shallow(storage)
    checked = 0
    if manifest is not None and deep:
        crc_problems, checked = _checksum_problems(storage, _intact(manifest, listing), progress)
        problems += crc_problems
    notes: list[Problem] = []
    if state.committed and not strict:
        notes = [_as_note(p) for p in problems if p.kind in LEFTOVER_KINDS]
        problems = [p for p in problems if p.kind not in LEFTOVER_KINDS]
    report = ConsistencyReport(
        uri=storage.uri,
        committed=state.committed,
        foreign=state.foreign,
        deep=deep,
        problems=tuple(problems),
        objects=len(manifest.objects) if manifest is not None else 0,
        total_bytes=manifest.total_size if manifest is not None else 0,
        checked_bytes=checked,
        notes=tuple(notes),
    )
    _log_report(report)
    return report


def _as_note(problem: Problem) -> Problem:
    why = (
        "`cloudckpt gc` aborts it"
        if problem.kind == "open-multipart-upload"
        else "a load never reads it"
    )
    return dataclasses.replace(
        problem, detail=f"{problem.detail}; not part of the checkpoint: {why}"
    )


def _shallow(
    storage: CheckpointStorage,
) -> tuple[CommitState, dict[str, int], Manifest | None, list[Problem]]:
    """What :func:`verify` finds without reading data: the commit state, the listing
    (path -> size), the manifest (None: none readable) and the problems found.

    Raises:
        CheckpointNotFoundError: no checkpoint at all under the storage's URI.
    """
    listing = storage.list_sizes()
    state = CommitState.from_names(listing)  # from the listing: no request per commit file
    if state.absent:  # nothing, or other data: not a damaged checkpoint, none at all
        raise no_checkpoint_error(storage, len(listing))
    uploads = storage.open_uploads()
    backends, problems = _read_backends(storage, state)
    manifest, manifest_problems = _read_manifest(storage, state)
    problems = _commit_problems(state) + _upload_problems(uploads) + problems + manifest_problems
    if manifest is not None:
        problems += _backend_problems(manifest, backends) + _listing_problems(manifest, listing)
    return state, listing, manifest, problems


def _intact(manifest: Manifest, listing: Mapping[str, int]) -> list[ManifestEntry]:
    """The manifest's objects stored with their recorded size (the others are problems)."""
    return [e for e in manifest.objects if listing.get(e.path) == e.size]


MEGATRON_INTEGRITY_FNAME = INTEGRITY_FNAME


@dataclass(frozen=True)
class IntegrityPlan:
    """What :func:`check_integrity` reads, as the coordinator found it (sent to every
    rank, which reads its share).

    Attributes:
        record: what the checkpoint is checked against: "manifest" or ``integrity.json``.
        problems: found without reading data (commit state, missing or resized objects).
        crc_entries: manifest objects whose CRC-32C is checked, largest first.
        sha_entries: ``(path, size, SHA-256)`` of ``integrity.json``'s files, largest first.
    """

    record: str
    problems: tuple[Problem, ...]
    crc_entries: tuple[ManifestEntry, ...] = ()
    sha_entries: tuple[tuple[str, int, str], ...] = ()

    def share(self, rank: int, world: int) -> IntegrityPlan:
        """The objects rank ``rank`` of ``world`` reads (every world-th, by size)."""
        return dataclasses.replace(
            self,
            problems=(),
            crc_entries=self.crc_entries[rank::world],
            sha_entries=self.sha_entries[rank::world],
        )

    @property
    def objects(self) -> int:
        """How many objects are read."""
        return len(self.crc_entries) + len(self.sha_entries)


def check_integrity(
    uri: str,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> int:
    """``load(..., verify_integrity=True)``: read every object and check it against the
    checkpoint's integrity record: cloudckpt's manifest (sizes and CRC-32Cs), else the
    ``integrity.json`` Megatron-Core 0.19 writes (SHA-256 of each file). Collective: the
    coordinator lists the checkpoint and reads the record, every rank reads its share of
    the objects (so no rank waits for one rank to read them all), and every rank learns
    the verdict. Returns the number of objects read.

    Raises:
        IntegrityCheckError: a problem (every one listed), or no record to check against.
        CheckpointNotFoundError: no checkpoint at ``uri``.
    """
    from cloudckpt import dist  # noqa: PLC0415 - torch only when called

    shown = redact_uri(uri)
    what = f"checking the integrity of checkpoint {shown!r}"
    plan = dist.run_on_coordinator(lambda: _integrity_plan(uri, storage_options, config), what)
    if plan is None:
        raise IntegrityCheckError(
            f"checkpoint {shown!r} has no cloudckpt manifest and no Megatron-Core "
            f"{MEGATRON_INTEGRITY_FNAME} (saved without verify_integrity): "
            "verify_integrity=True has nothing to check it against"
        )
    problems = list(plan.problems)
    if not problems:  # (else the verdict is known: no object is read)
        share = plan.share(dist.get_rank(), dist.get_world_size())
        found = dist.all_gather_agreed(
            what, lambda: _share_problems(uri, storage_options, config, share)
        )
        problems = sorted((p for part in found for p in part), key=lambda p: (p.path, p.kind))
    if problems:
        listed = "; ".join(f"{p.kind} {p.path or '-'}: {p.detail}" for p in problems[:20])
        more = len(problems) - 20
        listed += f"; and {more} more" if more > 0 else ""
        raise IntegrityCheckError(
            f"checkpoint {shown!r} failed its integrity check against its {plan.record} "
            f"(verify_integrity=True): {len(problems)} problem(s): {listed}"
        )
    return plan.objects


def _integrity_plan(
    uri: str, storage_options: dict[str, Any] | None, config: CheckpointConfig | None
) -> IntegrityPlan | None:
    """The coordinator's part of :func:`check_integrity` (None: no record)."""
    storage = open_checkpoint(uri, storage_options=storage_options, config=config)
    state, listing, manifest, found = _shallow(storage)
    if not state.foreign:  # what the load reads is intact; extra objects do not matter
        # leftovers leave every recorded object intact (Megatron-Core's integrity check
        # likewise looks only at the files its record lists)
        problems = tuple(p for p in found if p.kind not in LEFTOVER_KINDS)
        intact = _intact(manifest, listing) if manifest is not None else []
        entries = tuple(sorted(intact, key=lambda e: -e.size))
        return IntegrityPlan("manifest", problems, crc_entries=entries)
    if MEGATRON_INTEGRITY_FNAME not in listing:
        return None
    record = MEGATRON_INTEGRITY_FNAME
    try:
        doc = json.loads(storage.read(record))
        files = dict(doc["files"]) if doc.get("algorithm") == "sha256" else None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        files, doc = None, {"error": str(exc)}
    if files is None:
        detail = f"not a sha256 file list: {str(doc)[:200]}"
        return IntegrityPlan(record, (Problem("bad-manifest", record, detail),))
    missing = tuple(
        Problem("missing-object", name, f"listed in {record}")
        for name in sorted(files)
        if name not in listing
    )
    present = [(name, listing[name], str(want)) for name, want in files.items() if name in listing]
    by_size = tuple(sorted(present, key=lambda e: (-e[1], e[0])))
    return IntegrityPlan(record, missing, sha_entries=by_size)


def _share_problems(
    uri: str,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig | None,
    share: IntegrityPlan,
) -> list[Problem]:
    """Read this rank's share of :func:`check_integrity`'s objects; what differs."""
    if not share.objects:
        return []
    storage = open_checkpoint(uri, storage_options=storage_options, config=config)
    problems = _checksum_problems(storage, share.crc_entries, None)[0] if share.crc_entries else []

    def sha_problem(entry: tuple[str, int, str]) -> Problem | None:
        path, size, want = entry
        got = storage.sha256(path, size)
        if got == want:
            return None
        return Problem("checksum-mismatch", path, f"SHA-256 {got}, recorded {want}")

    return problems + [p for p in storage.map(sha_problem, share.sha_entries) if p is not None]


def _commit_problems(state: CommitState) -> list[Problem]:
    problems = []
    if not state.metadata:
        problems.append(
            Problem("missing-metadata", CONFIG_FNAME, f"{CONFIG_FNAME} is missing: uncommitted")
        )
    if state.claim and not state.manifest:
        problems.append(
            Problem(
                "missing-manifest",
                MANIFEST_FNAME,
                f"{CLAIM_FNAME} exists but {MANIFEST_FNAME} does not: uncommitted",
            )
        )
    return problems


def _upload_problems(uploads: Sequence[OpenUpload]) -> list[Problem]:
    return [
        Problem(
            "open-multipart-upload",
            u.path,
            f"multipart upload {u.upload_id} started {u.initiated or 'at an unknown time'} "
            "was never completed or aborted",
        )
        for u in sorted(uploads, key=lambda u: (u.path, u.upload_id))
    ]


def _read_backends(
    storage: CheckpointStorage, state: CommitState
) -> tuple[dict[str, Any] | None, list[Problem]]:
    """``metadata.json`` as a dict (None when absent or invalid), and its problem if invalid."""
    if not state.metadata:
        return None, []
    raw = storage.read(CONFIG_FNAME)
    try:
        return asdict(CheckpointingConfig.from_json(raw, storage.child_uri(CONFIG_FNAME))), []
    except CheckpointingException as exc:  # not JSON, or not Megatron-Core's four keys
        return None, [Problem("metadata-mismatch", CONFIG_FNAME, str(exc))]


def _read_manifest(
    storage: CheckpointStorage, state: CommitState
) -> tuple[Manifest | None, list[Problem]]:
    if not state.manifest:
        return None, []
    where = storage.child_uri(MANIFEST_FNAME)
    try:
        raw = storage.read(MANIFEST_FNAME)
        removal = Tombstone.from_json(raw)
        if removal is not None:
            detail = (
                f"a removal (`cloudckpt gc` or `cloudckpt rm`; {removal.describe()}) took "
                f"{MANIFEST_FNAME}'s slot and has not finished: uncommitted; `cloudckpt rm` "
                "finishes it"
            )
            return None, [Problem("being-removed", MANIFEST_FNAME, detail)]
        return Manifest.from_json(raw, where), []
    except ManifestError as exc:
        return None, [Problem("bad-manifest", MANIFEST_FNAME, str(exc))]


def _backend_problems(manifest: Manifest, backends: Mapping[str, Any] | None) -> list[Problem]:
    recorded = dict(manifest.backends)
    if backends is None or backends == recorded:
        return []
    detail = (
        f"{CONFIG_FNAME} says {json.dumps(backends, sort_keys=True)}, "
        f"{MANIFEST_FNAME} recorded {json.dumps(recorded, sort_keys=True)}"
    )
    return [Problem("metadata-mismatch", CONFIG_FNAME, detail)]


def _listing_problems(manifest: Manifest, listing: Mapping[str, int]) -> list[Problem]:
    """Missing, resized and orphan objects, by path."""
    expected = manifest.by_path()
    problems = []
    for path, entry in expected.items():
        size = listing.get(path)
        if size is None:
            problems.append(Problem("missing-object", path, f"listed in {MANIFEST_FNAME}"))
        elif size != entry.size:
            problems.append(Problem("size-mismatch", path, f"size {size}, manifest {entry.size}"))
    commit_files = (CONFIG_FNAME, MANIFEST_FNAME, INTEGRITY_FNAME)  # written after it
    problems += [
        Problem("orphan-object", path, f"{size} bytes, not listed in {MANIFEST_FNAME}")
        for path, size in listing.items()
        if path not in expected and path not in commit_files
    ]
    return sorted(problems, key=lambda p: (p.path, p.kind))


def _checksum_problems(
    storage: CheckpointStorage, entries: Sequence[ManifestEntry], progress: ProgressFn | None
) -> tuple[list[Problem], int]:
    """Stream each entry, ``max_in_flight`` at once; -> (problems, bytes checksummed)."""
    lock = threading.Lock()
    started = time.perf_counter()

    def check(entry: ManifestEntry) -> tuple[Problem | None, int]:
        try:
            block_size = entry.blocks.block_size if entry.blocks is not None else None
            result = storage.checksum(entry.path, entry.size, block_size)
        except CheckpointNotFoundError:
            return Problem("missing-object", entry.path, "deleted while being verified"), 0
        if progress is not None:
            with lock:
                progress(result.size)
        if result.size != entry.size:
            detail = f"read {result.size} bytes, manifest {entry.size}"
            return Problem("size-mismatch", entry.path, detail), result.size
        if result.crc32c != entry.crc32c:
            detail = f"CRC-32C {result.crc32c:#010x}, manifest {entry.crc32c:#010x}"
            return Problem("checksum-mismatch", entry.path, detail), result.size
        if result.blocks != entry.blocks:  # a manifest whose block CRCs are wrong
            detail = f"block CRC-32Cs differ from the manifest's: {_bad_blocks(result, entry)}"
            return Problem("checksum-mismatch", entry.path, detail), result.size
        return None, result.size

    found = storage.map(check, entries)
    checked = sum(nbytes for _, nbytes in found)
    elapsed = max(time.perf_counter() - started, 1e-9)
    logger.info(
        "checksummed %d objects, %.1f MB in %.1f s (%.1f MB/s) at %s",
        len(entries),
        checked / 1e6,
        elapsed,
        checked / 1e6 / elapsed,
        storage.uri,
    )
    return [p for p, _ in found if p is not None], checked


def _bad_blocks(result: ManifestEntry, entry: ManifestEntry) -> str:
    """The first blocks whose CRC-32C the manifest records wrongly."""
    if result.blocks is None or entry.blocks is None or len(result.blocks) != len(entry.blocks):
        return "a different number of blocks"
    bad = [i for i in range(len(entry.blocks)) if result.blocks.crc(i) != entry.blocks.crc(i)]
    return f"blocks {bad[:5]} of {len(entry.blocks)}"


def _log_report(report: ConsistencyReport) -> None:
    if report.ok:
        logger.info(
            "%s is consistent (%s): %d objects, %.1f MB",
            report.uri,
            "deep" if report.deep else "shallow",
            report.objects,
            report.total_bytes / 1e6,
        )
        return
    logger.warning(
        "%s: %s, %d problem(s)%s",
        report.uri,
        "committed" if report.committed else "NOT committed",
        len(report.problems),
        "".join(f"; {p.kind} {p.path}: {p.detail}" for p in report.problems[:5]),
    )
