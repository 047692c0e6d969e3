"""``cloudckpt demo``: the subcommand's parser and handler.

It trains a tiny sharded GPT on CPU ranks, saves it, reloads it resharded and checks it
(:mod:`cloudckpt.demo`). Only the handler imports the demo, so that ``cloudckpt --help``
and the other subcommands do not pay for torch. Registered by :mod:`cloudckpt.cli`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from cloudckpt.cli_options import Subparsers

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
    from cloudckpt.demo.options import DemoOptions, validate_options  # noqa: PLC0415
    from cloudckpt.demo.report import next_step_lines  # noqa: PLC0415
    from cloudckpt.demo.run import (  # noqa: PLC0415
        default_tp_sizes,
        prepare_destination,
        run_demo,
        run_demo_in_process_group,
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
