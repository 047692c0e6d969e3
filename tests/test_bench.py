"""``cloudckpt bench``: tiny real runs (2 ranks, a few MiB) on a local directory and on
SeaweedFS, checked for every figure; no timing is asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cloudckpt.bench import clock, report, workload
from cloudckpt.bench.measure import RankFigures
from cloudckpt.bench.workload import (
    build_state,
    load_target,
    local_tensors,
    plan_workload,
    rank_share,
)
from cloudckpt.cli_bench import parse_size
from tests.fixtures_object_stores import S3_CASES, bucket_location, server_for

REPO_ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
SIZE = "6MiB"
CLOUDCKPT_PHASES = ("save", "load", "async_blocking", "async_total", "copy_to_host")
LOCAL_RAW = ("raw_write", "raw_read", "torch_save", "torch_load")
LOCAL_RATIOS = (
    "save_over_raw_write",
    "load_over_raw_read",
    "save_over_torch_save",
    "load_over_torch_load",
    "async_blocking_over_copy",
)
S3_RATIOS = ("save_over_raw_put", "load_over_raw_get", "async_blocking_over_copy")
# the store's real ones only: moto is a poor limit
REAL_S3_CASES = [case for case in S3_CASES if case != "s3-moto"]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", "bench", "--size", SIZE, "--world-size", "2", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _figures(proc: subprocess.CompletedProcess[str], path: Path) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures: dict[str, Any] = json.loads(path.read_text())
    return figures


def _assert_common(figures: dict[str, Any], raw_phases: tuple[str, ...]) -> None:
    work = figures["workload"]
    assert figures["world_size"] == WORLD_SIZE
    assert work["total_bytes"] == sum(work["share_bytes_per_rank"]) > 0
    assert figures["bytes_read"]["load"] > 0 and figures["reads"]["load"] > 0
    assert all(b > 0 for b in work["state_bytes_per_rank"])
    for phase in CLOUDCKPT_PHASES + raw_phases:
        assert figures["seconds"][phase] > 0, phase
    for phase in ("save", "load", "async_total", *raw_phases):
        assert figures["mb_per_s"][phase] > 0, phase
    assert figures["objects"]["save"] > 2  # data, common state and the two commit records
    for phase in ("save", "load", "async_save", "run"):
        per_rank = figures["peak_rss_bytes"][phase]
        assert len(per_rank) == WORLD_SIZE
        assert all(b > 0 for b in per_rank)
    growth = figures["peak_rss_growth_bytes"]
    assert set(growth) == {"save", "load"}
    assert all(len(v) == WORLD_SIZE and min(v) >= 0 for v in growth.values())
    bound = figures["sync_save_rss_bound_bytes"]
    assert [b > s for b, s in zip(bound, work["state_bytes_per_rank"], strict=True)] == [True] * 2
    # where the time went: the ranks' CPU in every timed phase, the host's cores busy
    for phase in ("save", "load", "copy_to_host", *raw_phases):
        assert figures["cpu_seconds"][phase] > 0, phase
        assert figures["busy"][phase] > 0, phase
    assert "async_blocking" not in figures["cpu_seconds"]  # not a span between barriers
    assert figures["host_cpus"] >= 1


def test_bench_local_directory_reports_every_figure_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    base = tmp_path / "bench"
    base.mkdir()
    proc = _bench("--uri", str(base), "--backend", "zarr", "--json", str(out))
    figures = _figures(proc, out)
    _assert_common(figures, LOCAL_RAW)
    assert set(figures["ratios"]) == set(LOCAL_RATIOS)
    assert all(value > 0 for value in figures["ratios"].values())
    assert figures["requests_counted"] is False  # local files: no requests
    assert figures["server_cpu_seconds"] == {}  # no store process
    assert figures["backend"] == "zarr"
    assert "save_over_raw_write" in proc.stdout and "MB/s" in proc.stdout
    assert list(base.iterdir()) == []  # the run's checkpoints and raw files removed


def test_bench_fully_parallel_and_constant_structure_report_their_figures(
    tmp_path: Path,
) -> None:
    """3 ranks: TP 1 x DP 3, every model tensor replicated 3 times. The runner checks
    every loaded tensor against the saved one (a mismatch fails the run)."""
    out = tmp_path / "figures.json"
    base = tmp_path / "bench"
    base.mkdir()
    proc = _bench(
        "--uri",
        str(base),
        "--world-size",
        "3",
        "--fully-parallel",
        "--constant-structure",
        "--json",
        str(out),
    )
    figures = _figures(proc, out)
    assert figures["workload"]["dp"] == 3
    seconds, rates, ratios = figures["seconds"], figures["mb_per_s"], figures["ratios"]
    for phase in ("save_fully_parallel", "load_fully_parallel"):
        assert seconds[phase] > 0 and rates[phase] > 0, phase
    assert ratios["save_fully_parallel_over_plain"] > 0
    assert ratios["load_fully_parallel_over_plain"] > 0
    assert figures["objects"]["save_fully_parallel"] > 2
    # each replicated shard read by one replica instead of three
    reads = figures["bytes_read"]
    assert 0 < reads["load_fully_parallel"] < reads["load"]
    for phase in ("async_blocking_first", "async_blocking_later"):
        assert seconds[phase] > 0, phase
        assert ratios[f"{phase}_over_copy"] > 0, phase
    assert "save_fully_parallel_over_plain" in proc.stdout
    assert "async_blocking_later" in proc.stdout
    assert list(base.iterdir()) == []


def test_bench_constant_structure_needs_torch_dist(tmp_path: Path) -> None:
    proc = _bench("--uri", str(tmp_path), "--backend", "zarr", "--constant-structure")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--constant-structure needs --backend torch_dist" in proc.stderr


@pytest.fixture(params=REAL_S3_CASES)
def real_s3_bucket(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any], int | None]:
    """A fresh bucket: URI, storage options, and the server's pid (None: external)."""
    uri, options = bucket_location(request, request.param)
    server = server_for(request, request.param).process
    return uri, options, None if server is None else server.process.pid


def test_bench_on_s3_counts_requests_of_save_load_and_the_raw_limit(
    real_s3_bucket: tuple[str, dict[str, Any], int | None], tmp_path: Path
) -> None:
    uri, options, pid = real_s3_bucket
    flags = [
        f"--storage-option={key}={json.dumps(value) if not isinstance(value, str) else value}"
        for key, value in options.items()
    ]
    if pid is not None:
        flags.append(f"--server-pid={pid}")
    out = tmp_path / "figures.json"
    proc = _bench("--uri", f"{uri}/bench", "--json", str(out), *flags)
    figures = _figures(proc, out)
    best = figures["raw_best"]
    _assert_common(figures, (best["raw_put"], best["raw_get"]))
    if pid is not None:
        # the store's CPU is counted in clock ticks (10 ms): one phase of a few MiB may
        # cost less than a tick, the whole run does not
        phases = ("save", "load", "raw_put", "raw_get", best["raw_put"], best["raw_get"])
        store = figures["server_cpu_seconds"]
        assert all(store[phase] >= 0 for phase in phases), store
        assert sum(store[phase] for phase in phases) > 0, store
        assert figures["cpu_seconds"]["raw_put"] == figures["cpu_seconds"][best["raw_put"]]
    assert set(figures["ratios"]) == set(S3_RATIOS)
    assert figures["backend"] == "torch_dist"
    requests = figures["requests"]
    assert figures["requests_counted"] is True
    # every object of the checkpoint went up in at least one request
    assert requests["save"] >= figures["objects"]["save"]
    assert requests["async_total"] >= figures["objects"]["save"]
    assert requests["load"] >= WORLD_SIZE  # every rank read its shards
    for setting in ("boto3 x16", "boto3 x64 8MiB", "boto3 x1 128MiB"):
        # one object per rank: a PUT (or a multipart upload), then HEAD + ranged GETs
        assert requests[f"raw_put[{setting}]"] >= WORLD_SIZE
        assert requests[f"raw_get[{setting}]"] >= 2 * WORLD_SIZE


def test_bench_server_pid_needs_uri(tmp_path: Path) -> None:
    proc = _bench("--server-pid", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--server-pid names the process of the store at --uri" in proc.stderr


def test_bench_server_pid_must_be_a_process_here(tmp_path: Path) -> None:
    proc = _bench("--uri", str(tmp_path), "--server-pid", str(2**31 - 1))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--server-pid {2**31 - 1}: no such process on this host" in proc.stderr


def test_process_cpu_seconds_of_a_busy_process_grows() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        first = clock.process_cpu_seconds(child.pid)
        assert first is not None
        deadline = time.monotonic() + 30
        while (now := clock.process_cpu_seconds(child.pid)) is not None and now < first + 0.2:
            assert time.monotonic() < deadline, (first, now)
            time.sleep(0.05)
        assert now is not None and now >= first + 0.2
    finally:
        child.kill()
        child.wait()
    assert clock.process_cpu_seconds(child.pid) is None  # reaped: gone


def test_cpu_of_stat_reads_past_a_command_name_with_spaces_and_parentheses() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    rest = " ".join(["S", *["0"] * 10, str(3 * ticks), str(ticks), *["0"] * 30])
    assert clock.cpu_of_stat(f"42 (weed) x) {rest}") == 4.0
    assert clock.cpu_of_stat("42 (weed) S 1 2") is None  # truncated


def test_rank_figures_keep_the_cpu_of_the_best_round() -> None:
    figures = RankFigures()
    figures.record_span("load", clock.Span(2.0, 1.5, 0.5))
    figures.record_span("load", clock.Span(1.0, 0.75, None))  # best: its CPU, no store
    figures.record_span("load", clock.Span(3.0, 9.0, 9.0))
    assert figures.seconds == {"load": 1.0}
    assert figures.cpu == {"load": 0.75}
    assert figures.server_cpu == {}  # the best round's: not measured
    figures.record_span("load", clock.Span(0.5, 0.25, 0.125))
    assert (figures.cpu, figures.server_cpu) == ({"load": 0.25}, {"load": 0.125})


def test_summary_sums_the_ranks_cpu_and_takes_the_store_and_best_raw_settings() -> None:
    spec = plan_workload(8 * 2**20, 2)

    def rank(cpu: dict[str, float], server: dict[str, float]) -> dict[str, Any]:
        seconds = {"save": 2.0, "raw_put[a]": 1.0, "raw_put[b]": 4.0}
        return {
            "seconds": seconds,
            "cpu": cpu,
            "server_cpu": server,
            "requests": {},
            "peak_rss": {"save": 1},
            "rss_growth": {"save": 0},
            "rss_reset": True,
            "state_bytes": 1,
            "share_bytes": 1,
            "objects": {},
            "errors": {},
        }

    cpu = {"save": 1.0, "raw_put[a]": 0.5, "raw_put[b]": 0.25}
    ranks = [rank(cpu, {"save": 3.0, "raw_put[a]": 1.5}), rank(cpu, {"save": 99.0})]
    summary = report.summarize(
        spec, ranks, uri="u", backend="torch_dist", crt=False, part_size=1, max_in_flight=1
    )
    assert summary["cpu_seconds"] == {
        "save": 2.0,
        "raw_put[a]": 1.0,
        "raw_put[b]": 0.5,
        "raw_put": 1.0,  # the fastest setting's (a: 1 s)
    }
    assert summary["server_cpu_seconds"] == {"save": 3.0, "raw_put[a]": 1.5, "raw_put": 1.5}
    cores = summary["host_cpus"]
    assert summary["busy"]["save"] == pytest.approx(5.0 / (2.0 * cores))
    assert summary["busy"]["raw_put[b]"] == pytest.approx(0.5 / (4.0 * cores))
    table = "\n".join(report.table_lines(summary))
    assert "CPU s" in table and "busy" in table


def test_bench_plot_needs_matplotlib_or_draws_a_png(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    proc = _bench("--uri", str(tmp_path), "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "--plot needs matplotlib: pip install 'cloudckpt[bench]'" in proc.stderr
        assert not png.exists()
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * 2**30), ("8MiB", 8 * 2**20), ("100MB", 10**8), ("1.5k", 1536), ("4096", 4096)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "0", "-1MiB", "2 parsecs", "MiB"])
def test_parse_size_refuses_non_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_workload_shares_cover_the_checkpoint_once(world_size: int) -> None:
    spec = plan_workload(8 * 2**20, world_size)
    shares = [rank_share(build_state(spec, r), spec, r) for r in range(world_size)]
    keys = [key for share in shares for key in share]
    assert len(keys) == len(set(keys))
    nbytes = sum(t.numel() * t.element_size() for share in shares for t in share.values())
    assert nbytes == spec.total_bytes
    state = build_state(spec, 0)
    dtypes = {t.dtype for t in local_tensors(state)}
    assert dtypes == {torch.bfloat16, torch.float32}


def test_load_target_is_the_state_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's destination is allocated and written before the load is timed (its
    allocations made non-zero here, so that only writing them passes)."""
    spec = plan_workload(4 * 2**20, 4)
    state = build_state(spec, 1)
    full = torch.full
    monkeypatch.setattr(
        workload.torch, "empty", lambda shape, dtype=None: full(tuple(shape), 7, dtype=dtype)
    )
    target = load_target(spec, 1)
    tensors = local_tensors(target)
    assert [t.shape for t in tensors] == [t.shape for t in local_tensors(state)]
    assert all(not t.any() for t in tensors)
    assert any(t.any() for t in local_tensors(state))


def test_workload_replicas_hold_the_same_values() -> None:
    """Every copy of a shard (same key and offset on several ranks) holds the same
    values: a load of the main replica must equal what every replica saved."""
    spec = plan_workload(4 * 2**20, 4)  # TP 2 x DP 2
    seen: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    copies = 0
    for rank in range(4):
        state = build_state(spec, rank)
        for group in ("model", "optimizer"):
            for item in state[group].values():
                where = (item.key, tuple(item.global_offset))
                if where in seen:
                    copies += 1
                    assert torch.equal(seen[where], item.data), (where, rank)
                seen.setdefault(where, item.data)
    assert copies > 0


def test_compare_runs_the_peers_side_by_side_on_one_workload(tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    peers = "raw,torch.save,dcp fsspec,cloudckpt"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "compare.py"),
            "--size",
            "4MiB",
            "--world-size",
            "2",
            "--targets",
            "local",
            "--peers",
            peers,
            "--json",
            str(out),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["not_run"] == {}
    assert set(result["peers"]) == {f"{peer} @ local" for peer in peers.split(",")}
    for figures in result["peers"].values():
        assert all(figures[k] > 0 for k in ("save_s", "load_s", "save_mb_s", "load_mb_s"))
        # the ranks' CPU in each phase; no store process on local disk
        assert figures["save_cpu_s"] > 0 and figures["load_cpu_s"] > 0
        assert figures["save_store_cpu_s"] is None and figures["load_store_cpu_s"] is None
    assert "dcp fsspec @ local" in proc.stdout and "ckpt/peer save" in proc.stdout
    assert "where the time went" in proc.stdout
