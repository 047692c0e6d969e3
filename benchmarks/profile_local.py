"""Where a local-disk torch_dist save, load and async save spend their time, per rank.

Runs ``cloudckpt bench``'s workload (:mod:`cloudckpt.bench.workload`: a GPT-like state
of ``--size`` bytes, TP x DP replicas) on ``--world-size`` CPU ranks (gloo), and times
on every rank, each phase between two barriers:

  torch_save / torch_load   a plain ``torch.save`` / ``torch.load`` of the rank's
                            share of the bytes (the bench's baseline);
  copy_to_host              one copy of every local tensor (the async target's base);
  save / load               ``cloudckpt.save`` / ``cloudckpt.load`` (torch_dist);
  async_blocking            until ``cloudckpt.save(..., async_sharded_save=True)``
                            returns (the request is then run, untimed).

With ``--collectives``, it only counts and lists cloudckpt's collectives (each one a
check-in round trip in the store, then the backend's own collective) of one save and
one load on every rank, and prints rank 0's list::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_local.py --size 16MiB --collectives

Each phase's wall time and CPU time (``time.process_time``: every thread of the rank)
come from ``--rounds`` unprofiled rounds (the best of each: the machine may be
shared); one more round runs under cProfile, one file per
rank and phase in ``--out`` (``rank<r>-<phase>.prof``, readable with ``pstats``). The
table printed shows wall and CPU per phase for the coordinator (rank 0) and another
rank (``--other``), then, per cloudckpt phase, the functions with the most cumulative
time on both ranks (cloudckpt's own, and the top ``--top`` by own time)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_local.py --size 512MiB
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from cloudckpt.bench import raw
from cloudckpt.bench.workload import (
    build_state,
    load_target,
    local_tensors,
    plan_workload,
    rank_share,
)
from cloudckpt.cli_bench import parse_size
from cloudckpt.launch import run_on_ranks
from cloudckpt.mapping import ShardedTensor, StateDict
from cloudckpt.tracker import remove_checkpoint

PHASES = ("torch_save", "torch_load", "copy_to_host", "save", "load", "async_blocking")


def _barrier() -> None:
    torch.distributed.barrier()


def _broadcast(value: str) -> str:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return str(box[0])


def _phase(fn: Callable[[], object], profile: Path | None) -> tuple[float, float]:
    """(wall, CPU) seconds of ``fn`` between two barriers; profiled into ``profile``."""
    _barrier()
    profiler = cProfile.Profile() if profile is not None else None
    wall, cpu = time.perf_counter(), time.process_time()
    if profiler is not None:
        profiler.enable()
    fn()
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    _barrier()
    if profiler is not None and profile is not None:
        profiler.dump_stats(str(profile))
    return wall, cpu


def _remove(uri: str, rank: int) -> None:
    _barrier()
    if rank == 0:
        remove_checkpoint(uri)
    _barrier()


def _round(
    rank: int, state: StateDict, spec: Any, run: str, out: Path | None
) -> dict[str, tuple[float, float]]:
    """Every phase once; profiles into ``out`` (None: not profiled)."""
    figures: dict[str, tuple[float, float]] = {}

    def prof(phase: str) -> Path | None:
        return out / f"rank{rank}-{phase}.prof" if out is not None else None

    share = rank_share(state, spec, rank)
    pt = raw.local_path(run) / f"share{rank}.pt"
    figures["torch_save"] = _phase(lambda: raw.torch_save(pt, share), prof("torch_save"))
    figures["torch_load"] = _phase(lambda: raw.torch_load(pt), prof("torch_load"))
    pt.unlink()
    tensors = local_tensors(state)
    figures["copy_to_host"] = _phase(
        lambda: [t.detach().to("cpu", copy=True) for t in tensors], prof("copy_to_host")
    )
    ckpt = _broadcast(f"{run}/ckpt-{uuid.uuid4().hex[:6]}" if rank == 0 else "")
    figures["save"] = _phase(lambda: cloudckpt.save(state, ckpt), prof("save"))
    target = load_target(spec, rank)
    figures["load"] = _phase(lambda: cloudckpt.load(target, ckpt), prof("load"))
    target.clear()  # the loaded copy is not kept through the next phase
    _remove(ckpt, rank)
    requests: list[Any] = []
    figures["async_blocking"] = _phase(
        lambda: requests.append(cloudckpt.save(state, f"{ckpt}-a", async_sharded_save=True)),
        prof("async_blocking"),
    )
    requests[0].execute_sync()
    _remove(f"{ckpt}-a", rank)
    return figures


def _warm_up(rank: int, world_size: int, run: str) -> None:
    uri = f"{run}/warm-up"
    tensor = torch.arange(1024, dtype=torch.float32) + rank
    cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world_size))}, uri)
    empty = torch.empty_like(tensor)
    cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", empty, (0, rank, world_size))}, uri)
    _remove(uri, rank)


def profile_rank(
    rank: int, world_size: int, size: int, run: str, out: str, rounds: int
) -> dict[str, tuple[float, float]]:
    """One rank: warm up, ``rounds`` unprofiled rounds (the best wall and the least CPU
    of each phase returned: the machine is shared), then a profiled one."""
    spec = plan_workload(size, world_size)
    state = build_state(spec, rank)
    _warm_up(rank, world_size, run)
    figures: dict[str, tuple[float, float]] = {}
    for _ in range(rounds):
        for phase, (wall, cpu) in _round(rank, state, spec, run, None).items():
            best = figures.get(phase, (wall, cpu))
            figures[phase] = (min(wall, best[0]), min(cpu, best[1]))
    _round(rank, state, spec, run, Path(out))
    return figures


def count_collectives(rank: int, world_size: int, size: int, run: str) -> dict[str, list[str]]:
    """The names of cloudckpt's collectives (check-ins) of one save and one load (after
    a warm-up), on this rank."""
    from cloudckpt import dist_guard  # noqa: PLC0415

    spec = plan_workload(size, world_size)
    state = build_state(spec, rank)
    _warm_up(rank, world_size, run)
    ckpt = _broadcast(f"{run}/ckpt-{uuid.uuid4().hex[:6]}" if rank == 0 else "")
    with dist_guard.recorded_check_ins() as names:
        cloudckpt.save(state, ckpt)
        saved = list(names)
        names.clear()
        cloudckpt.load(load_target(spec, rank), ckpt)
    _remove(ckpt, rank)
    return {"save": saved, "load": list(names)}


def _print_collectives(counted: list[dict[str, list[str]]]) -> None:
    for op in ("save", "load"):
        counts = [len(c[op]) for c in counted]
        print(f"{op}: {counts[0]} collectives (per rank: {counts})")
        for name in counted[0][op]:
            print(f"  {name}")


def _top(path: Path, top: int) -> str:
    """The cloudckpt functions with most cumulative time, then the top by own time."""
    text = io.StringIO()
    stats = pstats.Stats(str(path), stream=text)
    stats.sort_stats("cumulative").print_stats(r"cloudckpt", top)
    stats.sort_stats("tottime").print_stats(top)
    lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.lstrip()[:1].isdigit() or "ncalls" in ln]
    return "\n".join(keep)


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the ranks, print the table and the profiles."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--other", type=int, default=1, help="the other rank shown")
    parser.add_argument("--out", default="", help="profile directory (default: a temp dir)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3, help="unprofiled rounds (best kept)")
    parser.add_argument("--phases", default="save,load,async_blocking")
    parser.add_argument(
        "--collectives", action="store_true", help="only count a save's and a load's collectives"
    )
    args = parser.parse_args(argv)
    if args.collectives:
        base = Path(tempfile.mkdtemp(prefix="cloudckpt-profile-run-"))
        try:
            counted = run_on_ranks(
                count_collectives, args.world_size, (args.size, str(base)), timeout_s=600
            )
        finally:
            shutil.rmtree(base, ignore_errors=True)
        _print_collectives(counted)
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="cloudckpt-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="cloudckpt-profile-run-"))
    try:
        figures = run_on_ranks(
            profile_rank,
            args.world_size,
            (args.size, str(base), str(out), args.rounds),
            timeout_s=3600,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ranks = (0, args.other)
    print(
        f"size {args.size / 2**20:.0f} MiB, {args.world_size} ranks, best of {args.rounds} "
        f"rounds; profiles in {out}"
    )
    print(f"{'phase':16s}" + "".join(f" r{r} wall   r{r} CPU " for r in ranks) + " slowest wall")
    for phase in PHASES:
        cells = "".join(f" {figures[r][phase][0]:8.3f} {figures[r][phase][1]:8.3f}" for r in ranks)
        slowest = max(f[phase][0] for f in figures)
        print(f"{phase:16s}{cells} {slowest:8.3f}")
    for phase in args.phases.split(","):
        for rank in ranks:
            print(f"\n== {phase}, rank {rank} (profiled) ==")
            print(_top(out / f"rank{rank}-{phase}.prof", args.top))


if __name__ == "__main__":
    main()
