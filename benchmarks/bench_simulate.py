"""Scale past this machine by simulation: the world-size-dependent steps of one save,
for thousands of simulated ranks, on one core, with metadata only (no processes, no data).

    .venv/bin/python benchmarks/bench_simulate.py                           # the grid below
    .venv/bin/python benchmarks/bench_simulate.py --ranks 4096 --tensors 2000 --tp 8 --pp 8
    .venv/bin/python benchmarks/bench_simulate.py --ranks 64 128 --tensors 500 --json out.json

The process pins itself to one core (``os.sched_setaffinity``). Each simulated rank holds
a GPT-like layout of a TP x PP x DP job (``--tp``/``--pp``, DP = ranks / (TP x PP); ranks
ordered tp fastest, then dp, then pp): per layer of its pipeline stage, four weights
(column- and row-parallel ones split over TP, a layer norm replicated over TP) as
ShardedTensors replicated over DP (``replica_id``), and each weight's two Adam moments as
distributed-optimizer shards (``flattened_range``: a DP slice of the TP shard), plus one
ShardedObject (``rng_state``). The inputs of each step are what the real collectives
deliver: each rank's payload is pickled as the object collectives pickle it, and unpickled
once per rank on the simulating core, as the receiving rank does. Then the real functions run:

* ``gather``: unpickling every rank's sharding metadata, its ``ShardTable`` (columns;
  built on each rank, untimed), on the coordinator (``SaveSession._check_every_rank``'s
  ``gather_object``);
* ``validate``: ``check_gathered_tables`` (keys and sharding, vectorized), what the
  coordinator runs on the gathered tables before anything is written (its verdict is
  broadcast: every rank raises the same error);
* ``plan``: zarr: the coordinator's step of ``cloudckpt.formats.zarr.save.flat_writes``:
  unpickling every rank's table of flattened pieces (``flat_shard_table``, gathered on
  the coordinator only), ``plan_flat_exchange``, and pickling each rank's part for the
  scatter (a rank unpickles only its own); torch_dist: the save's real coordinator step
  with cloudckpt's planner and writer (``global_step_columns``) on every rank's local plan
  sent in columns (``PlanColumns``), pickling each rank's ``GlobalPlanUpdate`` (its items'
  index hints and the writer's storage data) for the scatter and expanding its own, then
  ``finish_columns`` (``.metadata`` from every rank's item results sent in columns,
  ``ItemResultColumns``, with the records the real writer's results carry, into
  ``memory://``). Each rank's local plan is built when it sends it and kept in columns
  (the rank's plan is rebuilt from them to expand its update: equal items), so that
  4,096 x 2,000 fits in memory;
* ``merge``: ``commit``'s coordinator step: unpickling every rank's tensor digest (the
  all-gather that tells each rank which piece of the tensor entries it shares with others
  it sends) and every rank's ``CommitRecord`` (write results in columns, a piece of the
  tensor entries; gathered on the coordinator only), ``build_manifest`` on them, and
  the manifest's canonical JSON. Each rank's own step (``CommitRecord.of``, its digest,
  ``tensor_piece``) is not timed. Objects larger than one block carry (made-up) block
  CRCs, as real write results do.

With ``--global-step dcp`` (``both``: a row of each) the torch_dist ``plan`` step is DCP's
own coordinator step on the same layouts instead: every rank's local plan of DCP's
``DefaultSavePlanner`` (storing bytes items as cloudckpt's planner does) as objects, the
planner's ``create_global_plan``, the writer's ``prepare_global_plan``, the whole global
plans scattered, every rank's item results as objects gathered and the writer's
``finish`` (``.metadata`` into ``memory://``): what a save takes with a planner on which
the fast path is off. ``--global-step linear`` takes the same object path with
cloudckpt's planner (its linear step on the plans as objects, each rank's
``GlobalPlanUpdate`` scattered, no columns); ``all``: a row of each of the three. A
second table splits the torch_dist ``plan`` step into the plan collective (``plan``: the
local plans' gather, the global step, the scatter) and the finish (``finish``: the item
results' gather, ``.metadata``), with the bytes a rank sends and receives in them and the
process's peak RSS when the row was done (the largest so far in the run: one row per run
for a row's own).

Reported per row: CPU seconds of each step (``time.process_time`` of this process, pinned
to one core, so other load on the machine stretches wall time, not these figures),
microseconds per (rank x tensor) of their total (constant when the steps grow linearly),
the pickled bytes one rank sends in each exchange (validation metadata, flat-piece
table or DCP local plan and item results, commit record), and the bytes a rank
other than the coordinator receives (its part of the scattered plans, padded to the
longest, the scatter's sizes, and the commit's all-gathered tensor digests:
``recv kB/rank``). With ``--json``, ``bytes_per_rank`` also holds ``commit_mean`` (the
mean record; the gather pads every record to the longest, ``commit``, so the
coordinator receives ranks x that) and ``commit_digest`` (the all-gathered digest).
Building the inputs (the layouts, the per-rank local steps) is not timed. The figures are
one core's time for what the coordinator
does, not a distributed run; on a shared machine they are provisional.

Each row's line also says how much of its time the kernel took (``ru_stime``; with
``--json``, ``kernel_seconds`` per step): at scale mostly faulting in the pages of new
arrays, whose cost depends on the host's transparent huge page settings and on numpy
advising huge pages for arrays of 4 MiB and more (``NUMPY_MADVISE_HUGEPAGE``, read at
import): the first line prints both. Where ``defrag`` is ``madvise``, an advised fault
may wait for the kernel to compact memory (numpy/numpy#31590). cloudckpt turns that
advice off for the coordinator's save (``cloudckpt.dist.coordinating``), and so does
each simulated save here; ``--no-huge-page-switch`` leaves it as the process has it (as
``NUMPY_MADVISE_HUGEPAGE=1`` in the environment does). ``--progress`` says when each
part of the torch_dist ``plan`` step is done; ``--rss-limit-gib`` stops the run (exit
status 3) once its resident set passes that size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import json
import math
import os
import pickle
import re
import resource
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult as DcpWriteResult

from cloudckpt.commit import COORDINATOR, build_manifest, tensor_piece
from cloudckpt.core import CheckpointingConfig
from cloudckpt.dist import paused_gc
from cloudckpt.formats.dcp.columns import ItemResultColumns, PlanColumns
from cloudckpt.formats.dcp.plan import (
    GlobalPlanUpdate,
    apply_global_plan_update,
    global_plan_updates,
)
from cloudckpt.formats.dcp.ranges import RecordedStorageInfo
from cloudckpt.formats.dcp.save import DcpFormat, _PackedObjectsSavePlanner
from cloudckpt.formats.dcp.steps import (
    create_global_plan,
    global_step_columns,
    plans_in_columns,
)
from cloudckpt.formats.dcp.storage import CloudStorageWriter
from cloudckpt.formats.dcp.stored_items import METADATA_FNAME
from cloudckpt.formats.zarr.layout import ZARRAY, shard_chunk_indices
from cloudckpt.formats.zarr.save import ZarrFormat, _array_meta, _flat_table
from cloudckpt.huge_pages import numpy_advises_huge_pages, without_huge_page_advice
from cloudckpt.keys import KeyLayout
from cloudckpt.manifest import CommitRecord, Manifest
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from cloudckpt.planning import RankFlatPlan, chunk_plans, plan_flat_exchange
from cloudckpt.shard_table import ShardTable
from cloudckpt.storage import WriteResult, open_checkpoint
from cloudckpt.storage.blocks import BLOCK_SIZE, BlockCrcs, block_count
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy, to_dcp_state_dict
from cloudckpt.strategies.zarr import ZarrSaveShardedStrategy
from cloudckpt.table_validation import check_gathered_tables
from cloudckpt.validation import chunk_index

FORMATS: dict[str, ZarrFormat | DcpFormat] = {"zarr": ZarrFormat(None), "torch_dist": DcpFormat(1)}
"""Each backend's format, for its traits."""

_T = TypeVar("_T")
WEIGHTS = (  # (name, local shape for hidden size h and TP, axis split over TP or None)
    ("self_attention.linear_qkv.weight", lambda h, tp: (3 * h // tp, h), 0),
    ("self_attention.linear_proj.weight", lambda h, tp: (h, h // tp), 1),
    ("mlp.linear_fc1.weight", lambda h, tp: (4 * h // tp, h), 0),
    ("input_layernorm.weight", lambda h, tp: (h,), None),
)
MOMENTS = ("exp_avg", "exp_avg_sq")
URI = "s3://simulated/ckpt"
GLOBAL_STEPS = ("columns", "dcp", "linear")
_pickled = functools.partial(pickle.dumps, protocol=pickle.HIGHEST_PROTOCOL)  # as dist_objects


@dataclass(frozen=True)
class World:
    """A TP x PP x DP job; rank = tp + TP * (dp + DP * pp)."""

    tp: int
    pp: int
    dp: int
    hidden: int = 1024

    @property
    def size(self) -> int:
        """Ranks."""
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, pp, dp) of ``rank``."""
        return rank % self.tp, rank // (self.tp * self.dp), rank // self.tp % self.dp


def _stage_template(world: World, tp: int, pp: int, tensors: int) -> list[ShardedBase]:
    """The shards of DP rank 0 at (tp, pp), built with the real constructors (meta data)."""
    out: list[ShardedBase] = []
    layer = 0
    while len(out) < tensors:
        prefix = f"decoder.layers.{pp * 100000 + layer}"
        for name, shape_of, axis in WEIGHTS:
            local = shape_of(world.hidden, world.tp)
            split = ((axis, tp, world.tp),) if axis is not None else ()
            tp_replica = tp if axis is None else 0
            data = torch.empty(local, dtype=torch.bfloat16, device="meta")
            key = f"{prefix}.{name}"
            out.append(
                ShardedTensor.from_rank_offsets(key, data, *split, replica_id=(0, tp_replica, 0))
            )
            numel = math.prod(local)
            for moment in MOMENTS:
                piece = torch.empty(numel // world.dp, dtype=torch.float32, device="meta")
                out.append(
                    ShardedTensor.from_rank_offsets_flat(
                        f"optimizer.state.{moment}.{key}",
                        piece,
                        local,
                        *split,
                        replica_id=(0, tp_replica, 0),
                        flattened_range=slice(0, numel // world.dp),
                    )
                )
        layer += 1
    del out[tensors:]
    out.append(ShardedObject("rng_state", None, (world.pp, world.tp), (pp, tp), replica_id=0))
    return out


def _for_dp(template: list[ShardedBase], world: World, dp: int) -> list[ShardedBase]:
    """DP rank ``dp``'s shards: the template's, with its replica ids and flat ranges
    (copies, as a rank's own constructors would make them)."""
    out = []
    for shard in template:
        sh = copy.copy(shard)
        if isinstance(sh, ShardedObject):
            sh.replica_id = dp
        elif isinstance(sh, ShardedTensor):
            rng = sh.flattened_range
            if rng is None:
                main, tp_replica, _ = sh.replica_id  # type: ignore[misc]
                sh.replica_id = (main, tp_replica, dp)
            else:
                n = rng.stop - rng.start
                sh.flattened_range = slice(dp * n, (dp + 1) * n)
        out.append(sh)
    return out


def rank_shards(world: World, tensors: int) -> Callable[[int], list[ShardedBase]]:
    """rank -> its shards (with meta data), templates cached per (tp, pp)."""
    templates: dict[tuple[int, int], list[ShardedBase]] = {}

    def shards(rank: int) -> list[ShardedBase]:
        tp, pp, dp = world.coords(rank)
        if (tp, pp) not in templates:
            templates[(tp, pp)] = _stage_template(world, tp, pp, tensors)
        return _for_dp(templates[(tp, pp)], world, dp)

    return shards


@dataclass
class Row:
    """One measured world."""

    backend: str
    ranks: int
    tensors: int
    tp: int
    pp: int
    dp: int
    global_step: str = ""
    """torch_dist: the coordinator's step, ``columns`` (cloudckpt's fast path) or ``dcp``
    (DCP's own, on the plans as objects)."""
    seconds: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)
    """torch_dist: the ``plan`` step's seconds by part: ``plan`` (the local plans'
    gather, the global step, the scatter, the coordinator's own plan) and ``finish``
    (the item results' gather and ``.metadata``), each also by its pieces
    (``plan.gather``, ``plan.global``, ``plan.scatter``, ``finish.gather``,
    ``finish.metadata``)."""
    peak_rss: int = 0
    """The process's peak resident set size (bytes) when the row was done: the largest
    of this row's and any earlier row's in the same run."""
    kernel_seconds: dict[str, float] = field(default_factory=dict)
    """Of ``seconds``, the time in the kernel (mostly faulting in new arrays' pages)."""
    bytes_per_rank: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    """Bytes a rank other than the coordinator receives, per scatter."""
    objects: int = 0
    manifest_bytes: int = 0
    artifacts: dict[str, Any] = field(default_factory=dict, repr=False)
    """The manifest, and the flat-chunk plans (zarr) or DCP metadata (torch_dist)."""

    @property
    def total(self) -> float:
        """Seconds of all steps."""
        return sum(self.seconds.values())

    @property
    def received_per_rank(self) -> int:
        """Bytes a rank other than the coordinator receives: its part of the plans
        (zarr: its flat-chunk transfers; torch_dist: its global plan), padded to the
        longest, the sizes the scatter sends first, and every rank's tensor digest (the
        commit's all-gather). The sharding metadata, the flat pieces' tables, DCP's local
        plans and item results and the commit records are gathered on the coordinator
        only."""
        digests = self.ranks * self.bytes_per_rank.get("commit_digest", 0)
        return sum(self.bytes_received.values()) + digests

    @property
    def us_per_rank_tensor(self) -> float:
        """Microseconds of all steps per (rank x tensor)."""
        return self.total / (self.ranks * self.tensors) * 1e6


def _timed(row: Row, step: str, fn: Callable[[], _T], part: str | None = None) -> _T:
    """``fn()``, its CPU seconds added to ``step`` (and to ``part`` and the part's
    first component in :attr:`Row.parts`, e.g. ``plan.global`` and ``plan``)."""
    kernel = _kernel_seconds()
    started = time.process_time()  # this process's CPU time: robust on a shared machine
    out = fn()
    spent = time.process_time() - started
    row.seconds[step] = row.seconds.get(step, 0.0) + spent
    row.kernel_seconds[step] = row.kernel_seconds.get(step, 0.0) + _kernel_seconds() - kernel
    if part is not None:
        for name in {part, part.split(".")[0]}:
            row.parts[name] = row.parts.get(name, 0.0) + spent
    return out


PROGRESS = False
"""``--progress``: :func:`_done` reports each finished part (where a long run is)."""


def _done(row: Row, part: str) -> None:
    """With :data:`PROGRESS`, say on stderr that ``part`` is done: its seconds so far,
    the resident set and the peak."""
    if PROGRESS:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        print(
            f"    {row.ranks} x {row.tensors} {row.global_step or row.backend}: {part} done,"
            f" {row.parts.get(part, 0.0):.2f} s; RSS {rss / 2**30:.2f} GiB,"
            f" peak {peak_rss() / 2**30:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )


def _kernel_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def memory_settings() -> str:
    """What decides the kernel's share: the transparent huge page settings and whether
    numpy advises huge pages for large arrays (``NUMPY_MADVISE_HUGEPAGE``)."""
    thp = []
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                chosen = re.search(r"\[(\w[\w+]*)\]", f.read())
            thp.append(f"{name}={chosen.group(1) if chosen else '?'}")
        except OSError:
            thp.append(f"{name}=?")
    advises = numpy_advises_huge_pages()
    advised = "?" if advises is None else str(advises)
    return f"transparent huge pages: {' '.join(thp)}; numpy advises huge pages: {advised}"


def _exchange(
    row: Row, step: str, name: str, payloads: Iterable[Any], part: str | None = None
) -> list[Any]:
    """Pickle each rank's payload (its bytes are what it sends), unpickle it (timed, as
    a receiving rank of ``all_gather_object`` does)."""
    out = []
    gc.collect()
    for payload in payloads:
        raw = _pickled(payload)
        row.bytes_per_rank[name] = max(row.bytes_per_rank.get(name, 0), len(raw))
        out.append(_timed(row, step, functools.partial(pickle.loads, raw), part))
    return out


def simulate(
    backend: str,
    world: World,
    tensors: int,
    validate: bool = True,
    pause_gc: bool = True,
    global_step: str = "columns",
    huge_page_switch: bool = True,
) -> Row:
    """Run the world-size-dependent steps of one save by ``backend`` for ``world``;
    ``pause_gc``: with the garbage collector paused where cloudckpt pauses it
    (:func:`cloudckpt.dist.paused_gc`: the gathers and the checks of what they gather);
    ``global_step`` (torch_dist): ``columns`` (cloudckpt's fast path), ``dcp`` (DCP's
    own step on the plans as objects, :func:`_dcp_own_steps`) or ``linear``
    (cloudckpt's linear step on the plans as objects, :func:`_linear_object_steps`);
    ``huge_page_switch``: numpy's huge page advice off throughout, as
    :func:`cloudckpt.dist.coordinating` has it for the coordinator's save."""
    if global_step not in GLOBAL_STEPS:
        raise ValueError(f"global_step {global_step!r}: one of {GLOBAL_STEPS}")
    switch = without_huge_page_advice() if huge_page_switch else contextlib.nullcontext()
    with switch:
        return _simulate(backend, world, tensors, validate, pause_gc, global_step)


def _simulate(
    backend: str, world: World, tensors: int, validate: bool, pause_gc: bool, global_step: str
) -> Row:
    step = global_step if backend == "torch_dist" else ""
    row = Row(backend, world.size, tensors, world.tp, world.pp, world.dp, step)
    shards_of = rank_shards(world, tensors)
    tables = [ShardTable.of(shards_of(r)) for r in range(world.size)]  # each rank's payload
    with _paused(pause_gc):  # SaveSession._prepare
        gathered = _exchange(row, "gather", "sharding", tables)
        tables.clear()
        if validate:
            _timed(row, "validate", lambda: check_tables(gathered, backend))
        gathered.clear()
    if backend == "zarr":
        records = _zarr_steps(row, world, shards_of, pause_gc)
    elif global_step == "dcp":
        records = _dcp_own_steps(row, world, shards_of, pause_gc)
    elif global_step == "linear":
        records = _linear_object_steps(row, world, shards_of, pause_gc)
    else:
        records = _torch_dist_steps(row, world, shards_of, pause_gc)
    with _paused(pause_gc):  # commit
        manifest = merge(row, records, backend)
    row.objects = len(manifest.objects)
    row.artifacts["manifest"] = manifest
    row.peak_rss = peak_rss()
    return row


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def merge(row: Row, records: list[Any], backend: str) -> Manifest:
    """``commit`` for every rank's ``(write results, tensor entries, common keys)``
    (the common keys from the coordinator only, as a save reports them): the ranks'
    records and digests (not timed), then the coordinator's step (timed)."""
    local = [
        CommitRecord.of(results, tensors, keys if rank == COORDINATOR else ())
        for rank, (results, tensors, keys) in enumerate(records)
    ]
    digests = _exchange(row, "merge", "commit_digest", [r.digest for r in local])
    sent = [r.piece(*tensor_piece(digests, i)) for i, r in enumerate(local)]
    row.bytes_per_rank["commit_mean"] = sum(len(_pickled(r)) for r in sent) // len(sent)
    local.clear()
    gathered = _exchange(row, "merge", "commit", sent)
    sent.clear()
    manifest = _timed(row, "merge", lambda: build_manifest(gathered, CheckpointingConfig(backend)))
    row.manifest_bytes = len(_timed(row, "merge", manifest.to_json))
    return manifest


def _paused(pause_gc: bool) -> contextlib.AbstractContextManager[None]:
    return paused_gc() if pause_gc else contextlib.nullcontext()


def gathered_metadata(world: World, tensors: int) -> list[list[ShardedBase]]:
    """Every rank's shards without data (what each rank's ShardTable holds)."""
    shards_of = rank_shards(world, tensors)
    return [[s.without_data() for s in shards_of(r)] for r in range(world.size)]


def materialize(shards: list[ShardedBase]) -> dict[str, ShardedBase]:
    """A real rank's state dict of ``shards``: zeros where the layout has meta data."""
    state: dict[str, ShardedBase] = {}
    for i, shard in enumerate(shards):
        sh = copy.copy(shard)
        if isinstance(sh, ShardedTensor):
            rng = sh.flattened_range
            shape = sh.local_shape if rng is None else (rng.stop - rng.start,)
            sh.data = torch.zeros(shape, dtype=sh.dtype)
        else:
            sh.data = {"seed": i}
        state[f"{sh.key}.{i}"] = sh
    return state


def check(gathered: list[list[ShardedBase]], backend: str) -> None:
    """The checks of a save of every rank's shards (``gathered[rank]``): each rank's
    ShardTable, pickled and unpickled as the gather does, then :func:`check_tables`."""
    tables = [ShardTable.of(shards) for shards in gathered]
    check_tables([pickle.loads(pickle.dumps(t)) for t in tables], backend)


def check_tables(tables: list[ShardTable], backend: str) -> None:
    """What the coordinator runs on the gathered tables of a save
    (``SaveSession._check_gathered``)."""
    layout = KeyLayout.of(FORMATS[backend].traits)
    traits = FORMATS[backend].traits
    check_gathered_tables(tables, layout, URI, 0, True, backend if traits.regular_grid else None)


# -- zarr ------------------------------------------------------------------------------------


def _is_flat(sh: ShardedBase) -> bool:
    return isinstance(sh, ShardedTensor) and sh.flattened_range is not None


def _zarr_steps(
    row: Row, world: World, shards_of: Callable[[int], list[ShardedBase]], pause_gc: bool
) -> list[Any]:
    strategy = ZarrSaveShardedStrategy()
    flat = [_zarr_flat_table([s for s in shards_of(r) if _is_flat(s)]) for r in range(world.size)]
    with _paused(pause_gc):  # cloudckpt.formats.zarr.save.flat_writes
        tables = _exchange(row, "plan", "flat", [table for _, table in flat])
        plans = _timed(row, "plan", lambda: plan_flat_exchange(tables))
        tables.clear()
        plans = _scatter(row, "plan", "flat_plans", plans)
    pieces = [[(sh.key, index, *_flat_range(sh)) for sh, index in own] for own, _ in flat]
    row.artifacts["flat_plans"] = chunk_plans(pieces, plans)
    records = []
    for rank in range(world.size):
        shards = shards_of(rank)
        tensors = [s for s in shards if isinstance(s, ShardedTensor)]
        assembled = _assembled(flat[rank][0], plans[rank])
        records.append(
            (
                zarr_writes(rank, shards, assembled),
                strategy.save_format().tensor_entries(tensors),
                ["optimizer"],
            )
        )
    return records


def _zarr_flat_table(
    shards: list[ShardedBase],
) -> tuple[list[tuple[ShardedTensor, tuple[int, ...]]], Any]:
    """A rank's local step: its flat-shard table, as ``flat_writes`` makes it."""
    return _flat_table([s for s in shards if isinstance(s, ShardedTensor)])


def _flat_range(sh: ShardedTensor) -> tuple[int, int]:
    rng = sh.flattened_range
    assert rng is not None
    return rng.start, rng.stop


def _assembled(
    local: list[tuple[ShardedTensor, tuple[int, ...]]], plan: RankFlatPlan
) -> set[tuple[str, tuple[int, ...]]]:
    """The flat chunks a rank assembles: those of the rows its plan does not send."""
    sent = set(plan.sends[:, 0].tolist())
    return {(sh.key, index) for row, (sh, index) in enumerate(local) if row not in sent}


def _scatter(
    row: Row, step: str, name: str, payloads: list[Any], part: str | None = None
) -> list[Any]:
    """Pickle each rank's payload (timed: the coordinator pickles all of them in
    ``scatter_object``); a rank receives the longest (the scatter pads to it) and the
    sizes (8 bytes per rank); unpickle each (the coordinator's own timed: every rank
    unpickles its own at once)."""
    gc.collect()
    raws = [_timed(row, step, functools.partial(_pickled, p), part) for p in payloads]
    row.bytes_received[name] = max(len(r) for r in raws) + 8 * len(raws)
    out = [pickle.loads(r) for r in raws[1:]]
    return [_timed(row, step, functools.partial(pickle.loads, raws[0]), part), *out]


def zarr_writes(
    rank: int, shards: list[ShardedBase], assembled: set[tuple[str, tuple[int, ...]]]
) -> list[WriteResult]:
    """The objects ``rank`` writes in a zarr save (paths and sizes as the strategy names
    them; CRCs made up): its main-replica chunks, the flat chunks it assembles, the
    ``.zarray`` of chunk 0, and its main-replica ShardedObjects' files."""
    chunk_size = ZarrSaveShardedStrategy().chunk_size
    assembled = set(assembled)
    out = []
    for sh in shards:
        if isinstance(sh, ShardedObject):
            if is_main_replica(sh.replica_id):
                out.append(_result(f"{sh.unique_key}.pt", 1024))
            continue
        assert isinstance(sh, ShardedTensor)
        index = chunk_index(sh)
        assert index is not None
        if sh.flattened_range is not None:
            if (sh.key, index) not in assembled:
                continue
            assembled.discard((sh.key, index))
        elif not is_main_replica(sh.replica_id):
            continue
        meta = _array_meta(sh, chunk_size)
        if not any(index):
            out.append(_result(f"{sh.key}/{ZARRAY}", len(meta.to_json())))
        for chunk in shard_chunk_indices(index, tuple(sh.local_shape), meta.chunks):
            out.append(_result(f"{sh.key}/{meta.chunk_key(chunk)}", meta.chunk_nbytes))
    return out


def _result(path: str, size: int) -> WriteResult:
    """A write result with a made-up CRC (and block CRCs when larger than one block)."""
    crc = zlib.crc32(path.encode())
    blocks = None
    if size > BLOCK_SIZE:
        blocks = BlockCrcs.of(BLOCK_SIZE, (crc ^ k for k in range(block_count(size, BLOCK_SIZE))))
    return WriteResult(path, size, crc, blocks)


# -- torch_dist --------------------------------------------------------------------------------


def _torch_dist_steps(
    row: Row, world: World, shards_of: Callable[[int], list[ShardedBase]], pause_gc: bool
) -> list[Any]:
    storage = open_checkpoint(f"memory://bench-simulate-{os.getpid()}-{time.time_ns()}")
    writer, coordinator, local = dcp_local_step(0, shards_of(0), storage)

    kept: list[Any] = []  # each rank's plan in columns (the rank keeps its plan: memory)

    def sent_plan(rank: int) -> Any:  # what plan_save's send_local_plan sends
        plan = local if rank == 0 else dcp_local_step(rank, shards_of(rank), storage)[2]
        kept.append(PlanColumns.of(plan) if plans_in_columns(coordinator, writer) else plan)
        return kept[-1]

    def local_plan(rank: int) -> SavePlan:  # the rank's plan again (equal items)
        plan = kept[rank]
        return plan.to_plan() if isinstance(plan, PlanColumns) else plan

    with _paused(pause_gc):  # plan_save's gather, global step and scatter
        sent = (sent_plan(r) for r in range(world.size))
        gathered = _exchange(row, "plan", "dcp_plan", sent, "plan.gather")
        _done(row, "plan.gather")
        fast = _timed(
            row,
            "plan",
            lambda: global_step_columns(coordinator, writer, gathered),
            "plan.global",
        )
        if fast is None:
            raise SystemExit("torch_dist: the coordinator's step on columns did not apply")
        _done(row, "plan.global")
        metadata, keys, scattered, chunks = fast
        gathered.clear()
        updates = _scatter(row, "plan", "dcp_plans", scattered, "plan.scatter")
        # every rank expands its own update at once: the coordinator's is timed
        expand = functools.partial(apply_global_plan_update, local, updates[0])
        _timed(row, "plan", expand, "plan.scatter")
        _done(row, "plan.scatter")
    paths: list[list[str]] = []

    def sent_results(rank: int) -> Any:  # what PlannedSave.write returns
        plan = apply_global_plan_update(local_plan(rank), updates[rank])
        kept[rank] = None
        results = dcp_item_results(plan)
        paths.append(sorted({i.storage_data.relative_path for i in results}))
        return ItemResultColumns.of(plan.items, results) if updates[rank].columns else results

    with _paused(pause_gc):  # save_state_dict's gather and finish
        results = _exchange(
            row,
            "plan",
            "dcp_results",
            (sent_results(r) for r in range(world.size)),
            "finish.gather",
        )
        _done(row, "finish.gather")
        _timed(
            row,
            "plan",
            lambda: writer.finish_columns(metadata, keys, results, chunks),
            "finish.metadata",
        )
        _done(row, "finish.metadata")
        results.clear()
    row.artifacts["dcp_metadata"] = pickle.loads(storage.read(METADATA_FNAME))  # as written
    storage.delete(METADATA_FNAME)
    return _records_of(world, shards_of, paths, writer)


class StockPackedObjectsSavePlanner(DefaultSavePlanner):
    """cloudckpt's planner without its linear coordinator step: DCP's
    ``DefaultSavePlanner`` (its local plan and its ``create_global_plan``), storing bytes
    items as cloudckpt's planner does. With it a save takes DCP's own step on the plans
    as objects (:func:`~cloudckpt.formats.dcp.steps.plans_in_columns` is False)."""

    transform_object = _PackedObjectsSavePlanner.transform_object


def _records_of(
    world: World,
    shards_of: Callable[[int], list[ShardedBase]],
    paths: list[list[str]],
    writer: CloudStorageWriter,
) -> list[Any]:
    """Each rank's ``(write results, tensor entries, common keys)`` for the commit: its
    ``.distcp`` objects (1 MiB each, made up), the coordinator's ``.metadata``."""
    strategy = TorchDistSaveShardedStrategy()
    records = []
    for rank in range(world.size):
        tensors = [s for s in shards_of(rank) if isinstance(s, ShardedTensor)]
        written = [_result(path, 1 << 20) for path in paths[rank]]
        if rank == 0:
            written.append(_result(".metadata", writer.results[-1].size))
        records.append((written, strategy.save_format().tensor_entries(tensors), ["optimizer"]))
    return records


def _dcp_own_steps(
    row: Row, world: World, shards_of: Callable[[int], list[ShardedBase]], pause_gc: bool
) -> list[Any]:
    """The torch_dist save's coordinator steps as DCP takes them, on the same layouts:
    every rank's local plan of :class:`StockPackedObjectsSavePlanner` as objects (its
    pickle gathered), the planner's ``create_global_plan`` (DCP's
    ``DefaultSavePlanner``: de-duplication, index hints, validation), the writer's
    ``prepare_global_plan``, the whole global plans scattered, every rank's item
    results as objects gathered and ``CloudStorageWriter.finish`` (``.metadata`` into
    ``memory://``). The coordinator keeps the global plans until the finish (as DCP's
    planner does, ``global_plan``); each rank's item results are made from its global
    plan (the one it unpickles from the scatter: equal)."""
    return _object_steps(row, world, shards_of, pause_gc, StockPackedObjectsSavePlanner)


def _linear_object_steps(
    row: Row, world: World, shards_of: Callable[[int], list[ShardedBase]], pause_gc: bool
) -> list[Any]:
    """:func:`_dcp_own_steps` with cloudckpt's planner: its linear step on the plans as
    objects (``create_global_plan_unhinted``), each rank's ``GlobalPlanUpdate``
    scattered and expanded, the item results as objects and ``CloudStorageWriter.
    finish``; no columns (a save sends them where it can: this isolates the linear
    step from the columns)."""
    return _object_steps(row, world, shards_of, pause_gc, _PackedObjectsSavePlanner)


def _object_steps(
    row: Row,
    world: World,
    shards_of: Callable[[int], list[ShardedBase]],
    pause_gc: bool,
    planner_class: type[DefaultSavePlanner],
) -> list[Any]:
    """The coordinator's steps on plans and item results as objects, with
    ``planner_class`` (see :func:`_dcp_own_steps`, :func:`_linear_object_steps`)."""
    storage = open_checkpoint(f"memory://bench-simulate-{os.getpid()}-{time.time_ns()}")
    writer, coordinator, local = dcp_local_step(0, shards_of(0), storage, planner_class)
    whole = planner_class is StockPackedObjectsSavePlanner  # DCP's: whole plans scattered
    if whole and plans_in_columns(coordinator, writer):
        raise SystemExit("torch_dist: the stock planner would send its plan in columns")

    def sent_plan(rank: int) -> SavePlan:  # what plan_save's send_local_plan sends
        if rank == 0:
            return local
        return dcp_local_step(rank, shards_of(rank), storage, planner_class)[2]

    def global_step(plans: list[SavePlan]) -> list[SavePlan | GlobalPlanUpdate]:
        planned, metadata = create_global_plan(coordinator, writer, plans)  # plan_save's
        found.append(metadata)
        central.extend(writer.prepare_global_plan(planned))
        updates = global_plan_updates(coordinator, planned, central)
        if any(isinstance(u, SavePlan) != whole for u in updates):
            kind = "whole plans" if whole else "updates"
            raise SystemExit(f"torch_dist: the step on objects did not scatter {kind}")
        return updates

    found: list[Any] = []
    central: list[SavePlan] = []  # the coordinator's global plans (its planner keeps them)
    with _paused(pause_gc):  # plan_save's gather, global step and scatter
        sent = (sent_plan(r) for r in range(world.size))
        gathered = _exchange(row, "plan", "dcp_plan", sent, "plan.gather")
        _done(row, "plan.gather")
        updates = _timed(row, "plan", lambda: global_step(gathered), "plan.global")
        _done(row, "plan.global")
        gathered.clear()
        _scatter_whole(row, "plan", "dcp_plans", updates, "plan.scatter")
        if not whole:  # the coordinator expands its own update (every rank at once)
            expand = functools.partial(apply_global_plan_update, central[0], updates[0])
            _timed(row, "plan", expand, "plan.scatter")
        _done(row, "plan.scatter")
    metadata = found[0]
    paths: list[list[str]] = []

    def sent_results(rank: int) -> list[DcpWriteResult]:  # what PlannedSave.write returns
        # the rank's global plan: what it unpickles, or its local plan (the coordinator's
        # equal copy) with its update applied
        results = dcp_item_results(apply_global_plan_update(central[rank], updates[rank]))
        paths.append(sorted({i.storage_data.relative_path for i in results}))
        return results

    with _paused(pause_gc):  # save_state_dict's gather and finish (write_metadata)
        results = _exchange(
            row,
            "plan",
            "dcp_results",
            (sent_results(r) for r in range(world.size)),
            "finish.gather",
        )
        _done(row, "finish.gather")
        _timed(row, "plan", lambda: writer.finish(metadata, results), "finish.metadata")
        _done(row, "finish.metadata")
        results.clear()
    central.clear()
    updates.clear()
    row.artifacts["dcp_metadata"] = pickle.loads(storage.read(METADATA_FNAME))  # as written
    storage.delete(METADATA_FNAME)
    return _records_of(world, shards_of, paths, writer)


def _scatter_whole(row: Row, step: str, name: str, plans: list[Any], part: str) -> None:
    """:func:`_scatter` of whole global plans, without keeping the pickles: each is
    pickled (timed: the coordinator pickles every rank's), measured and dropped; the
    coordinator's own is unpickled (timed). The ranks' plans are ``plans`` (equal to
    what they unpickle)."""
    gc.collect()
    longest = 0
    for i, plan in enumerate(plans):
        raw = _timed(row, step, functools.partial(_pickled, plan), part)
        longest = max(longest, len(raw))
        if i == 0:
            _timed(row, step, functools.partial(pickle.loads, raw), part)
        del raw
    row.bytes_received[name] = longest + 8 * len(plans)


def dcp_local_step(
    rank: int,
    shards: list[ShardedBase],
    storage: Any,
    planner_class: type[DefaultSavePlanner] = _PackedObjectsSavePlanner,
) -> tuple[CloudStorageWriter, DefaultSavePlanner, SavePlan]:
    """DCP's local step of ``rank`` with cloudckpt's writer and ``planner_class``
    (cloudckpt's planner, as ``dcp_save``, by default)."""
    state, extra = to_dcp_state_dict({str(i): s for i, s in enumerate(shards)})
    writer = CloudStorageWriter(storage, mcore_data=extra)
    planner = planner_class(flatten_state_dict=False, flatten_sharded_tensors=False)
    planner.set_up_planner(state, writer.storage_meta(), rank == 0)
    writer.set_up_storage_writer(rank == 0)
    return writer, planner, writer.prepare_local_plan(planner.create_local_plan())


def dcp_item_results(plan: SavePlan) -> list[DcpWriteResult]:
    """The item results ``write_data`` returns for ``plan`` (one ``.distcp`` object per
    256 items, as for small items packed into objects): each with a
    ``RecordedStorageInfo``, whose record (where a tensor's elements lie in its item)
    the coordinator moves to ``mcore_data``."""
    prefix = plan.storage_data.prefix
    out = []
    for i, item in enumerate(plan.items):
        index: MetadataIndex = item.index
        data = item.tensor_data
        record = None if data is None else (320, math.prod(data.chunk.sizes) * 4)
        path = f"{prefix}{i // 256}.distcp"
        info = RecordedStorageInfo(path, (i % 256) * 4096, 4096, record=record)
        out.append(DcpWriteResult(index, 4096, info))
    return out


# -- the table ---------------------------------------------------------------------------------


def world_of(ranks: int, tp: int, pp: int) -> World:
    """The world of ``ranks`` with the given TP and PP (smaller ones when ranks is small)."""
    tp = min(tp, ranks)
    pp = min(pp, ranks // tp)
    if ranks % (tp * pp):
        raise SystemExit(f"--ranks {ranks} is not a multiple of TP x PP = {tp * pp}")
    return World(tp, pp, ranks // (tp * pp))


def print_table(rows: list[Row]) -> None:
    """Seconds per step, us per (rank x tensor), bytes per rank; ratios to the first row."""
    steps = ["gather", "validate", "plan", "merge"]
    head = f"{'backend':17} {'ranks':>5} {'tensors':>7} {'TPxPPxDP':>10} "
    head += " ".join(f"{s + ' s':>10}" for s in steps)
    head += f" {'total s':>8} {'us/r*t':>7} {'x 1st':>6}"
    head += f" {'sent B/rank: sharding':>21} {'plan':>10} {'commit':>10} {'recv kB/rank':>12}"
    print(head)
    base: dict[str, float] = {}
    for row in rows:
        name = _row_name(row)
        base.setdefault(name, row.us_per_rank_tensor)
        sent = row.bytes_per_rank
        plan_bytes = sent.get("flat", 0) + sent.get("dcp_plan", 0) + sent.get("dcp_results", 0)
        print(
            f"{name:17} {row.ranks:>5} {row.tensors:>7} "
            f"{f'{row.tp}x{row.pp}x{row.dp}':>10} "
            + " ".join(f"{row.seconds.get(s, 0.0):>10.3f}" for s in steps)
            + f" {row.total:>8.2f} {row.us_per_rank_tensor:>7.2f}"
            + f" {row.us_per_rank_tensor / base[name]:>6.2f}"
            + f" {sent.get('sharding', 0):>21,} {plan_bytes:>10,} {sent.get('commit', 0):>10,}"
            + f" {row.received_per_rank / 1e3:>12,.1f}"
        )
    dcp_rows = [row for row in rows if row.global_step]
    if dcp_rows:
        print()
        print_global_steps(dcp_rows)


def _row_name(row: Row) -> str:
    """The backend, and for torch_dist the coordinator's step other than the fast path
    (``torch_dist/dcp``)."""
    step = row.global_step
    return f"{row.backend}/{step}" if step not in ("", "columns") else row.backend


def print_global_steps(rows: list[Row]) -> None:
    """torch_dist: the ``plan`` step by part (the plan collective: its gather, global
    step, scatter; the finish: its gather, ``.metadata``), the bytes one rank sends and
    receives in them, and the peak RSS."""
    parts = [
        "plan",
        "plan.gather",
        "plan.global",
        "plan.scatter",
        "finish",
        "finish.gather",
        "finish.metadata",
    ]
    head = f"{'global step':11} {'ranks':>5} {'tensors':>7} "
    head += " ".join(f"{p + ' s':>{max(len(p) + 2, 8)}}" for p in parts)
    head += f" {'sent B/rank: plan':>17} {'results':>10} {'recv B/rank: plan':>17}"
    head += f" {'peak RSS GiB':>12}"
    print(head)
    for row in rows:
        sent = row.bytes_per_rank
        print(
            f"{row.global_step:11} {row.ranks:>5} {row.tensors:>7} "
            + " ".join(f"{row.parts.get(p, 0.0):>{max(len(p) + 2, 8)}.3f}" for p in parts)
            + f" {sent.get('dcp_plan', 0):>17,} {sent.get('dcp_results', 0):>10,}"
            + f" {row.bytes_received.get('dcp_plans', 0):>17,}"
            + f" {row.peak_rss / 2**30:>12.2f}"
        )


def _json_row(row: Row) -> dict[str, Any]:
    doc = {f.name: getattr(row, f.name) for f in fields(row) if f.name != "artifacts"}
    return {
        **doc,
        "total": row.total,
        "us_per_rank_tensor": row.us_per_rank_tensor,
        "received_per_rank": row.received_per_rank,
    }


def watch_rss(limit: int) -> None:
    """Stop the process (exit status 3, a message on stderr) once its resident set
    passes ``limit`` bytes (checked every 0.2 s by a daemon thread)."""
    page = os.sysconf("SC_PAGE_SIZE")

    def watch() -> None:
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page
            if rss > limit:
                print(f"resident set {rss / 2**30:.2f} GiB > limit: stopped", file=sys.stderr)
                sys.stderr.flush()
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="rss-limit").start()


def pin_one_core() -> int:
    """Pin this process to one of its cores; return that core."""
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--tensors", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--backends", nargs="+", default=["zarr", "torch_dist"])
    parser.add_argument(
        "--global-step",
        choices=[*GLOBAL_STEPS, "both", "all"],
        default="columns",
        help="torch_dist: the coordinator's step, cloudckpt's fast path on plans in columns"
        " (columns), DCP's own on plans as objects (dcp), cloudckpt's linear step on plans"
        " as objects (linear), a row of columns and dcp (both) or of all three (all)",
    )
    parser.add_argument(
        "--no-huge-page-switch",
        action="store_true",
        help="leave numpy's huge page advice as the process has it (cloudckpt's save turns"
        " it off on the coordinator: cloudckpt.dist.coordinating)",
    )
    parser.add_argument(
        "--progress",
        action="store_true",
        help="say on stderr when each part of the torch_dist plan step is done (RSS too)",
    )
    parser.add_argument(
        "--rss-limit-gib",
        type=float,
        help="stop (exit status 3) when this process's resident set passes this many GiB",
    )
    parser.add_argument(
        "--gc-on",
        action="store_true",
        help="leave the garbage collector on where cloudckpt pauses it (for comparison)",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    core = pin_one_core()
    if args.rss_limit_gib:
        watch_rss(int(args.rss_limit_gib * 2**30))
    global PROGRESS  # noqa: PLW0603 - the command line's choice, for the whole run
    PROGRESS = args.progress
    print(f"pinned to core {core} (os.sched_setaffinity); seconds on one core, provisional")
    print(memory_settings())
    switch = "off (--no-huge-page-switch)" if args.no_huge_page_switch else "on"
    print(f"cloudckpt's huge page switch (dist.coordinating): {switch}")
    steps = {"both": ["columns", "dcp"], "all": list(GLOBAL_STEPS)}.get(
        args.global_step, [args.global_step]
    )
    grid = [(r, max(args.tensors)) for r in args.ranks]
    grid += [(max(args.ranks), t) for t in args.tensors if t != max(args.tensors)]
    rows = []
    runs = [(b, s) for b in args.backends for s in (steps if b == "torch_dist" else ["columns"])]
    for backend, step in runs:
        for ranks, tensors in grid:
            world = world_of(ranks, args.tp, args.pp)
            row = simulate(
                backend,
                world,
                tensors,
                pause_gc=not args.gc_on,
                global_step=step,
                huge_page_switch=not args.no_huge_page_switch,
            )
            rows.append(row)
            kernel = sum(row.kernel_seconds.values())
            print(
                f"  {_row_name(row)} {ranks} x {tensors}: {row.total:.2f} s"
                f" ({kernel:.2f} s of it in the kernel; peak RSS {row.peak_rss / 2**30:.2f} GiB)",
                flush=True,
            )
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([_json_row(r) for r in rows], out, indent=1)


if __name__ == "__main__":
    main()
