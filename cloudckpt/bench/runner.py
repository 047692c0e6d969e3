"""What each rank of ``cloudckpt bench`` measures, and the run that gathers it.

Every rank builds its part of the workload (:mod:`.workload`), then, ``repeat`` times
and interleaved (raw, cloudckpt, raw, cloudckpt), times: the raw write, cloudckpt's
save, the raw read, cloudckpt's load, and an async save (the time until
``cloudckpt.save(..., async_sharded_save=True)`` returns, then until the request has
run and committed). Each phase starts and ends with a barrier; its time is the slowest
rank's, with the CPU time each rank process spent in it and, when the store runs on this
host (``server_pid``), the store process's (:mod:`.clock`). Around cloudckpt's phases
each rank records its peak resident memory (Linux: ``VmHWM`` reset through
``/proc/self/clear_refs``; else ``ru_maxrss``, the peak so far) and the storage requests
it issued (cloudckpt's own counters: S3 data requests; local files are not counted), and
for loads the reads and bytes read (on every store).

With ``fully_parallel``, each round also saves with Megatron-Core's
``FullyParallelSaveStrategyWrapper`` and loads with ``FullyParallelLoadStrategyWrapper``
over the workload's data-parallel group, right after the plain save and load of the same
round (plain, fully parallel, plain, ...): phases ``save_fully_parallel`` and
``load_fully_parallel``. With ``constant_structure`` (torch_dist), each round makes two
more async saves through one save strategy kept for the whole run, with
``cached_metadata=True`` (Megatron-Core's ``ckpt_assume_constant_structure``): the
run's first such save plans and validates (``async_blocking_first``); the later ones
reuse the plan and skip the validation of the sharding, as Megatron-LM does
(``async_blocking_later``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import cloudckpt
from cloudckpt.bench import raw
from cloudckpt.bench.clock import Clock, Span
from cloudckpt.bench.workload import (
    WorkloadSpec,
    build_state,
    load_target,
    local_tensors,
    plan_workload,
    rank_share,
)
from cloudckpt.config import CheckpointConfig
from cloudckpt.dict_utils import nested_values
from cloudckpt.launch import run_on_ranks
from cloudckpt.mapping import ShardedTensor, StateDict
from cloudckpt.serialization import get_default_save_sharded_strategy
from cloudckpt.storage import open_checkpoint
from cloudckpt.storage.pool import process_stats
from cloudckpt.strategies.base import LoadShardedStrategy, StrategyAction, get_default_strategy
from cloudckpt.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy
from cloudckpt.tracker import remove_checkpoint

logger = logging.getLogger(__name__)

MB = 1e6


@dataclass(frozen=True)
class BenchOptions:
    """One ``cloudckpt bench`` run.

    Attributes:
        uri: a prefix to write under (a fresh child of it is used and removed after).
        size_bytes: the requested state size (the workload's actual size is close).
        world_size: number of rank processes.
        backend: cloudckpt's sharded backend, ``torch_dist`` or ``zarr``.
        storage_options: fsspec options for the URI (endpoint, credentials).
        repeat: rounds of every phase; each figure is the best round's.
        timeout_s: the longest the ranks may take, all phases together.
        fully_parallel: also save and load with the fully parallel wrappers over the
            data-parallel group, interleaved with the plain save and load.
        constant_structure: also make repeated async saves through one torch_dist
            strategy with ``cached_metadata=True`` (first and later saves timed apart).
        server_pid: the store's process when it runs on this host (``--server``): its
            CPU time in every phase is measured too (rank 0's figure is reported).
    """

    uri: str
    size_bytes: int
    world_size: int = 4
    backend: str = "torch_dist"
    storage_options: dict[str, Any] = field(default_factory=dict)
    repeat: int = 1
    timeout_s: float = 3600.0
    fully_parallel: bool = False
    constant_structure: bool = False
    server_pid: int | None = None

    @property
    def is_s3(self) -> bool:
        """Whether the URI is on S3 (else a local directory)."""
        return self.uri.startswith("s3://")


@dataclass
class RankFigures:
    """What one rank measured: seconds by phase (best round), the CPU seconds of the
    rank process and of the store's process in that round, peak RSS in bytes by phase,
    requests by phase, and objects written by phase (rank 0 only)."""

    server_pid: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    server_cpu: dict[str, float] = field(default_factory=dict)
    peak_rss: dict[str, int] = field(default_factory=dict)
    rss_growth: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    reads: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    share_bytes: int = 0
    rss_reset: bool = False
    errors: dict[str, str] = field(default_factory=dict)

    def record(self, phase: str, seconds: float) -> None:
        """Keep the best time of a phase."""
        self.seconds[phase] = min(seconds, self.seconds.get(phase, float("inf")))

    def record_span(self, phase: str, span: Span) -> None:
        """Keep the best time of a phase, with the CPU times of that round."""
        if span.seconds < self.seconds.get(phase, float("inf")):
            self.cpu[phase] = span.cpu_s
            self.server_cpu.pop(phase, None)
            if span.server_cpu_s is not None:
                self.server_cpu[phase] = span.server_cpu_s
        self.record(phase, span.seconds)

    def timed(self, phase: str, fn: Callable[[], object]) -> float:
        """Run ``fn`` between barriers, record it as ``phase``; its seconds."""
        span = Clock(self.server_pid).span(fn)
        self.record_span(phase, span)
        return span.seconds


# -- memory ----------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``); False where it cannot be reset."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """This process's resident memory in bytes now (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """This process's peak resident memory in bytes since the last reset (or start)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, else KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- phases ----------------------------------------------------------------------------------


def _barrier() -> None:
    torch.distributed.barrier()


def _measured(figures: RankFigures, phase: str, fn: Callable[[], object]) -> None:
    """Time a cloudckpt phase, with its peak RSS and requests."""
    figures.rss_reset = reset_peak_rss()
    start = current_rss()
    before = process_stats()
    figures.timed(phase, fn)
    figures.peak_rss[phase] = max(peak_rss(), figures.peak_rss.get(phase, 0))
    growth = peak_rss() - start
    figures.rss_growth[phase] = max(growth, figures.rss_growth.get(phase, 0))
    counted = process_stats() - before
    figures.requests[phase] = counted.requests
    figures.reads[phase] = counted.reads
    figures.bytes_read[phase] = counted.bytes_read


def _config(options: BenchOptions) -> CheckpointConfig:
    return CheckpointConfig(backend=options.backend)


def _save(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    strategy: Any = None,
    validate: bool = True,
    *,
    asynchronous: bool = False,
) -> Any:
    """``cloudckpt.save`` as the bench runs it; the request of an async save."""
    return cloudckpt.save(
        state,
        uri,
        sharded_strategy=strategy,
        validate_access_integrity=validate,
        async_sharded_save=asynchronous,
        storage_options=options.storage_options,
        config=_config(options),
    )


def _load(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    into: list[StateDict],
    strategy: LoadShardedStrategy | None = None,
) -> None:
    loaded = cloudckpt.load(
        state,
        uri,
        strategy,
        storage_options=options.storage_options,
        config=_config(options),
    )
    assert isinstance(loaded, dict)
    into.append(loaded)


def _copy_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What staging must at least do: one copy of every local tensor."""
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _async_save(
    state: StateDict,
    uri: str,
    options: BenchOptions,
    strategy: Any = None,
    validate: bool = True,
) -> tuple[float, float]:
    """An async save: its blocking time (until ``save`` returns on this rank), then the
    whole of it (until the request ran and committed on every rank)."""
    _barrier()
    start = time.perf_counter()
    request = _save(state, uri, options, strategy, validate, asynchronous=True)
    blocking = time.perf_counter() - start
    assert request is not None
    request.execute_sync()
    _barrier()
    return blocking, time.perf_counter() - start


def _count_objects(uri: str, options: BenchOptions) -> int:
    storage = open_checkpoint(uri, storage_options=options.storage_options)
    return len(storage.list())


def _remove(uri: str, options: BenchOptions, rank: int) -> None:
    _barrier()
    if rank == 0:
        remove_checkpoint(uri, storage_options=options.storage_options)
    _barrier()


def _check_loaded(loaded: StateDict, saved: StateDict) -> None:
    """Every tensor loaded equals the one saved (the load really happened, and a fully
    parallel load received what the other ranks read)."""
    for group in ("model", "optimizer"):
        section = saved[group]
        assert isinstance(section, dict)
        for key, item in section.items():
            got = loaded[group][key]
            if not isinstance(got, torch.Tensor) or not torch.equal(got, _data(item)):
                raise AssertionError(
                    f"cloudckpt bench: tensor {key!r} loaded differs from the one saved"
                )


def _data(item: Any) -> torch.Tensor:
    assert isinstance(item, ShardedTensor) and item.data is not None
    return item.data


@dataclass(frozen=True)
class _Strategies:
    """The save and load strategies of a round's second save and load (None: defaults).

    Attributes:
        suffix: the phases' suffix (``""`` for plain, ``"_fully_parallel"``).
    """

    suffix: str
    save: Any = None
    load: LoadShardedStrategy | None = None


def _dp_group(spec: WorkloadSpec, rank: int) -> Any:
    """This rank's data-parallel group (every rank creates every group, in order)."""
    groups = [
        torch.distributed.new_group([r for r in range(spec.world_size) if r % spec.tp == t])
        for t in range(spec.tp)
    ]
    return groups[rank % spec.tp]


def fully_parallel_strategies(
    spec: WorkloadSpec, rank: int, backend: str, cache: bool = False
) -> _Strategies:
    """The backend's default strategies wrapped to spread over the data-parallel group;
    ``cache``: ``do_cache_distribution`` (Megatron-LM passes its
    ``ckpt_assume_constant_structure``). Collective (it creates the groups)."""
    group = _dp_group(spec, rank)
    save = get_default_save_sharded_strategy(backend)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, backend, 1)
    return _Strategies(
        "_fully_parallel",
        FullyParallelSaveStrategyWrapper(save, group, do_cache_distribution=cache),
        FullyParallelLoadStrategyWrapper(load, group, do_cache_distribution=cache),
    )


@contextlib.contextmanager
def _replicas_kept(state: StateDict) -> Iterator[None]:
    """Restore every ShardedTensor's ``replica_id`` after the block (the fully parallel
    save rewrites them in place; the next plain save must see the workload's own)."""
    shards = [sh for sh in nested_values(state) if isinstance(sh, ShardedTensor)]
    kept = [sh.replica_id for sh in shards]
    try:
        yield
    finally:
        for sh, replica_id in zip(shards, kept, strict=True):
            sh.replica_id = replica_id


def _save_and_load(
    figures: RankFigures,
    spec: WorkloadSpec,
    state: StateDict,
    rank: int,
    ckpt: str,
    options: BenchOptions,
    strategies: _Strategies,
) -> None:
    """A save, then a load of it checked against the state; the checkpoint removed."""
    save_phase, load_phase = f"save{strategies.suffix}", f"load{strategies.suffix}"
    with _replicas_kept(state):
        _measured(figures, save_phase, lambda: _save(state, ckpt, options, strategies.save))
    if rank == 0:
        figures.objects[save_phase] = _count_objects(ckpt, options)
    loaded: list[StateDict] = []
    target = load_target(spec, rank)
    _measured(figures, load_phase, lambda: _load(target, ckpt, options, loaded, strategies.load))
    _check_loaded(loaded[0], state)
    target.clear()  # the loaded copy is not kept through the next phase
    loaded.clear()
    _remove(ckpt, options, rank)


def _cloudckpt_round(
    figures: RankFigures,
    spec: WorkloadSpec,
    state: StateDict,
    rank: int,
    run: str,
    options: BenchOptions,
    extra: RankExtras,
) -> None:
    ckpt = f"{run}/ckpt-{uuid.uuid4().hex[:6]}" if rank == 0 else ""
    ckpt = _broadcast(ckpt)
    _save_and_load(figures, spec, state, rank, ckpt, options, _Strategies(""))
    if extra.parallel is not None:
        _save_and_load(figures, spec, state, rank, f"{ckpt}-fp", options, extra.parallel)
    async_ckpt = f"{ckpt}-async"
    figures.timed("copy_to_host", lambda: _copy_to_host(local_tensors(state)))
    figures.rss_reset = reset_peak_rss()
    before = process_stats().requests
    blocking, total = _async_save(state, async_ckpt, options)
    figures.record("async_blocking", blocking)
    figures.record("async_total", total)
    figures.requests["async_total"] = process_stats().requests - before
    figures.peak_rss["async_save"] = max(peak_rss(), figures.peak_rss.get("async_save", 0))
    _remove(async_ckpt, options, rank)
    if extra.constant is not None:
        for number in range(2):
            _constant_structure_save(figures, state, f"{async_ckpt}-cs{number}", options, extra)


def _constant_structure_save(
    figures: RankFigures, state: StateDict, uri: str, options: BenchOptions, extra: RankExtras
) -> None:
    """An async save through the run's one cached-plan strategy: the run's first
    validates and plans; the later ones skip the validation, as Megatron-LM does."""
    first = extra.constant_saves == 0
    blocking, _ = _async_save(state, uri, options, extra.constant, validate=first)
    extra.constant_saves += 1
    figures.record("async_blocking_first" if first else "async_blocking_later", blocking)
    _remove(uri, options, rank=torch.distributed.get_rank())


@dataclass
class RankExtras:
    """What a rank keeps across rounds for the optional phases.

    Attributes:
        parallel: the fully parallel strategies (None: not measured).
        constant: the one cached-plan save strategy (None: not measured).
        constant_saves: async saves it made so far.
    """

    parallel: _Strategies | None = None
    constant: TorchDistSaveShardedStrategy | None = None
    constant_saves: int = 0


def _warm_up(rank: int, run: str, options: BenchOptions) -> None:
    """An untimed save and load of a tiny state: imports, the first collectives and the
    store's connections are not charged to the first round."""
    uri = f"{run}/warm-up"
    tensor = torch.arange(1024, dtype=torch.float32) + rank
    state: StateDict = {
        "w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, options.world_size))
    }
    _save(state, uri, options)
    _load(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", torch.empty_like(tensor), (0, rank, options.world_size)
            )
        },
        uri,
        options,
        [],
    )
    _remove(uri, options, rank)


def _broadcast(value: str) -> str:
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return str(box[0])


# -- raw baselines ---------------------------------------------------------------------------


def _raw_local_round(
    figures: RankFigures, share: dict[str, torch.Tensor], rank: int, run: str
) -> None:
    directory = raw.local_path(run) / "raw"
    directory.mkdir(parents=True, exist_ok=True)
    payload = raw.payload_of(share)
    path = directory / f"rank{rank}.bin"
    figures.timed("raw_write", lambda: raw.write_file(path, payload))
    sink = bytearray(len(payload))
    figures.timed("raw_read", lambda: raw.read_file(path, sink))
    path.unlink()
    pt = directory / f"rank{rank}.pt"
    figures.timed("torch_save", lambda: raw.torch_save(pt, share))
    figures.timed("torch_load", lambda: raw.torch_load(pt))
    pt.unlink()


def _raw_s3_round(
    figures: RankFigures, share: dict[str, torch.Tensor], rank: int, run: str, options: BenchOptions
) -> None:
    bucket, prefix = raw.split_s3(run)
    payload = raw.payload_of(share)
    part_size = _config(options).part_size
    for setting in raw.s3_settings():
        key = f"{prefix}/raw/{setting.name.replace(' ', '-')}/rank{rank}.bin"
        if setting.crt:
            _raw_crt(figures, setting, options, bucket, key, payload)
            continue
        client = raw.s3_client(options.storage_options, setting)
        config = raw.transfer_config(setting, part_size)
        _raw_s3_setting(figures, setting.name, client, config, bucket, key, payload)
        raw.s3_delete_prefix(client, bucket, [key])
        client.close()


def _raw_s3_setting(
    figures: RankFigures,
    name: str,
    client: Any,
    config: Any,
    bucket: str,
    key: str,
    payload: bytes,
) -> None:
    """One client setting's PUT and GET of the rank's bytes, with their requests."""
    counter = _RequestCounter()
    client.meta.events.register("before-send.s3", counter)
    figures.timed(f"raw_put[{name}]", lambda: raw.s3_put(client, bucket, key, payload, config))
    figures.requests[f"raw_put[{name}]"] = counter.take()
    figures.timed(f"raw_get[{name}]", lambda: raw.s3_get(client, bucket, key, config))
    figures.requests[f"raw_get[{name}]"] = counter.take()


def _raw_crt(
    figures: RankFigures,
    setting: raw.S3Setting,
    options: BenchOptions,
    bucket: str,
    key: str,
    payload: bytes,
) -> None:
    """The CRT's PUT and GET (its requests are not counted). Optional: a failure is
    recorded, not raised, and every rank still passes the same barriers."""
    errors: list[str] = []

    def attempt(fn: Callable[[], object]) -> None:
        if errors:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded in the figures
            errors.append(f"{type(exc).__name__}: {exc}")

    transfer: list[raw.CrtTransfer] = []
    part_size = setting.part_size or _config(options).part_size
    attempt(lambda: transfer.append(raw.CrtTransfer(options.storage_options, part_size)))
    clock = Clock(figures.server_pid)
    put = clock.span(lambda: attempt(lambda: transfer[0].put(bucket, key, payload)))
    get = clock.span(lambda: attempt(lambda: transfer[0].get(bucket, key)))
    if transfer:
        transfer[0].close()
        with contextlib.suppress(Exception):
            client = raw.s3_client(options.storage_options, raw.S3_SETTINGS[0])
            raw.s3_delete_prefix(client, bucket, [key])
    if errors:
        figures.errors[setting.name] = errors[0]
        return
    figures.record_span(f"raw_put[{setting.name}]", put)
    figures.record_span(f"raw_get[{setting.name}]", get)


class _RequestCounter:
    """A botocore ``before-send`` hook counting the HTTP requests a client sends."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, **kwargs: Any) -> None:
        self.count += 1  # botocore's threads: += on an int is atomic enough under the GIL

    def take(self) -> int:
        """The count since the last take."""
        count, self.count = self.count, 0
        return count


# -- a rank ----------------------------------------------------------------------------------


def bench_rank(rank: int, world_size: int, options: BenchOptions, run: str) -> dict[str, Any]:
    """Run every phase on this rank; return its :class:`RankFigures` as a dict.

    A rank that fails prints its traceback and exits: the others wait for it in a
    barrier, and the pool fails the run as soon as it sees a rank process gone."""
    try:
        return _bench_rank(rank, world_size, options, run)
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _bench_rank(rank: int, world_size: int, options: BenchOptions, run: str) -> dict[str, Any]:
    spec = plan_workload(options.size_bytes, world_size)
    figures = RankFigures(server_pid=options.server_pid)
    state = build_state(spec, rank)
    figures.state_bytes = sum(t.numel() * t.element_size() for t in local_tensors(state))
    share = rank_share(state, spec, rank)
    figures.share_bytes = sum(t.numel() * t.element_size() for t in share.values())
    _warm_up(rank, run, options)
    extra = RankExtras()
    if options.fully_parallel:
        extra.parallel = fully_parallel_strategies(
            spec, rank, options.backend, cache=options.constant_structure
        )
    if options.constant_structure:
        extra.constant = TorchDistSaveShardedStrategy(cached_metadata=True)
    for _ in range(options.repeat):
        if options.is_s3:
            _raw_s3_round(figures, share, rank, run, options)
        else:
            _raw_local_round(figures, share, rank, run)
        _cloudckpt_round(figures, spec, state, rank, run, options, extra)
    figures.peak_rss["run"] = max(_run_peak(), *figures.peak_rss.values())
    return asdict(figures)


def _run_peak() -> int:
    """The peak RSS of the whole run (ru_maxrss is never reset by clear_refs)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_bench(options: BenchOptions) -> tuple[WorkloadSpec, list[dict[str, Any]], str]:
    """Run the benchmark on ``options.world_size`` fresh rank processes.

    Returns:
        The workload, every rank's figures, and the run's URI (removed after).
    """
    spec = plan_workload(options.size_bytes, options.world_size)
    run = f"{options.uri.rstrip('/')}/cloudckpt-bench-{uuid.uuid4().hex[:8]}"
    logger.info("cloudckpt bench: %s on %d ranks under %s", spec, options.world_size, run)
    try:
        figures = run_on_ranks(
            bench_rank, options.world_size, (options, run), timeout_s=options.timeout_s
        )
    finally:
        if not options.is_s3:
            import shutil  # noqa: PLC0415

            shutil.rmtree(raw.local_path(run), ignore_errors=True)
    return spec, figures, run
