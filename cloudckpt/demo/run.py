"""The demo job: train a tiny sharded GPT on N CPU ranks, save, reshard-load, check.

:func:`run_demo` spawns ``world_size`` gloo ranks (:func:`cloudckpt.launch.run_on_ranks`).
Each rank

1. holds its TP x DP shard of the model and its DP range of the Adam state and trains
   a few steps (:class:`~cloudckpt.demo.train.Trainer`),
2. gathers reference copies of every full tensor, saves with :func:`cloudckpt.save`,
3. builds the sharded state dict of a different TP x DP layout, loads it with
   :func:`cloudckpt.load` and compares every tensor bit for bit, plus the common
   state, the per-rank ShardedObject and the LocalNonpersistentObject.

Rank 0 returns a :class:`~cloudckpt.demo.report.DemoResult`; mismatches raise
:class:`DemoVerificationError`. The state dicts and the check are in
:mod:`cloudckpt.demo.state`, the summary printed in :mod:`cloudckpt.demo.report`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as torch_dist

from cloudckpt.config import CheckpointConfig
from cloudckpt.demo import resume
from cloudckpt.demo.model import checkpoint_tensor_keys
from cloudckpt.demo.options import DemoOptions, validate_options
from cloudckpt.demo.report import DemoResult
from cloudckpt.demo.state import (
    _check_common,
    _check_tensors,
    _expected_tensors,
    _load_state_dict,
    _save_state_dict,
)
from cloudckpt.demo.train import STATE_NAMES, Trainer
from cloudckpt.errors import CheckpointingException
from cloudckpt.launch import run_on_ranks
from cloudckpt.manifest import MANIFEST_FNAME, Manifest
from cloudckpt.mapping import ShardedStateDict
from cloudckpt.serialization import get_default_save_sharded_strategy, load, save
from cloudckpt.storage import open_checkpoint

logger = logging.getLogger(__name__)


class DemoVerificationError(CheckpointingException, AssertionError):
    """The reloaded state differs from what was saved; ``mismatches`` lists every difference."""

    def __init__(self, message: str, mismatches: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.mismatches = tuple(mismatches)


class DestinationNotEmptyError(CheckpointingException, FileExistsError):
    """The demo's checkpoint URI already holds objects and ``overwrite`` was not given."""


# -- parent side ------------------------------------------------------------------------


def default_tp_sizes(world_size: int, tp: int | None = None) -> tuple[int, int]:
    """Default (save TP, load TP) so that the load reshards where the world size allows.

    Save with TP=2 when the world size is even, else TP=1; load with TP=1, or with TP=2
    when saving with TP=1 and the world size is even. An odd world size (the model's
    sizes are powers of two) saves and loads with TP=1: nothing is resharded.
    """
    even = world_size % 2 == 0
    save_tp = tp if tp is not None else (2 if even else 1)
    return save_tp, (2 if save_tp == 1 and even else 1)


def prepare_destination(
    uri: str, overwrite: bool, checkpoint: CheckpointConfig | None = None
) -> None:
    """Make sure ``uri`` holds no objects: refuse, or delete them with ``overwrite``.

    Raises:
        DestinationNotEmptyError: objects exist and ``overwrite`` is False.
    """
    store = open_checkpoint(uri, config=checkpoint)
    existing = store.list()
    if not existing:
        return
    if not overwrite:
        raise DestinationNotEmptyError(
            f"{uri} already holds {len(existing)} objects (e.g. {existing[0]}); "
            "pass --overwrite to replace them or choose another --uri"
        )
    logger.info("deleting %s existing objects under %s", len(existing), uri)
    store.map(store.delete, existing)


def run_demo(options: DemoOptions) -> DemoResult:
    """Run the whole demo on ``options.world_size`` spawned ranks.

    The checkpoint URI should hold nothing yet (see :func:`prepare_destination`).

    Raises:
        ValueError: inconsistent options.
        DemoVerificationError: the reloaded state differs (every difference listed).
        DistributedCheckpointError: a rank failed (its traceback is in the message).
    """
    validate_options(options)
    result: DemoResult = run_on_ranks(_rank_main, options.world_size, (options,))[0]
    if result.mismatches:
        shown = "\n".join(result.mismatches[:50])
        raise DemoVerificationError(
            f"{len(result.mismatches)} differences after reloading {options.uri}:\n{shown}",
            result.mismatches,
        )
    return result


# -- rank side ----------------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, options: DemoOptions) -> DemoResult | None:
    """One rank's job: train, save, load into the other layout, check; rank 0 reports."""
    torch.manual_seed(options.seed + rank)
    torch.set_num_threads(1)
    import_s = _timed(lambda: _import_backend(options))
    save_layout, load_layout = options.layouts(rank)
    trainer = Trainer(
        options.config, save_layout, options.seed, options.lr, options.batch_size, options.seq_len
    )
    resumed_from: str | None = None
    if options.resume:
        resumed_from, start = resume.restore(trainer, options)
        losses, save_s, options = _train_resumable(trainer, options, rank, start)
    else:
        start = 0
        losses = [trainer.step() for _ in range(options.steps)]
        rng_obj = {"rank": rank, "torch_rng": torch.get_rng_state(), "samples": options.steps}
        state = _save_state_dict(trainer, options, rng_obj)
        save_s = _timed(lambda: save(state, options.uri, config=options.checkpoint))
    # from here on, options.uri is the checkpoint saved last and options.steps its iteration
    rng_obj = {"rank": rank, "torch_rng": torch.get_rng_state(), "samples": options.steps}
    ref_params, ref_states = trainer.reference()
    stored = _manifest(options) if rank == 0 else None
    request = _load_state_dict(trainer.specs, load_layout, options)
    loaded: dict[str, Any] = {}
    load_s = _timed(lambda: loaded.update(_load(request, options)))
    expected = _expected_tensors(trainer.specs, load_layout, ref_params, ref_states)
    mismatches = _check_tensors(rank, loaded, expected) + _check_common(options, loaded, rng_obj)
    all_mismatches = [m for ms in _all_gather_objects(mismatches) for m in ms]
    if rank != 0:
        return None
    return DemoResult(
        world_size=world_size,
        save_layout=save_layout.describe(),
        load_layout=load_layout.describe(),
        num_tensors=len(expected),
        num_arrays=len(checkpoint_tensor_keys(trainer.specs, STATE_NAMES)),
        tensor_bytes=sum(s.numel for s in trainer.specs) * 4 * (1 + len(STATE_NAMES)),
        stored_objects=len(stored.objects) if stored else 0,
        stored_bytes=stored.total_size if stored else 0,
        save_s=save_s,
        load_s=load_s,
        backend=_backend(options),
        import_s=import_s,
        first_loss=losses[0] if losses else math.nan,
        last_loss=losses[-1] if losses else math.nan,
        mismatches=tuple(all_mismatches),
        checkpoint_uri=options.uri,
        resumed_from=None if not options.resume else resumed_from or "",
        start_iteration=start,
    )


def _train_resumable(
    trainer: Trainer, options: DemoOptions, rank: int, start: int
) -> tuple[list[float], float, DemoOptions]:
    """Train from ``start`` to ``options.steps``, saving ``<run>/iter_%07d`` along the way.

    Returns:
        The losses, the time of the last save, and ``options`` with ``uri`` and ``steps``
        set to the checkpoint saved last (the one resumed from when nothing was left to
        train) for the reload check.
    """
    saves = resume.save_iterations(start, options.steps, options.save_interval)
    losses: list[float] = []
    save_s, last = 0.0, start
    for iteration in saves:
        losses += [trainer.step() for _ in range(iteration - trainer.step_count)]
        rng_obj = {"rank": rank, "torch_rng": torch.get_rng_state(), "samples": iteration}
        at = replace(options, uri=resume.checkpoint_uri(options.uri, iteration), steps=iteration)
        state = _save_state_dict(trainer, at, rng_obj)
        save_s = _timed(functools.partial(save, state, at.uri, config=at.checkpoint))
        resume.maybe_kill(options, rank, iteration)
        last = iteration
    final = resume.checkpoint_uri(options.uri, last)
    return losses, save_s, replace(options, uri=final, steps=last)


def run_demo_in_process_group(options: DemoOptions) -> DemoResult | None:
    """Run the demo on this process as one rank of a group launched by torchrun (the
    environment's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 returns the result.

    Raises:
        DemoVerificationError: the reloaded state differs.
    """
    validate_options(options)
    torch_dist.init_process_group("gloo")
    try:
        result = _rank_main(torch_dist.get_rank(), torch_dist.get_world_size(), options)
    finally:
        torch_dist.destroy_process_group()
    if result is not None and result.mismatches:
        raise DemoVerificationError(
            f"{len(result.mismatches)} differences after reloading {result.checkpoint_uri}",
            result.mismatches,
        )
    return result


def _manifest(options: DemoOptions) -> Manifest:
    """The saved checkpoint's manifest: what ``cloudckpt verify`` counts."""
    store = open_checkpoint(options.uri, config=options.checkpoint)
    return Manifest.from_json(store.read(MANIFEST_FNAME), store.child_uri(MANIFEST_FNAME))


def _load(request: ShardedStateDict, options: DemoOptions) -> dict[str, Any]:
    result = load(request, options.uri, config=options.checkpoint)
    return result[0] if isinstance(result, tuple) else result


def _all_gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def _backend(options: DemoOptions) -> str:
    return options.checkpoint.backend if options.checkpoint is not None else "torch_dist"


def _import_backend(options: DemoOptions) -> None:
    """Import the save backend's modules now, as a training job's start-up does (importing
    Megatron-Core loads torch.distributed.checkpoint): cloudckpt, like Megatron-Core,
    imports a backend on its first use, and the first ``import torch.distributed.checkpoint``
    of a process takes seconds, which the demo reports apart from the save's time."""
    get_default_save_sharded_strategy(_backend(options))


def _timed(fn: Callable[[], object]) -> float:
    """Wall time of ``fn`` on all ranks, from a barrier before to a barrier after."""
    torch_dist.barrier()
    start = time.perf_counter()
    fn()
    torch_dist.barrier()
    return time.perf_counter() - start
