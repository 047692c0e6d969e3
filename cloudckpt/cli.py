"""The ``cloudckpt`` command line.

Each subcommand is one ``_add_<name>`` function that registers its parser and sets
``handler`` to a ``(argparse.Namespace) -> int`` function; adding a subcommand means
adding that function to :data:`_SUBCOMMANDS`. Handlers return the exit status; a
:class:`~cloudckpt.errors.CheckpointingException` escaping a handler is printed
without a traceback and exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from cloudckpt.errors import CheckpointingException

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction is private

DEFAULT_DEMO_DIR = "./cloudckpt-demo"


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
            "tensor-parallel layout, check every tensor bit for bit and print a summary."
        ),
    )
    add = parser.add_argument
    add(
        "--uri",
        help=f"checkpoint URI or local path (default: the config's uri, else a new run "
        f"directory, {DEFAULT_DEMO_DIR}/run-<UTC time>/iter_<steps, 7 digits>); s3://, gs://, "
        "file:// and other fsspec URIs work too. Credentials and endpoints come from --config "
        "or the environment (AWS_ENDPOINT_URL_S3, AWS_PROFILE, STORAGE_EMULATOR_HOST, ...)",
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
    parser.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    # Imported here so that `cloudckpt --help` and the other subcommands do not pay for
    # torch and the demo model.
    from cloudckpt.config import from_yaml  # noqa: PLC0415
    from cloudckpt.demo.run import (  # noqa: PLC0415
        DemoOptions,
        default_tp_sizes,
        prepare_destination,
        run_demo,
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
    options = DemoOptions(
        uri=uri,
        world_size=args.world_size,
        tp=tp,
        load_tp=load_tp,
        steps=args.steps,
        seed=args.seed,
        checkpoint=checkpoint,
    )
    try:
        validate_options(options)
    except ValueError as exc:
        print(f"cloudckpt demo: error: {exc}", file=sys.stderr)
        return 2
    prepare_destination(uri, args.overwrite, checkpoint)
    result = run_demo(options)
    print("\n".join(result.summary_lines(uri)))
    return 0


_SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (_add_demo,)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="cloudckpt",
        description="Sharded PyTorch checkpoints on object storage and local disks.",
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
        The exit status: 0 on success, 1 when the command failed, 2 on bad usage.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Handler = args.handler
    try:
        return handler(args)
    except CheckpointingException as exc:
        print(f"cloudckpt {args.command}: error: {exc}", file=sys.stderr)
        return 1
