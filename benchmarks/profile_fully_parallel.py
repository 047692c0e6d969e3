"""Profile a fully parallel save and load against the plain ones, per rank and per phase.

Runs the ``cloudckpt bench`` workload (:mod:`cloudckpt.bench.workload`: a GPT-like
state, TP 2 x DP 2 on 4 ranks, bf16 weights replicated across DP, fp32 optimizer
states sharded) on local CPU gloo ranks, against a local directory, with the torch_dist
backend. Every round saves and loads plainly, then through
``FullyParallelSaveStrategyWrapper`` / ``FullyParallelLoadStrategyWrapper`` over the
data-parallel group (the same wrapper objects for the whole run; with
``--cache``, the default, ``do_cache_distribution=True``, as Megatron-LM passes
``ckpt_assume_constant_structure``): round 1's fully parallel save and load compute
their distribution (``fp-first``), the later rounds' may reuse it (``fp-later``).

Per rank and per label, it records the wall and CPU (``time.process_time``) seconds
of each phase (the functions probed below; a phase missing from the code is skipped),
the bytes this rank's sharded strategy wrote (its write results: the coordinator's
``.metadata`` included), and, with ``--cprofile DIR``, a cProfile (CPU timer) per rank
and label, dumped as ``DIR/rank{r}-{label}-{save|load}.prof``; the top functions of
rank 0's are printed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_fully_parallel.py --size 512MiB
    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_fully_parallel.py --size 2GiB \
        --repeat 2 --cprofile /tmp/fp-prof

Printed per label and phase: the slowest rank's wall time, the mean and the largest CPU
per rank (the measure on a shared machine: wall time is noisy; the largest is the
critical path where ranks do not share cores), and calls per rank; then the bytes
written per rank (the balance). Times are summed over the rounds of a label and divided
by their number.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from cloudckpt.bench.phases import _dp_group, _replicas_kept
from cloudckpt.bench.workload import build_state, load_target, plan_workload
from cloudckpt.cli_bench import parse_size
from cloudckpt.config import CheckpointConfig
from cloudckpt.launch import run_on_ranks
from cloudckpt.mapping import StateDict
from cloudckpt.serialization import get_default_save_sharded_strategy
from cloudckpt.strategies import fully_parallel
from cloudckpt.strategies.base import StrategyAction, get_default_strategy
from cloudckpt.tracker import remove_checkpoint

# (module or class path, attribute, phase label)
_PROBES: tuple[tuple[str, str, str], ...] = (
    ("cloudckpt.session:SaveSession", "_prepare", "session.prepare+validate"),
    ("cloudckpt.session:SaveSession", "_commit", "session.commit"),
    (
        "cloudckpt.strategies.fully_parallel:FullyParallelSaveStrategyWrapper",
        "apply_saving_parallelization",
        "fp.distribute (all)",
    ),
    (
        "cloudckpt.strategies.fully_parallel",
        "determine_main_replica_uniform_distribution",
        "fp.determine (gather+plan)",
    ),
    ("cloudckpt.strategies.fully_parallel", "_gather_shard_metadata", "fp.gather metadata"),
    ("cloudckpt.strategies.fully_parallel", "_check_group_replicas", "fp.check in group"),
    ("cloudckpt.strategies.fully_parallel", "_validate_distributed", "fp.validate (world)"),
    ("cloudckpt.strategies.fully_parallel:_DistributionCache", "reusable", "fp.cache check"),
    (
        "cloudckpt.strategies.fully_parallel",
        "distribute_main_replicas_with_precomputed_distribution",
        "fp.apply replica ids",
    ),
    (
        "cloudckpt.strategies.torch:TorchDistSaveShardedStrategy",
        "save_to",
        "base.save_to (plan+write)",
    ),
    (
        "cloudckpt.strategies.fully_parallel:FullyParallelLoadStrategyWrapper",
        "apply_loading_parallelization",
        "fp.load distribute",
    ),
    (
        "cloudckpt.strategies.torch:TorchDistLoadShardedStrategy",
        "load_from",
        "base.load_from (read)",
    ),
    ("cloudckpt.strategies.fully_parallel", "exchange_by_distribution", "fp.exchange tensors"),
    (
        "cloudckpt.strategies.fully_parallel:FullyParallelLoadStrategyWrapper",
        "_exchange",
        "fp.exchange tensors",
    ),
    (
        "cloudckpt.strategies.fully_parallel",
        "exchange_loaded_objects_gather_object",
        "fp.exchange objects",
    ),
)


@dataclass
class _Phase:
    wall: float = 0.0
    cpu: float = 0.0
    calls: int = 0


@dataclass
class _Recorder:
    """Per label (``plain-save``, ``fp-first-save``, ...): phases and bytes written."""

    label: str = ""
    phases: dict[str, dict[str, _Phase]] = field(default_factory=dict)
    written: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rounds: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def phase(self, name: str) -> _Phase:
        return self.phases.setdefault(self.label, {}).setdefault(name, _Phase())


_RECORDER = _Recorder()


def _resolve(path: str) -> Any:
    module_name, _, class_name = path.partition(":")
    module = __import__(module_name, fromlist=["_"])
    return getattr(module, class_name) if class_name else module


def _install_probes() -> None:
    """Wrap every probed function that exists with a wall/CPU timer (in this process)."""
    for path, attribute, label in _PROBES:
        owner = _resolve(path)
        raw = owner.__dict__.get(attribute) if isinstance(owner, type) else None
        original = getattr(owner, attribute, None)
        if original is None:
            continue
        static = isinstance(raw, staticmethod)
        target = raw.__func__ if static else (raw if raw is not None else original)
        wrapped = _timed_function(target, label)
        setattr(owner, attribute, staticmethod(wrapped) if static else wrapped)
    strategy = _resolve("cloudckpt.strategies.torch:TorchDistSaveShardedStrategy")
    save_to = strategy.save_to

    def counting_save_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        results = save_to(self, *args, **kwargs)
        _RECORDER.written[_RECORDER.label] += sum(r.size for r in results)
        return results

    strategy.save_to = counting_save_to


def _timed_function(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            phase = _RECORDER.phase(label)
            phase.wall += time.perf_counter() - wall
            phase.cpu += time.process_time() - cpu
            phase.calls += 1

    return timed


@contextlib.contextmanager
def _measured(label: str, profile_dir: str | None, rank: int) -> Iterator[None]:
    """Time the block as ``label``'s ``total`` (from a barrier to a barrier) and, with
    ``profile_dir``, profile it (CPU timer) into ``rank{rank}-{label}.prof``."""
    _RECORDER.label = label
    _RECORDER.rounds[label] += 1
    profile = cProfile.Profile(time.process_time) if profile_dir else None
    torch.distributed.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    try:
        yield
    finally:
        if profile is not None:
            profile.disable()
        torch.distributed.barrier()
        total = _RECORDER.phase("total (barrier to barrier)")
        total.wall += time.perf_counter() - wall
        total.cpu += time.process_time() - cpu
        total.calls += 1
        if profile is not None and profile_dir is not None:
            path = Path(profile_dir) / f"rank{rank}-{label}.prof"
            if path.exists():  # later rounds of a label: merge
                profile.create_stats()
                merged = pstats.Stats(str(path))
                merged.add(profile)
                merged.dump_stats(str(path))
            else:
                profile.dump_stats(str(path))


def _rank(
    rank: int, world_size: int, size: int, root: str, repeat: int, cache: bool, prof: str | None
) -> dict[str, Any]:
    _install_probes()
    spec = plan_workload(size, world_size)
    state = build_state(spec, rank)
    group = _dp_group(spec, rank)
    config = CheckpointConfig(backend="torch_dist")
    fp_save = fully_parallel.FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), group, do_cache_distribution=cache
    )
    fp_load = fully_parallel.FullyParallelLoadStrategyWrapper(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1),
        group,
        do_cache_distribution=cache,
    )
    _round(rank, spec, state, f"{root}/warm-up", config, None, None, "warm-up", None)
    for number in range(repeat):
        _round(rank, spec, state, f"{root}/plain{number}", config, None, None, "plain", prof)
        label = "fp-first" if number == 0 else "fp-later"
        _round(rank, spec, state, f"{root}/fp{number}", config, fp_save, fp_load, label, prof)
    return {
        "phases": {
            label: {name: vars(phase) for name, phase in phases.items()}
            for label, phases in _RECORDER.phases.items()
        },
        "written": dict(_RECORDER.written),
        "rounds": dict(_RECORDER.rounds),
    }


def _round(
    rank: int,
    spec: Any,
    state: StateDict,
    uri: str,
    config: CheckpointConfig,
    save_strategy: Any,
    load_strategy: Any,
    label: str,
    prof: str | None,
) -> None:
    with _replicas_kept(state), _measured(f"{label}-save", prof, rank):
        cloudckpt.save(state, uri, sharded_strategy=save_strategy, config=config)
    target = load_target(spec, rank)
    with _measured(f"{label}-load", prof, rank):
        loaded = cloudckpt.load(target, uri, load_strategy, config=config)
    assert isinstance(loaded, dict)
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value.data), key
    torch.distributed.barrier()
    if rank == 0:
        remove_checkpoint(uri)
    torch.distributed.barrier()


def _report(per_rank: list[dict[str, Any]]) -> str:
    lines = []
    labels = [label for label in per_rank[0]["phases"] if not label.startswith("warm-up")]
    for label in labels:
        rounds = per_rank[0]["rounds"][label]
        lines.append(f"\n{label} (mean of {rounds} round(s))")
        lines.append(f"  {'phase':34} {'wall max':>9} {'CPU mean':>9} {'CPU max':>9} {'calls':>6}")
        names = per_rank[0]["phases"][label]
        for name in names:
            found = [r["phases"][label].get(name) for r in per_rank]
            phases = [p for p in found if p is not None]
            wall = max(p["wall"] for p in phases) / rounds
            cpu = sum(p["cpu"] for p in phases) / len(per_rank) / rounds
            cpu_max = max(p["cpu"] for p in phases) / rounds
            calls = max(p["calls"] for p in phases) / rounds
            lines.append(f"  {name:34} {wall:9.3f} {cpu:9.3f} {cpu_max:9.3f} {calls:6.1f}")
        totals = [
            r["phases"][label]["total (barrier to barrier)"]["cpu"] / rounds for r in per_rank
        ]
        lines.append("  CPU s per rank (total):" + " ".join(f"{t:8.3f}" for t in totals))
        if label.endswith("-save"):
            written = [r["written"].get(label, 0) / rounds / 2**20 for r in per_rank]
            shown = " ".join(f"{w:8.1f}" for w in written)
            lines.append(f"  MiB written per rank: {shown}  (max {max(written):.1f})")
    return "\n".join(lines)


def _top(prof: str, count: int) -> str:
    out = io.StringIO()
    for path in sorted(Path(prof).glob("rank0-*.prof")):
        out.write(f"\n=== {path.name} (CPU, top {count} by tottime)\n")
        pstats.Stats(str(path), stream=out).sort_stats("tottime").print_stats(count)
    return out.getvalue()


def main(argv: list[str] | None = None) -> None:
    """Run the profile and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="512MiB", help="state size (default 512MiB)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2, help="rounds (>= 2 for fp-later)")
    parser.add_argument("--dir", default=None, help="local directory (default: a temporary)")
    parser.add_argument(
        "--no-cache", action="store_true", help="do_cache_distribution=False (recompute)"
    )
    parser.add_argument("--cprofile", default=None, help="dump cProfiles per rank here")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile")
    args = parser.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="cloudckpt-fp-profile-")
    if args.cprofile:
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
        for old in Path(args.cprofile).glob("rank*.prof"):
            old.unlink()
    run = f"{root}/run-{uuid.uuid4().hex[:6]}"
    try:
        per_rank = run_on_ranks(
            _rank,
            args.world_size,
            (parse_size(args.size), run, args.repeat, not args.no_cache, args.cprofile),
            timeout_s=3600,
        )
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    spec = plan_workload(parse_size(args.size), args.world_size)
    print(
        f"{args.size}: {spec.total_bytes / 2**20:.0f} MiB state, tp {spec.tp} x dp {spec.dp}, "
        f"hidden {spec.hidden}, layers {spec.layers}, cache {not args.no_cache}"
    )
    print(_report(per_rank))
    if args.cprofile:
        print(_top(args.cprofile, args.top))


if __name__ == "__main__":
    main()
