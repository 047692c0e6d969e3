"""The ``cloudckpt`` command line.

``ls PARENT_URI`` (checkpoints: committed?, size, time), ``inspect URI`` (tensors, common
keys, writer), ``verify URI [--deep]`` (consistent with its manifest?), ``gc
PARENT_URI --keep-last N [--dry-run]`` (old and uncommitted checkpoints, stale multipart
uploads), ``rm URI`` and ``demo`` (train, save, reload resharded on CPU ranks).

The storage subcommands take ``--config YAML`` (a training config: storage options, part
size, in-flight requests) and repeatable ``--storage-option KEY=VALUE`` (VALUE parsed as
JSON when it is JSON); credentials otherwise come from the environment. Tables by
default, ``--json`` for machines, progress bars on stderr when it is a terminal. Nothing
printed carries a secret: URIs are redacted, storage options never echoed.

Each subcommand is one ``_add_<name>`` function that registers its parser and sets
``handler`` to a ``(argparse.Namespace) -> int`` function; adding a subcommand means
adding that function to :data:`_SUBCOMMANDS`. Handlers return the exit status; an error
escaping a handler is printed without a traceback (with ``--json``, also as a JSON document
on stdout) and :func:`exit_status` maps its type to the status, the same for every
subcommand (:data:`EXIT_STATUS_HELP`): 0 success; 1 a checkpoint problem found (uncommitted,
inconsistent, corrupt, incompatible, conflicting); 2 usage error, no checkpoint at the URI,
unreachable store or refused or missing credentials.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from cloudckpt import checker, tracker
from cloudckpt.cli_format import (
    describe,
    dump_json,
    gc_lines,
    inspect_lines,
    ls_lines,
    ls_records,
    manifest_size,
    plural,
    progress_bar,
    verify_lines,
)
from cloudckpt.config import CheckpointConfig, ConfigError, from_yaml, redact_uri
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptObjectError,
    StorageError,
)
from cloudckpt.storage import open_checkpoint

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction is private

DEFAULT_DEMO_DIR = "./cloudckpt-demo"
DEFAULT_GRACE_S = 3600.0


class UsageError(Exception):
    """Bad arguments found after parsing (e.g. an unreadable --config): exit status 2."""


EXIT_OK = 0
EXIT_PROBLEM = 1  # a checkpoint problem found
EXIT_UNAVAILABLE = 2  # usage error, no checkpoint at the URI, store unreachable or refused

# the first entry whose type matches an escaping error gives the exit status
_EXIT_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, EXIT_UNAVAILABLE),
    (ConfigError, EXIT_UNAVAILABLE),
    (CorruptObjectError, EXIT_PROBLEM),  # a StorageError, but about the checkpoint
    (CheckpointNotFoundError, EXIT_UNAVAILABLE),
    (StorageError, EXIT_UNAVAILABLE),  # unreachable, credentials, missing extra, I/O
    (CheckpointingException, EXIT_PROBLEM),  # uncommitted, bad manifest, conflict, ...
    (OSError, EXIT_UNAVAILABLE),
    (ValueError, EXIT_UNAVAILABLE),
)

EXIT_STATUS_HELP = """\
exit status (every command):
  0  success (verify: the checkpoint is consistent)
  1  a checkpoint problem was found: uncommitted, inconsistent or corrupt (verify not
     OK), incompatible, or already written (convert)
  2  usage error, no checkpoint at the URI (or nothing under PARENT_URI), store
     unreachable, credentials refused or missing, or another storage failure
"""


def exit_status(error: BaseException) -> int:
    """The exit status of a command that raised ``error`` (see :data:`EXIT_STATUS_HELP`)."""
    return next((code for kind, code in _EXIT_STATUS if isinstance(error, kind)), EXIT_PROBLEM)


def _default_uri(steps: int) -> str:
    """A fresh local run directory, so that running the demo again never collides."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{DEFAULT_DEMO_DIR}/run-{stamp}-{os.getpid()}/iter_{steps:07d}"


def _add_demo(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a tiny sharded GPT on CPU ranks, save, reload resharded, check",
        description=(
            "Spawn N CPU ranks (gloo), train a small GPT-like model sharded as tensor-parallel x "
            "data-parallel with a distributed Adam, save it to URI, load it back into a different "
            "tensor-parallel layout, check every tensor bit for bit and print a summary: the "
            "checkpoint's URI, its object count as `cloudckpt verify` reports it, and the "
            "`cloudckpt ls` and `cloudckpt verify --deep` commands to look at it."
        ),
    )
    add = parser.add_argument
    add(
        "--uri",
        help=f"checkpoint URI or local path (default: the config's uri, else a new run "
        f"directory, {DEFAULT_DEMO_DIR}/run-<UTC time>/iter_<steps, 7 digits>); s3://, gs:// "
        "and file:// URIs work too (memory:// only with --world-size 1: each rank is a "
        "process, and fsspec's memory store is per process). Credentials and endpoints come "
        "from --config or the environment (AWS_ENDPOINT_URL_S3, AWS_PROFILE, "
        "STORAGE_EMULATOR_HOST, ...)",
    )
    add(
        "--config",
        metavar="YAML",
        help="a training config whose 'cloudckpt' section (or the whole file) sets uri, "
        "storage_options, part_size, max_in_flight and chunk_size",
    )
    add("--world-size", type=int, default=4, help="number of CPU ranks (1-8, default 4)")
    add(
        "--tp",
        type=int,
        help="tensor-parallel size for training and saving (default 2, or 1 for an odd "
        "world size); the data-parallel size is world-size / tp",
    )
    add(
        "--load-tp",
        type=int,
        help="tensor-parallel size of the layout loaded back (default 1, or 2 when --tp is 1 "
        "and the world size is even)",
    )
    add("--steps", type=int, default=10, help="training steps before the save (default 10)")
    add("--seed", type=int, default=1234, help="seed of the weights and data (default 1234)")
    add("--overwrite", action="store_true", help="replace what is stored at the URI")
    add(
        "--resume",
        action="store_true",
        help="treat the URI as a run: continue from its latest committed checkpoint "
        "(cloudckpt.latest; none: start at 0) up to --steps, saving <run>/iter_%%07d; "
        "what a restarted training job does (deploy/k8s)",
    )
    add(
        "--save-interval",
        type=int,
        metavar="N",
        help="with --resume, also save every N steps (default: only after the last)",
    )
    add(
        "--kill-after",
        type=int,
        metavar="ITER",
        help="with --resume, SIGKILL the last rank right after iteration ITER's checkpoint "
        "is saved (fault injection: run again with --resume to see it resume)",
    )
    parser.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    # Imported here so that `cloudckpt --help` and the other subcommands do not pay for
    # torch and the demo model.
    from cloudckpt.config import from_yaml  # noqa: PLC0415
    from cloudckpt.demo.run import (  # noqa: PLC0415
        DemoOptions,
        default_tp_sizes,
        next_step_lines,
        prepare_destination,
        run_demo,
        run_demo_in_process_group,
        validate_options,
    )

    tp, default_load_tp = default_tp_sizes(args.world_size, args.tp)
    load_tp = args.load_tp if args.load_tp is not None else default_load_tp
    try:
        checkpoint = from_yaml(args.config) if args.config else None
    except OSError as exc:
        print(f"cloudckpt demo: error: cannot read --config: {exc}", file=sys.stderr)
        return 2
    uri: str = args.uri or (checkpoint and checkpoint.uri) or _default_uri(args.steps)
    if args.resume and not (args.uri or (checkpoint and checkpoint.uri)):
        uri = uri.rsplit("/", 1)[0]  # a fresh run directory, not its iter_ child
    # under torchrun (deploy/k8s) this process is one rank of its group
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    options = DemoOptions(
        uri=uri,
        world_size=world_size,
        tp=tp,
        load_tp=load_tp,
        steps=args.steps,
        seed=args.seed,
        checkpoint=checkpoint,
        resume=args.resume,
        save_interval=args.save_interval,
        kill_after=args.kill_after,
    )
    try:
        validate_options(options)
    except ValueError as exc:
        print(f"cloudckpt demo: error: {exc}", file=sys.stderr)
        return 2
    if torchrun:
        ran = run_demo_in_process_group(options)
        if ran is None:
            return 0  # rank 0 reports
        result = ran
    else:
        if not args.resume:
            prepare_destination(uri, args.overwrite, checkpoint)
        result = run_demo(options)
    saved = result.checkpoint_uri or uri
    next_steps = next_step_lines(saved, config=args.config)
    print("\n".join(result.summary_lines(saved) + next_steps))
    return 0


# -- options shared by the storage subcommands ---------------------------------------------


def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, VALUE parsed as JSON, else the string). The value never
    appears in an error message: it may be a secret."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            "expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _add_store_options(
    parser: argparse.ArgumentParser, with_json: bool = True, with_progress: bool = False
) -> None:
    add = parser.add_argument
    add(
        "--config",
        metavar="YAML",
        help="a training config whose 'cloudckpt' section (or the whole file) sets "
        "storage_options, part_size and max_in_flight",
    )
    _add_storage_option_flag(
        parser,
        "--storage-option",
        "storage_options",
        "an fsspec storage option (repeatable; VALUE is parsed as JSON when it is JSON, "
        'e.g. endpoint_url=http://127.0.0.1:9000 or client_kwargs=\'{"region_name": '
        '"eu-west-1"}\'); overrides --config and the environment',
    )
    if with_json:
        add("--json", action="store_true", help="print JSON instead of a table")
    if with_progress:
        add(
            "--progress",
            action=argparse.BooleanOptionalAction,
            help="show a progress bar on stderr (default: when stderr is a terminal)",
        )


def _add_storage_option_flag(
    parser: argparse.ArgumentParser, flag: str, dest: str, help_text: str
) -> None:
    parser.add_argument(
        flag,
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        dest=dest,
        help=help_text,
    )


def _show_progress(args: argparse.Namespace) -> bool:
    if args.progress is not None:
        return bool(args.progress)
    return sys.stderr.isatty()


def _library_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``storage_options`` and ``config`` for the library calls, from --storage-option
    and --config.

    Raises:
        UsageError: the config file cannot be read or is invalid.
    """
    config: CheckpointConfig | None = None
    if args.config:
        try:
            config = from_yaml(args.config)
        except OSError as exc:
            raise UsageError(f"cannot read --config: {exc}") from exc
        except ConfigError as exc:
            raise UsageError(f"invalid --config: {exc}") from exc
    options = dict(args.storage_options) or None
    return {"storage_options": options, "config": config}


def _at_least(cast: Callable[[str], float], low: float, what: str) -> Callable[[str], Any]:
    """An argparse type: ``cast(text)``, which must be >= ``low`` (NaN is refused)."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def _target(args: argparse.Namespace) -> str:
    """The URI a command works on, for its JSON error document."""
    names = ("uri", "parent_uri", "src_uri")
    return next((str(getattr(args, n)) for n in names if getattr(args, n, None)), "")


def _print_error(args: argparse.Namespace, exc: BaseException) -> None:
    print(f"cloudckpt {args.command}: error: {redact_uri(str(exc))}", file=sys.stderr)


# -- ls --------------------------------------------------------------------------------------


def _add_ls(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "ls",
        help="list the checkpoints under a prefix",
        description="List every checkpoint directly under PARENT_URI (e.g. s3://bucket/run, "
        "holding iter_0001000, iter_0002000, ...): name, iteration, state (committed, "
        "uncommitted, or foreign: committed by Megatron-Core or PyTorch without a manifest), "
        "size, commit time and writer world size. Nothing stored under PARENT_URI at all is an "
        "error (exit 2); a prefix holding other objects but no checkpoint lists none (exit 0).",
    )
    parser.add_argument("parent_uri", metavar="PARENT_URI", help="prefix holding checkpoints")
    _add_store_options(parser)
    parser.set_defaults(handler=_cmd_ls)


def _require_stored(parent_uri: str, kwargs: dict[str, Any]) -> None:
    """A parent prefix under which nothing is stored (a typo?) is an error, not an empty
    listing; one holding other objects but no checkpoint is listed as empty."""
    if open_checkpoint(parent_uri, **kwargs).is_empty():
        raise CheckpointNotFoundError(
            f"no checkpoint under {redact_uri(parent_uri)!r}: nothing is stored there"
        )


def _cmd_ls(args: argparse.Namespace) -> int:
    kwargs = _library_kwargs(args)
    infos = tracker.list_checkpoints(args.parent_uri, **kwargs)
    if not infos:
        _require_stored(args.parent_uri, kwargs)
    if args.json:
        print(dump_json(ls_records(infos)))
    else:
        print("\n".join(ls_lines(args.parent_uri, infos)))
    return 0


# -- inspect ---------------------------------------------------------------------------------


def _add_inspect(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="show a checkpoint's tensors, common keys and writer",
        description="Show a committed checkpoint: backends, writer world size, commit time, "
        "object count and size, every tensor (key, global shape, dtype, chunk shape) and the "
        "common-state keys. A cloudckpt checkpoint is described by its manifest alone; one "
        "written by Megatron-Core or PyTorch (no manifest) by its tensor metadata and common "
        "state. An uncommitted checkpoint is an error (exit 1); no checkpoint at the URI "
        "too (exit 2).",
    )
    parser.add_argument("uri", metavar="URI", help="checkpoint URI or local path")
    _add_store_options(parser)
    parser.set_defaults(handler=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    description = describe(args.uri, **_library_kwargs(args))
    if args.json:
        print(dump_json(description.to_dict()))
    else:
        print("\n".join(inspect_lines(description)))
    return 0


# -- verify ----------------------------------------------------------------------------------


def _add_verify(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check a checkpoint against its manifest",
        description="Check that a checkpoint is committed and consistent with its manifest: "
        "every listed object present with its size, no orphan objects, no open multipart "
        "uploads; with --deep also the CRC-32C of every object's bytes. Exit status, as for "
        "every command (cloudckpt --help): 0 consistent; 1 inconsistent (uncommitted or "
        "problems found); 2 no checkpoint at the URI, store unreachable, credentials refused "
        "or missing, or bad arguments.",
    )
    parser.add_argument("uri", metavar="URI", help="checkpoint URI or local path")
    parser.add_argument(
        "--deep", action="store_true", help="read every object back and compare its CRC-32C"
    )
    _add_store_options(parser, with_progress=True)
    parser.set_defaults(handler=_cmd_verify)


def _cmd_verify(args: argparse.Namespace) -> int:
    if not args.verbose:  # the report printed says what the checker would warn about
        logging.getLogger(checker.__name__).setLevel(logging.ERROR)
    kwargs = _library_kwargs(args)
    show = args.deep and _show_progress(args)
    total = manifest_size(args.uri, **kwargs) if show else None
    with progress_bar(show, "verify", "B", total) as progress:
        report = checker.verify(args.uri, args.deep, progress=progress, **kwargs)
    print(dump_json(report.to_dict()) if args.json else "\n".join(verify_lines(report)))
    return EXIT_OK if report.ok else EXIT_PROBLEM


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
        help="tensor MiB read and written at once (default 1024; a larger tensor is its own "
        "batch)",
    )
    _add_storage_option_flag(
        parser,
        "--dst-storage-option",
        "dst_storage_options",
        "a storage option for the destination only (repeatable; overrides --storage-option "
        "there)",
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


_SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _add_ls,
    _add_inspect,
    _add_verify,
    _add_gc,
    _add_rm,
    _add_convert,
    _add_demo,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="cloudckpt",
        description="Sharded PyTorch checkpoints on object storage and local disks.",
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``cloudckpt`` command line.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status, the same contract for every subcommand (:data:`EXIT_STATUS_HELP`):
        0 success; 1 a checkpoint problem found; 2 usage error, no checkpoint at the URI,
        unreachable store or refused credentials.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Handler = args.handler
    try:
        return handler(args)
    except (CheckpointingException, UsageError, OSError, ValueError) as exc:
        _print_error(args, exc)
        if getattr(args, "json", False):
            print(dump_json({"uri": _target(args), "ok": False, "error": str(exc)}))
        return exit_status(exc)
    except KeyboardInterrupt:
        print(f"cloudckpt {args.command}: interrupted", file=sys.stderr)
        return 130
