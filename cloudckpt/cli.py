"""The ``cloudckpt`` command line.

``ls PARENT_URI`` (checkpoints: committed?, size, time), ``inspect URI`` (tensors, common
keys, writer), ``verify URI [--deep]`` (consistent with its manifest?), ``gc
PARENT_URI --keep-last N [--dry-run]`` (old and uncommitted checkpoints, stale multipart
uploads), ``rm URI``, ``demo`` (train, save, reload resharded on CPU ranks) and
``bench`` (save, load and async save against the raw limit of the store).

The storage subcommands take ``--config YAML`` (a training config: storage options, part
size, in-flight requests) and repeatable ``--storage-option KEY=VALUE`` (VALUE parsed as
JSON when it is JSON); credentials otherwise come from the environment. Tables by
default, ``--json`` for machines, progress bars on stderr when it is a terminal. Nothing
printed carries a secret: URIs are redacted, storage options never echoed.

Each subcommand is one ``_add_<name>`` function that registers its parser and sets
``handler`` to a ``(argparse.Namespace) -> int`` function; adding a subcommand means
adding that function to :data:`_SUBCOMMANDS`. ``ls``, ``inspect`` and ``verify`` are
here, ``gc``, ``rm`` and ``convert`` in :mod:`cloudckpt.cli_modify`, ``demo`` in
:mod:`cloudckpt.cli_demo`, ``bench`` in :mod:`cloudckpt.cli_bench`; the options they
share in :mod:`cloudckpt.cli_options`.
Handlers return the exit status; an error escaping a handler is printed without a
traceback (with ``--json``, also as a JSON document on stdout) and :func:`exit_status` maps
its type to the status, the same for every subcommand (:data:`EXIT_STATUS_HELP`): 0
success; 1 a checkpoint problem found (uncommitted, inconsistent, corrupt, incompatible,
conflicting); 2 usage error, no checkpoint at the URI, unreachable store or refused or
missing credentials; 141 (128 + SIGPIPE) when the reader of stdout went away (``cloudckpt
inspect URI | head -1``), which ends the command quietly, as ``cat`` ends in a pipeline.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
from collections.abc import Callable
from typing import Any

from cloudckpt import checker, tracker
from cloudckpt.cli_bench import _add_bench
from cloudckpt.cli_demo import _add_demo
from cloudckpt.cli_format import (
    describe,
    dump_json,
    inspect_lines,
    ls_lines,
    ls_nested_lines,
    ls_records,
    manifest_size,
    progress_bar,
    verify_lines,
)
from cloudckpt.cli_modify import _add_convert, _add_gc, _add_rm
from cloudckpt.cli_options import (
    Handler,
    Subparsers,
    UsageError,
    _add_store_options,
    _library_kwargs,
    _require_stored,
    _show_progress,
)
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    ConfigError,
    CorruptObjectError,
    InvalidURIError,
    StorageError,
)
from cloudckpt.logfilter import install, install_on_handler
from cloudckpt.redact import redact_text, redact_uri
from cloudckpt.storage import open_checkpoint

EXIT_OK = 0
EXIT_PROBLEM = 1  # a checkpoint problem found
EXIT_UNAVAILABLE = 2  # usage error, no checkpoint at the URI, store unreachable or refused
# the reader of stdout went away (`| head`): the status a shell reports for a process
# killed by SIGPIPE (13), as `cat` or `ls` would be; not 1, which means a checkpoint problem
EXIT_READER_GONE = 128 + 13
NESTED_PREFIXES_LOOKED_AT = 100  # `ls` of a prefix without checkpoints: children searched

# the first entry whose type matches an escaping error gives the exit status
_EXIT_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, EXIT_UNAVAILABLE),
    (ConfigError, EXIT_UNAVAILABLE),
    (InvalidURIError, EXIT_UNAVAILABLE),  # a usage error
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
  141  the reader of the output went away (e.g. `| head -1`): the command stops
     quietly, as one killed by SIGPIPE would
"""


def exit_status(error: BaseException) -> int:
    """The exit status of a command that raised ``error`` (see :data:`EXIT_STATUS_HELP`)."""
    return next((code for kind, code in _EXIT_STATUS if isinstance(error, kind)), EXIT_PROBLEM)


def _target(args: argparse.Namespace) -> str:
    """The URI a command works on, for its JSON error document."""
    names = ("uri", "parent_uri", "src_uri")
    return next((str(getattr(args, n)) for n in names if getattr(args, n, None)), "")


def _print_error(args: argparse.Namespace, exc: BaseException) -> None:
    print(f"cloudckpt {args.command}: error: {redact_text(str(exc))}", file=sys.stderr)


# -- ls --------------------------------------------------------------------------------------


def _add_ls(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "ls",
        help="list the checkpoints under a prefix",
        description="List every checkpoint directly under PARENT_URI (e.g. s3://bucket/run, "
        "holding iter_0001000, iter_0002000, ...): name, iteration, state (committed, "
        "uncommitted, or foreign: committed by Megatron-Core or PyTorch without a manifest), "
        "size, commit time and writer world size. Nothing stored under PARENT_URI at all is an "
        "error (exit 2); a prefix holding other objects but no checkpoint lists none (exit 0), "
        "and names the prefixes one level down that hold checkpoints (a run directory such "
        "as ./cloudckpt-demo, whose checkpoints are in run-*/iter_*).",
    )
    parser.add_argument("parent_uri", metavar="PARENT_URI", help="prefix holding checkpoints")
    _add_store_options(parser)
    parser.set_defaults(handler=_cmd_ls)


def _cmd_ls(args: argparse.Namespace) -> int:
    kwargs = _library_kwargs(args)
    infos = tracker.list_checkpoints(args.parent_uri, **kwargs)
    nested: dict[str, int] = {}
    if not infos:
        _require_stored(args.parent_uri, kwargs)
        nested = _nested_checkpoints(args.parent_uri, kwargs)
    if args.json:  # the list stays the document; where the checkpoints are goes to stderr
        print(dump_json(ls_records(infos)))
        if nested:
            print("\n".join(ls_nested_lines(args.parent_uri, nested)), file=sys.stderr)
    elif nested:
        print("\n".join(ls_nested_lines(args.parent_uri, nested)))
    else:
        print("\n".join(ls_lines(args.parent_uri, infos)))
    return 0


def _nested_checkpoints(parent_uri: str, kwargs: dict[str, Any]) -> dict[str, int]:
    """Child prefix URI -> the number of checkpoints directly under it, for the first
    :data:`NESTED_PREFIXES_LOOKED_AT` children of ``parent_uri`` that hold any (a run
    directory of runs: ``./cloudckpt-demo/run-*/iter_*``)."""
    names = open_checkpoint(parent_uri, **kwargs).list_children()[:NESTED_PREFIXES_LOOKED_AT]
    found: dict[str, int] = {}
    for name in names:
        child = parent_uri.rstrip("/") + "/" + name
        count = len(tracker.list_checkpoints(child, **kwargs))
        if count:
            found[child] = count
    return found


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
        "every listed object present with its size; with --deep also the CRC-32C of every "
        "object's bytes. Foreign objects and open multipart uploads under a committed "
        "checkpoint are listed as notes (problems with --strict). Exit status, as for "
        "every command (cloudckpt --help): 0 consistent; 1 inconsistent (uncommitted or "
        "problems found); 2 no checkpoint at the URI, store unreachable, credentials refused "
        "or missing, or bad arguments.",
    )
    parser.add_argument("uri", metavar="URI", help="checkpoint URI or local path")
    parser.add_argument(
        "--deep", action="store_true", help="read every object back and compare its CRC-32C"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="count what lies under a committed checkpoint's prefix but is not part of it "
        "(foreign objects, open multipart uploads) as problems, not notes",
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
        report = checker.verify(
            args.uri, args.deep, strict=args.strict, progress=progress, **kwargs
        )
    print(dump_json(report.to_dict()) if args.json else "\n".join(verify_lines(report)))
    return EXIT_OK if report.ok else EXIT_PROBLEM


_SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _add_ls,
    _add_inspect,
    _add_verify,
    _add_gc,
    _add_rm,
    _add_convert,
    _add_demo,
    _add_bench,
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


def _configure_logging(verbose: int) -> None:
    """Log to stderr at WARNING, INFO (-v) or DEBUG (-vv), secrets redacted from every
    logger's records (a filter on the handler) and, should the user's own logging
    configuration win, from those of cloudckpt and its clients (:mod:`cloudckpt.logfilter`)."""
    install()
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    handler = install_on_handler(logging.StreamHandler())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    """Run the ``cloudckpt`` command line.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status, the same contract for every subcommand (:data:`EXIT_STATUS_HELP`):
        0 success; 1 a checkpoint problem found; 2 usage error, no checkpoint at the URI,
        unreachable store or refused credentials; 141 the reader of stdout went away.
    """
    try:
        try:
            return _run(argv)
        finally:  # also after --help: a closed pipe fails here, not at the interpreter's exit
            sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_broken():
            raise
        return _reader_gone()


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    handler: Handler = args.handler
    try:
        return handler(args)
    except BrokenPipeError as exc:
        if _stdout_broken():
            raise  # main ends quietly
        return _failed(args, exc)
    except (CheckpointingException, UsageError, OSError, ValueError) as exc:
        return _failed(args, exc)
    except KeyboardInterrupt:
        print(f"cloudckpt {args.command}: interrupted", file=sys.stderr)
        return 130


def _failed(args: argparse.Namespace, exc: BaseException) -> int:
    """Report an error escaping a handler; -> its exit status."""
    _print_error(args, exc)
    if getattr(args, "json", False):
        uri, error = redact_uri(_target(args)), redact_text(str(exc))
        print(dump_json({"uri": uri, "ok": False, "error": error}))
    return exit_status(exc)


def _stdout_broken() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone: the file descriptor
    polls as an error. A BrokenPipeError from elsewhere (a socket of the store is
    translated into a StorageError before it gets here) is then an error like any
    other. Where stdout has no descriptor or poll() is missing, a BrokenPipeError is
    taken to be stdout's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return True
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _reader_gone() -> int:
    """End quietly after the reader of stdout closed it (``| head``): what is still
    buffered goes to /dev/null, so the interpreter's final flush of stdout does not
    print "Exception ignored ... BrokenPipeError" (the recipe of Python's documentation
    for SIGPIPE; SIGPIPE itself stays ignored, so a store's connection closed mid-request
    still raises instead of killing the command)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass  # no descriptor (stdout replaced in-process): nothing is flushed at exit
    return EXIT_READER_GONE
