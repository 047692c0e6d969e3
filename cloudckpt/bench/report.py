"""``cloudckpt bench``'s figures: gathered from the ranks, as a table, JSON and a PNG.

Throughputs are the checkpoint's bytes (each replicated tensor counted once) over the
slowest rank's time. Ratios compare throughputs (1.0: as fast as the raw limit; for
``*_fully_parallel_over_plain``, as fast as the plain save or load), except the
``async_blocking*_over_copy`` ones, which compare times (1.0: the training loop blocks
only as long as one copy of its state to host memory takes).

Where the time goes: each timed phase's CPU seconds, of the rank processes together and
of the store's process when it runs on this host (its pid known), and ``busy``, their sum
over wall time x this host's cores (near 1.0: the phase is bound by this host's CPUs,
not by the store's limit or the network).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from cloudckpt.bench.clock import busy
from cloudckpt.bench.workload import WorkloadSpec
from cloudckpt.storage import MissingDependencyError

MB = 1e6
MiB = 2**20

# cloudckpt's phase, the raw phase(s) it is compared with, and the ratio's name
_LOCAL_RATIOS = (
    ("save", "raw_write", "save_over_raw_write"),
    ("load", "raw_read", "load_over_raw_read"),
    ("save", "torch_save", "save_over_torch_save"),
    ("load", "torch_load", "load_over_torch_load"),
)
_S3_RATIOS = (
    ("save", "raw_put", "save_over_raw_put"),
    ("load", "raw_get", "load_over_raw_get"),
)
# measured with --fully-parallel: the wrapped save and load against the plain ones
_PARALLEL_RATIOS = (
    ("save_fully_parallel", "save", "save_fully_parallel_over_plain"),
    ("load_fully_parallel", "load", "load_fully_parallel_over_plain"),
)
# async blocking phases (--constant-structure adds the first and later saves)
_BLOCKING = ("async_blocking", "async_blocking_first", "async_blocking_later")


def summarize(
    spec: WorkloadSpec,
    ranks: Sequence[dict[str, Any]],
    *,
    uri: str,
    backend: str,
    crt: bool,
    part_size: int,
    max_in_flight: int,
) -> dict[str, Any]:
    """Every figure of a run, JSON-able: the ranks' figures gathered and the ratios."""
    total = spec.total_bytes
    phases = sorted({phase for r in ranks for phase in r["seconds"]})
    seconds = {p: max(r["seconds"][p] for r in ranks) for p in phases}
    throughput = {p: total / s / MB for p, s in seconds.items() if not p.startswith("async_b")}
    throughput.pop("copy_to_host", None)
    best = _best_raw(throughput)
    throughput.update({kind: throughput[name] for kind, name in best.items()})
    cpu = _cpu_figures(ranks, seconds, best)
    s3 = "raw_put" in best
    ratios = {
        name: throughput[ours] / throughput[theirs]
        for ours, theirs, name in (*(_S3_RATIOS if s3 else _LOCAL_RATIOS), *_PARALLEL_RATIOS)
        if ours in throughput and theirs in throughput
    }
    ratios.update(
        {
            f"{phase}_over_copy": seconds[phase] / seconds["copy_to_host"]
            for phase in _BLOCKING
            if phase in seconds
        }
    )
    requests = sorted({phase for r in ranks for phase in r["requests"]})
    loads = sorted({phase for r in ranks for phase in r.get("reads", {})})
    return {
        "uri": uri,
        "backend": backend,
        "world_size": spec.world_size,
        "workload": {
            "tp": spec.tp,
            "dp": spec.dp,
            "hidden": spec.hidden,
            "layers": spec.layers,
            "params": spec.params,
            "total_bytes": total,
            "state_bytes_per_rank": [r["state_bytes"] for r in ranks],
            "share_bytes_per_rank": [r["share_bytes"] for r in ranks],
        },
        "seconds": seconds,
        "mb_per_s": throughput,
        **cpu,
        "raw_best": best,
        "ratios": ratios,
        "peak_rss_bytes": {
            phase: [r["peak_rss"][phase] for r in ranks] for phase in ranks[0]["peak_rss"]
        },
        "peak_rss_per_phase": all(r["rss_reset"] for r in ranks),
        # how far each phase's peak rose above the resident memory when it started
        "peak_rss_growth_bytes": {
            phase: [r["rss_growth"][phase] for r in ranks] for phase in ranks[0]["rss_growth"]
        },
        # bound for a sync save: state + part_size x max_in_flight + 64 MiB
        "sync_save_rss_bound_bytes": [
            r["state_bytes"] + part_size * max_in_flight + 64 * MiB for r in ranks
        ],
        "requests": {p: sum(r["requests"].get(p, 0) for r in ranks) for p in requests},
        "requests_counted": s3,
        # object reads and bytes read by cloudckpt's phases, all ranks (every store)
        "reads": {p: sum(r["reads"].get(p, 0) for r in ranks) for p in loads},
        "bytes_read": {p: sum(r["bytes_read"].get(p, 0) for r in ranks) for p in loads},
        "objects": dict(ranks[0]["objects"]),
        "crt_available": crt,
        # raw settings that failed (the optional CRT client), by setting, per rank
        "raw_errors": {
            name: [r["errors"].get(name) for r in ranks]
            for name in sorted({n for r in ranks for n in r["errors"]})
        },
    }


def _cpu_figures(
    ranks: Sequence[dict[str, Any]], seconds: dict[str, float], best: dict[str, str]
) -> dict[str, Any]:
    """CPU seconds per phase (every rank's together; the store's, measured on rank 0),
    and how busy they kept this host's cores; the best raw settings under their kind."""
    phases = {p for r in ranks for p in r["cpu"]}
    clients = {p: sum(r["cpu"].get(p, 0.0) for r in ranks) for p in phases}
    server = dict(ranks[0]["server_cpu"])
    for kind, name in best.items():
        for figures in (clients, server):
            if name in figures:
                figures[kind] = figures[name]
    cores = os.cpu_count() or 1
    shares = {
        p: busy(clients[p], server.get(p), seconds[p], cores)
        for p in clients
        if p in seconds and seconds[p] > 0
    }
    return {
        "cpu_seconds": clients,
        "server_cpu_seconds": server,
        "host_cpus": cores,
        "busy": shares,
    }


def _best_raw(throughput: dict[str, float]) -> dict[str, str]:
    """The fastest client setting of each raw S3 phase (``raw_put[boto3 x64]``, ...)."""
    best: dict[str, str] = {}
    for kind in ("raw_put", "raw_get"):
        names = [name for name in throughput if name.startswith(kind + "[")]
        if names:
            best[kind] = max(names, key=lambda name: throughput[name])
    return best


_ORDER = (
    "copy_to_host",
    "raw_write",
    "raw_put",
    "save",
    "save_fully_parallel",
    "raw_read",
    "raw_get",
    "load",
    "load_fully_parallel",
    "torch_save",
    "torch_load",
    "async_blocking",
    "async_blocking_first",
    "async_blocking_later",
    "async_total",
)


def _phase_order(phase: str) -> tuple[int, str]:
    """Where a phase goes in the table (``raw_put[...]`` beside ``raw_put``)."""
    base = phase.split("[", maxsplit=1)[0]
    return (_ORDER.index(base) if base in _ORDER else len(_ORDER), phase)


def table_lines(summary: dict[str, Any]) -> list[str]:
    """The run as a table: phase, seconds, MB/s, and the ratios."""
    work = summary["workload"]
    lines = [
        f"cloudckpt bench: {work['total_bytes'] / MiB:.1f} MiB on {summary['world_size']} ranks "
        f"(TP {work['tp']} x DP {work['dp']}, hidden {work['hidden']}, {work['layers']} layers), "
        f"backend {summary['backend']}, at {summary['uri']}",
        f"{'phase':<26}{'seconds':>10}{'MB/s':>10}{'CPU s':>8}{'store':>8}{'busy':>6}"
        f"{'requests':>10}",
    ]
    for phase in sorted(summary["seconds"], key=_phase_order):
        secs = summary["seconds"][phase]
        cells = (
            _cell(summary["mb_per_s"].get(phase), 10, ".1f"),
            _cell(summary["cpu_seconds"].get(phase), 8, ".2f"),
            _cell(summary["server_cpu_seconds"].get(phase), 8, ".2f"),
            _cell(summary["busy"].get(phase), 6, ".2f"),
        )
        count = summary["requests"].get(phase)
        counted = f"{count:10d}" if count is not None and summary["requests_counted"] else ""
        lines.append(f"{phase:<26}{secs:10.3f}{''.join(cells)}{counted}")
    lines.append(
        f"CPU s: the {summary['world_size']} rank processes together; store: the store's "
        f"process (where its pid is known); busy: their sum / (seconds x "
        f"{summary['host_cpus']} cores)"
    )
    reads = summary.get("reads", {})
    loads = [p for p in sorted(reads, key=_phase_order) if p.startswith("load")]
    if loads:
        lines.append(
            "objects read / MB read, all ranks: "
            + "; ".join(f"{p} {reads[p]} / {summary['bytes_read'][p] / MB:.1f}" for p in loads)
        )
    lines.append("ratios (throughput, cloudckpt / raw; async: blocking time / copy time):")
    lines += [f"  {name:<30}{value:6.2f}" for name, value in summary["ratios"].items()]
    rss = summary["peak_rss_bytes"]
    lines.append(
        "peak RSS per rank (MiB): "
        + "; ".join(
            f"{phase} " + " ".join(f"{b / MiB:.0f}" for b in per_rank)
            for phase, per_rank in rss.items()
        )
    )
    growth = summary["peak_rss_growth_bytes"].get("save")
    if growth:
        bound = summary["sync_save_rss_bound_bytes"]
        lines.append(
            "save: peak RSS above its start per rank (MiB): "
            + " ".join(f"{b / MiB:.0f}" for b in growth)
            + "; bound state + part x in flight + 64 MiB: "
            + " ".join(f"{b / MiB:.0f}" for b in bound)
        )
    if summary["objects"]:
        lines.append(
            "objects in the checkpoint: "
            + "; ".join(f"{phase} {count}" for phase, count in sorted(summary["objects"].items()))
        )
    if not summary["crt_available"] and summary["requests_counted"]:
        lines.append("awscrt not importable: the CRT transfer client not measured")
    for name, per_rank in summary["raw_errors"].items():
        lines.append(f"raw {name} failed: {next(e for e in per_rank if e)}")
    return lines


def _cell(value: float | None, width: int, spec: str) -> str:
    """A right-aligned table cell, blank for a figure not measured."""
    return f"{value:{width}{spec}}" if value is not None else " " * width


def require_matplotlib() -> None:
    """Raise :class:`MissingDependencyError` unless matplotlib is installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError(
            "--plot needs matplotlib: pip install 'cloudckpt[bench]' (or matplotlib>=3.8)",
            "bench",
        )


def plot(summary: dict[str, Any], path: str) -> None:
    """A bar chart of the throughputs to ``path`` (PNG).

    Raises:
        MissingDependencyError: matplotlib is not installed (the ``bench`` extra).
    """
    require_matplotlib()
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rates = summary["mb_per_s"]
    names = sorted((n for n in rates if n not in summary["raw_best"]), key=_phase_order)
    values = [rates[n] for n in names]
    colors = ["tab:blue" if n.startswith(("save", "load", "async")) else "tab:gray" for n in names]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.9 * len(names)), 4.5))
    bars = axes.bar(names, values, color=colors)
    axes.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=8)
    axes.set_yscale("log")
    axes.set_ylabel("MB/s (log scale)")
    work = summary["workload"]
    axes.set_title(
        f"cloudckpt bench: {work['total_bytes'] / MiB:.0f} MiB, {summary['world_size']} ranks, "
        f"{summary['backend']}\nblue: cloudckpt, grey: raw limit",
        fontsize=10,
    )
    axes.tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
