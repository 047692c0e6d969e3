"""What the ``cloudckpt`` command line shows: human tables, JSON, progress bars, and
the view of a checkpoint that ``inspect`` prints.

:mod:`cloudckpt.cli` parses arguments and calls the library; this module turns the
results into text. Apart from :func:`describe` and :func:`manifest_size` (which read a
checkpoint's commit objects, manifest or, for a foreign checkpoint, its metadata), it does
no I/O. Every string that reaches the terminal, in a table or in JSON, goes through
:func:`~cloudckpt.redact.redact_uri` first, so a URI carrying credentials is never shown.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from cloudckpt.checker import ConsistencyReport
from cloudckpt.commit_state import CommittedCheckpoint, open_committed, read_manifest
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CheckpointingException
from cloudckpt.manifest import Manifest, TensorEntry
from cloudckpt.redact import redact_uri
from cloudckpt.storage import CheckpointStorage, open_checkpoint
from cloudckpt.tracker import (
    REASON_COMMITTED_UPLOAD,
    REASON_STALE_UPLOAD,
    CheckpointInfo,
    GcReport,
)

ProgressCallback = Callable[[int], None]

_SIZE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def human_size(nbytes: int | None) -> str:
    """``12.3 MB`` (powers of 1000); ``-`` for an unknown size."""
    if nbytes is None:
        return "-"
    if nbytes < 1000:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in _SIZE_UNITS[1:]:
        value /= 1000
        if value < 1000 or unit == _SIZE_UNITS[-1]:
            break
    return f"{value:.1f} {unit}"


def format_shape(shape: Sequence[int] | None) -> str:
    """A shape as torch prints one, ``(4, 8)``; ``-`` when unknown."""
    if shape is None:
        return "-"
    if len(shape) == 1:
        return f"({shape[0]},)"
    return "(" + ", ".join(str(n) for n in shape) + ")"


def _cell(value: object) -> str:
    return "-" if value is None or value == "" else redact_uri(str(value))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]], right: str = "") -> list[str]:
    """Aligned text columns, two spaces apart; columns named in ``right`` (by their
    header) are right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = (
            v.rjust(w) if h in right.split(",") else v.ljust(w)
            for h, v, w in zip(headers, values, widths, strict=True)
        )
        return "  ".join(padded).rstrip()

    return [line(headers), *(line(r) for r in cells)]


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact_uri(value)
    if isinstance(value, Mapping):
        return {str(k): _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value


def dump_json(value: Any) -> str:
    """Indented JSON of ``value`` with every string passed through ``redact_uri``."""
    return json.dumps(_redacted(value), indent=2, sort_keys=False)


def plural(count: int, noun: str) -> str:
    """``1 object``, ``2 objects``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


# -- ls ------------------------------------------------------------------------------------


def checkpoint_state(info: CheckpointInfo) -> str:
    """``committed``, ``uncommitted`` or ``foreign`` (committed by Megatron-Core/PyTorch)."""
    if info.foreign:
        return "foreign"
    return "committed" if info.committed else "uncommitted"


def ls_records(infos: Sequence[CheckpointInfo]) -> list[dict[str, Any]]:
    """``ls --json``: one dict per checkpoint."""
    return [
        {
            "name": i.name,
            "uri": i.uri,
            "iteration": i.iteration,
            "state": checkpoint_state(i),
            "committed": i.committed,
            "foreign": i.foreign,
            "size": i.size,
            "created": i.created,
            "world_size": i.world_size,
        }
        for i in infos
    ]


def ls_lines(parent_uri: str, infos: Sequence[CheckpointInfo]) -> list[str]:
    """``ls``: a table of the checkpoints and a summary line."""
    if not infos:
        return [f"no checkpoints under {redact_uri(parent_uri)}"]
    rows = [
        (i.name, i.iteration, checkpoint_state(i), human_size(i.size), i.created, i.world_size)
        for i in infos
    ]
    headers = ("NAME", "ITERATION", "STATE", "SIZE", "CREATED", "WORLD")
    committed = sum(1 for i in infos if i.committed)
    summary = (
        f"{plural(len(infos), 'checkpoint')} under {redact_uri(parent_uri)}: "
        f"{committed} committed, {len(infos) - committed} uncommitted"
    )
    return [*table(headers, rows, right="ITERATION,SIZE,WORLD"), summary]


def ls_nested_lines(parent_uri: str, nested: Mapping[str, int]) -> list[str]:
    """``ls`` of a prefix without checkpoints of its own whose children hold some
    (``nested``: child URI -> checkpoints directly under it): where they are, and the
    command that lists the first."""
    parent = redact_uri(parent_uri)
    lines = [f"no checkpoints directly under {parent}; found checkpoints one level down in:"]
    lines += [f"  {redact_uri(uri)} ({plural(n, 'checkpoint')})" for uri, n in nested.items()]
    lines.append(f"run `cloudckpt ls {redact_uri(next(iter(nested)))}` to list them")
    return lines


# -- inspect -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Description:
    """What ``inspect`` shows of a committed checkpoint."""

    uri: str
    foreign: bool
    backends: Mapping[str, Any]
    world_size: int | None
    created: str
    objects: int
    total_size: int
    tensors: tuple[TensorEntry, ...]
    common_keys: tuple[str, ...]

    @classmethod
    def from_manifest(cls, uri: str, manifest: Manifest) -> Description:
        """A cloudckpt checkpoint, described by its manifest alone."""
        return cls(
            uri=uri,
            foreign=False,
            backends=dict(manifest.backends),
            world_size=manifest.world_size,
            created=manifest.created,
            objects=len(manifest.objects),
            total_size=manifest.total_size,
            tensors=manifest.tensors,
            common_keys=manifest.common_keys,
        )

    def to_dict(self) -> dict[str, Any]:
        """``inspect --json``."""
        return {
            "uri": self.uri,
            "committed": True,
            "foreign": self.foreign,
            "backends": dict(self.backends),
            "world_size": self.world_size,
            "created": self.created,
            "objects": self.objects,
            "total_size": self.total_size,
            "tensors": [
                {
                    "key": t.key,
                    "shape": list(t.global_shape),
                    "dtype": t.dtype,
                    "chunks": None if t.chunks is None else list(t.chunks),
                }
                for t in self.tensors
            ],
            "common_keys": list(self.common_keys),
        }


def describe(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> Description:
    """The ``inspect`` view of a committed checkpoint: from its manifest alone, or, for a
    foreign checkpoint (no manifest), from its tensor metadata and common state. Those
    pickles are always unpickled restricted (:func:`cloudckpt.safe_pickle.never_trusted`,
    whatever ``CLOUDCKPT_TRUST_PICKLES`` says): inspecting never runs a checkpoint's code.

    Raises:
        CheckpointNotFoundError: nothing is stored at ``uri``.
        UncommittedCheckpointError: the checkpoint is not committed.
        UnsafePickleError: a foreign checkpoint's pickle needs a global outside the
            allow-list.
    """
    storage = open_checkpoint(uri, storage_options=storage_options, config=config)
    checkpoint = open_committed(storage)
    if checkpoint.manifest is not None:
        return Description.from_manifest(storage.uri, checkpoint.manifest)
    return _describe_foreign(storage, uri, checkpoint)


def _describe_foreign(
    storage: CheckpointStorage, uri: str, checkpoint: CommittedCheckpoint
) -> Description:
    """Tensors from their metadata (no chunking known), common keys from the common
    state's top level, objects from the listing."""
    # only a foreign checkpoint needs torch: `inspect` of a cloudckpt one does not load it
    from cloudckpt.load_session import LoadSession  # noqa: PLC0415
    from cloudckpt.mapping import ShardedTensor  # noqa: PLC0415
    from cloudckpt.safe_pickle import never_trusted  # noqa: PLC0415

    session = LoadSession.bind(uri, storage, checkpoint)
    sizes = storage.list_sizes()
    with never_trusted():
        tensors = [
            TensorEntry(sh.key, tuple(sh.global_shape), str(sh.dtype).removeprefix("torch."))
            for sh in session.tensors_metadata().values()
            if isinstance(sh, ShardedTensor)
        ]
        common = session.common_state()
    return Description(
        uri=storage.uri,
        foreign=True,
        backends=asdict(checkpoint.backends),
        world_size=None,
        created="",
        objects=len(sizes),
        total_size=sum(sizes.values()),
        tensors=tuple(sorted(tensors, key=lambda t: t.key)),
        common_keys=tuple(sorted(str(k) for k in common)),
    )


def _backends_text(backends: Mapping[str, Any]) -> str:
    if not backends:
        return "-"
    return (
        f"sharded {backends.get('sharded_backend')} v{backends.get('sharded_backend_version')}, "
        f"common {backends.get('common_backend')} v{backends.get('common_backend_version')}"
    )


def inspect_lines(d: Description) -> list[str]:
    """``inspect``: a header, the tensors table and the common keys."""
    state = "committed (foreign: no cloudckpt manifest)" if d.foreign else "committed"
    lines = [
        f"checkpoint:  {redact_uri(d.uri)}",
        f"state:       {state}",
        f"backends:    {_backends_text(d.backends)}",
        f"world size:  {_cell(d.world_size)}",
        f"created:     {_cell(d.created)}",
        f"objects:     {d.objects} ({human_size(d.total_size)})",
        "",
        f"{plural(len(d.tensors), 'tensor')}:",
    ]
    rows = [
        (t.key, format_shape(t.global_shape), t.dtype, format_shape(t.chunks)) for t in d.tensors
    ]
    if rows:
        lines += table(("KEY", "SHAPE", "DTYPE", "CHUNKS"), rows)
    lines += ["", f"{plural(len(d.common_keys), 'common key')}:"]
    lines += [f"  {key}" for key in d.common_keys]
    return lines


# -- verify --------------------------------------------------------------------------------


def manifest_size(
    uri: str,
    *,
    storage_options: dict[str, Any] | None = None,
    config: CheckpointConfig | None = None,
) -> int | None:
    """Total bytes the checkpoint's manifest lists (a progress bar's total); None when
    it has none or it cannot be read."""
    try:
        storage = open_checkpoint(uri, storage_options=storage_options, config=config)
        manifest = read_manifest(storage)
    except (CheckpointingException, OSError):
        return None
    return None if manifest is None else manifest.total_size


def _verify_summary(report: ConsistencyReport) -> str:
    if report.ok and report.foreign:
        return (
            "OK: committed foreign checkpoint (no cloudckpt manifest: only its commit state "
            "was checked)"
        )
    what = f"{plural(report.objects, 'object')}, {human_size(report.total_bytes)}"
    if report.ok and report.deep:
        return f"OK: {what}; sizes and CRC-32C checksums match the manifest"
    if report.ok:
        return f"OK: {what}; all present with the manifest's sizes (use --deep for checksums)"
    reasons = [] if report.committed else ["not committed"]
    if report.problems:
        reasons.append(plural(len(report.problems), "problem"))
    return "INCONSISTENT: " + "; ".join(reasons)


def verify_lines(report: ConsistencyReport) -> list[str]:
    """``verify``: what was checked, the problems (kind, path, detail) and a summary."""
    if report.deep:
        check = f"deep (CRC-32C of {human_size(report.checked_bytes)} read back)"
    else:
        check = "shallow (listing, sizes and commit objects; no data read)"
    lines = [f"checkpoint:  {redact_uri(report.uri)}", f"check:       {check}"]
    if report.problems:
        rows = [(p.kind, p.path, p.detail) for p in report.problems]
        lines += ["", *table(("PROBLEM", "PATH", "DETAIL"), rows), ""]
    if report.notes:
        rows = [(p.kind, p.path, p.detail) for p in report.notes]
        lines += ["", *table(("NOTE", "PATH", "DETAIL"), rows), ""]
    summary = _verify_summary(report)
    if report.notes:
        summary += f"; {plural(len(report.notes), 'note')} (not part of the checkpoint)"
    lines.append(summary)
    return lines


# -- gc ------------------------------------------------------------------------------------


def _gc_verb(reason: str, dry_run: bool) -> str:
    if reason in (REASON_STALE_UPLOAD, REASON_COMMITTED_UPLOAD):
        return "would abort" if dry_run else "aborted"
    return "would remove" if dry_run else "removed"


def gc_lines(report: GcReport, keep_last: int) -> list[str]:
    """``gc``: the actions (done, or that would be done) and the checkpoints kept."""
    mode = " (dry run: nothing was changed)" if report.dry_run else ""
    lines = [
        f"gc {redact_uri(report.parent_uri)}: keeping the newest "
        f"{plural(keep_last, 'committed checkpoint')}{mode}"
    ]
    if report.actions:
        rows = [
            (_gc_verb(a.reason, report.dry_run), a.uri, a.reason, a.detail) for a in report.actions
        ]
        lines += table(("ACTION", "URI", "REASON", "DETAIL"), rows)
    else:
        lines.append("nothing to collect")
    lines.append(f"kept {plural(len(report.kept), 'checkpoint')}:")
    reasons = {k.uri: k for k in report.kept_why}
    for uri in report.kept:
        kept = reasons.get(uri)
        lines.append(
            f"  {redact_uri(uri)}" + ("" if kept is None else f": {kept.reason} ({kept.detail})")
        )
    uploads = [k for k in report.kept_why if k.uri not in set(report.kept)]
    if uploads:
        lines.append(f"left {plural(len(uploads), 'multipart upload')} alone:")
        lines += [f"  {redact_uri(k.uri)}: {k.reason} ({k.detail})" for k in uploads]
    return lines


# -- progress ------------------------------------------------------------------------------


@contextmanager
def progress_bar(
    enabled: bool, desc: str, unit: str, total: int | None = None
) -> Iterator[ProgressCallback | None]:
    """A tqdm bar on stderr, yielded as a thread-safe ``update(n)`` callback (None when
    disabled, so library calls skip progress reporting altogether)."""
    if not enabled:
        yield None
        return
    from tqdm import tqdm  # noqa: PLC0415 - only when a bar is shown

    lock = threading.Lock()
    bytes_unit = unit == "B"
    bar = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=bytes_unit,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.2,
    )

    def update(n: int) -> None:
        with lock:
            bar.update(n)

    try:
        yield update
    finally:
        bar.close()
