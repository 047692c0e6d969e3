"""The subcommands of the ``cloudckpt`` command line that delete or write objects: ``gc``
(old and uncommitted checkpoints, stale multipart uploads), ``rm`` (one checkpoint) and
``convert`` (a copy to another URI and/or backend). Registered by :mod:`cloudckpt.cli`.
"""

from __future__ import annotations

import argparse
import sys

from cloudckpt import tracker
from cloudckpt.cli_format import dump_json, gc_lines, manifest_size, plural, progress_bar
from cloudckpt.cli_options import (
    Subparsers,
    _add_storage_option_flag,
    _add_store_options,
    _at_least,
    _library_kwargs,
    _require_stored,
    _show_progress,
)
from cloudckpt.redact import redact_uri

DEFAULT_GRACE_S = 3600.0


# -- gc --------------------------------------------------------------------------------------


def _add_gc(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "gc",
        help="remove old and uncommitted checkpoints, abort stale multipart uploads",
        description="Keep the newest N committed checkpoints under PARENT_URI (by iteration) "
        "and remove the older ones; remove uncommitted checkpoints and abort multipart "
        "uploads older than the grace period (a save still running is uncommitted too).",
    )
    parser.add_argument("parent_uri", metavar="PARENT_URI", help="prefix holding checkpoints")
    parser.add_argument(
        "--keep-last",
        metavar="N",
        type=_at_least(int, 1, "an integer >= 1"),
        required=True,
        help="committed checkpoints to keep (>= 1)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="only print what would be removed or aborted"
    )
    parser.add_argument(
        "--grace",
        metavar="SECONDS",
        type=_at_least(float, 0.0, "a number of seconds >= 0"),
        default=DEFAULT_GRACE_S,
        help="leave uncommitted checkpoints and multipart uploads younger than this alone "
        f"(default {DEFAULT_GRACE_S:.0f})",
    )
    _add_store_options(parser, with_progress=True)
    parser.set_defaults(handler=_cmd_gc)


def _cmd_gc(args: argparse.Namespace) -> int:
    kwargs = _library_kwargs(args)
    _require_stored(args.parent_uri, kwargs)
    show = not args.dry_run and _show_progress(args)
    with progress_bar(show, "gc: deleted", " objects") as progress:
        report = tracker.collect_garbage(
            args.parent_uri,
            args.keep_last,
            grace_s=args.grace,
            dry_run=args.dry_run,
            progress=progress,
            **kwargs,
        )
    print(dump_json(report.to_dict()) if args.json else "\n".join(gc_lines(report, args.keep_last)))
    return 0


# -- rm --------------------------------------------------------------------------------------


def _add_rm(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "rm",
        help="remove one checkpoint",
        description="Remove the checkpoint at URI: metadata.json first, then manifest.json "
        "(so a partly removed checkpoint reads as uncommitted), then every other object, and "
        "abort its open multipart uploads. Asks for confirmation on a terminal; elsewhere "
        "--yes is required (exit 2 without it).",
    )
    parser.add_argument("uri", metavar="URI", help="checkpoint URI or local path")
    parser.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    _add_store_options(parser, with_json=False, with_progress=True)
    parser.set_defaults(handler=_cmd_rm)


def _confirmed(uri: str) -> bool:
    """Ask on the terminal; False without one."""
    if not sys.stdin.isatty():
        return False
    sys.stderr.write(f"remove checkpoint {uri} and every object under it? [y/N] ")
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _cmd_rm(args: argparse.Namespace) -> int:
    kwargs = _library_kwargs(args)
    uri = redact_uri(args.uri)
    if not args.yes and not _confirmed(uri):
        why = "not confirmed" if sys.stdin.isatty() else "stdin is not a terminal"
        print(f"cloudckpt rm: refusing to remove {uri} without --yes ({why})", file=sys.stderr)
        return 2
    with progress_bar(_show_progress(args), "rm: deleted", " objects") as progress:
        count = tracker.remove_checkpoint(args.uri, progress=progress, **kwargs)
    print(f"removed {plural(count, 'object')} from {uri}")
    return 0


# -- convert ---------------------------------------------------------------------------------


def _add_convert(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="copy a checkpoint to another URI and/or backend",
        description="Copy the committed checkpoint at SRC_URI to the empty DST_URI, written "
        "with --backend, tensor by tensor (whole tensors, no parallel layout involved; at most "
        "--max-batch-mib of tensors in memory), and commit it with a manifest. Works between "
        "any stores (local, s3://, gs://, ...).",
    )
    parser.add_argument("src_uri", metavar="SRC_URI", help="source checkpoint")
    parser.add_argument("dst_uri", metavar="DST_URI", help="destination (must be empty)")
    parser.add_argument(
        "--backend", choices=("zarr", "torch_dist"), default="zarr", help="target backend"
    )
    parser.add_argument(
        "--max-batch-mib",
        type=_at_least(int, 1, "a positive number of MiB"),
        default=1024,
        help="tensor MiB read and written at once (default 1024; a larger tensor is its own batch)",
    )
    _add_storage_option_flag(
        parser,
        "--dst-storage-option",
        "dst_storage_options",
        "a storage option for the destination only (repeatable; overrides --storage-option there)",
    )
    _add_store_options(parser, with_json=True, with_progress=True)
    parser.set_defaults(handler=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from cloudckpt.convert import convert  # noqa: PLC0415 - loads torch and the strategies

    kwargs = _library_kwargs(args)
    src_options = kwargs["storage_options"]
    dst_options = {**(src_options or {}), **dict(args.dst_storage_options)} or None
    show = _show_progress(args)
    total = manifest_size(args.src_uri, **kwargs) if show else None
    with progress_bar(show, "convert", "B", total) as progress:
        manifest = convert(
            args.src_uri,
            args.dst_uri,
            args.backend,
            src_storage_options=src_options,
            dst_storage_options=dst_options,
            config=kwargs["config"],
            max_batch_bytes=args.max_batch_mib * 2**20,
            progress=progress,
        )
    summary = {
        "src": redact_uri(args.src_uri),
        "dst": redact_uri(args.dst_uri),
        "backend": args.backend,
        "tensors": len(manifest.tensors),
        "objects": len(manifest.objects),
        "bytes": manifest.total_size,
    }
    if args.json:
        print(dump_json(summary))
    else:
        print(
            f"converted {summary['src']} -> {summary['dst']} ({args.backend}): "
            f"{plural(len(manifest.tensors), 'tensor')}, {plural(len(manifest.objects), 'object')}"
            f", {manifest.total_size / 1e6:.1f} MB"
        )
    return 0
