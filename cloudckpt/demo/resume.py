"""Resuming the demo from the latest checkpoint of a run (``cloudckpt demo --resume``).

With ``--resume`` the demo's URI is a *run* URI: checkpoints go under it as
``<run>/iter_0000010``, ``<run>/iter_0000020``, ... (every ``save_interval`` steps and
after the last one), and a start finds :func:`cloudckpt.latest` of the run (listed once,
on rank 0, and shared), loads the model and Adam state into the trainer's layout,
restores each rank's torch RNG state and the step count, and trains on from there. The
data of step ``n`` depends only on ``n`` and Adam only on the state and ``n``, so a run
that was killed and resumed ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING, Any

import torch

from cloudckpt.demo.model import model_sharded_state_dict, optimizer_sharded_state_dict
from cloudckpt.demo.train import Trainer
from cloudckpt.mapping import ShardedObject, ShardedStateDict
from cloudckpt.redact import redact_uri
from cloudckpt.serialization import load
from cloudckpt.tracker import latest

if TYPE_CHECKING:
    from cloudckpt.demo.options import DemoOptions

logger = logging.getLogger(__name__)

ITER_FORMAT = "iter_{:07d}"


def checkpoint_uri(run_uri: str, iteration: int) -> str:
    """``<run>/iter_0000010``: where the checkpoint of ``iteration`` goes."""
    return f"{run_uri.rstrip('/')}/{ITER_FORMAT.format(iteration)}"


def save_iterations(start: int, steps: int, interval: int | None) -> list[int]:
    """Iterations after ``start`` (up to ``steps``) that end with a save: every multiple of
    ``interval`` (None: none) and the last one."""
    its = [i for i in range(start + 1, steps + 1) if interval and i % interval == 0]
    if steps > start and (not its or its[-1] != steps):
        its.append(steps)
    return its


def restore(trainer: Trainer, options: DemoOptions) -> tuple[str | None, int]:
    """Collective: load the latest committed checkpoint under the run URI into ``trainer``.

    Model weights, Adam moments, the step count and this rank's torch RNG state are
    restored (the checkpoint must come from the same world size: the RNG state is one
    object per rank; the TP layout may differ, the load reshards).

    Returns:
        (the checkpoint's URI, its iteration), or (None, 0) when the run has none.
    """
    found = latest(options.uri, config=options.checkpoint, collective=True)
    if found is None:
        logger.info("no committed checkpoint under %s: starting at 0", redact_uri(options.uri))
        return None, 0
    lay, world = trainer.layout, options.world_size
    params = {k: torch.empty_like(v) for k, v in trainer.params.items()}
    states = {k: {n: torch.empty_like(t) for n, t in s.items()} for k, s in trainer.states.items()}
    request: ShardedStateDict = {
        "model": model_sharded_state_dict(params, trainer.specs, lay),
        "optimizer": {"state": optimizer_sharded_state_dict(states, trainer.specs, lay)},
        "rng_state": ShardedObject("rng_state", None, (world,), (lay.rank,), replica_id=0),
    }
    result = load(request, found, config=options.checkpoint)
    loaded: dict[str, Any] = result[0] if isinstance(result, tuple) else result
    for key in trainer.params:
        trainer.params[key] = loaded["model"][key].contiguous().clone()
        for name in trainer.states[key]:
            trainer.states[key][name] = loaded["optimizer"]["state"][key][name].contiguous().clone()
    iteration = int(loaded["iteration"])
    trainer.step_count = iteration
    torch.set_rng_state(loaded["rng_state"]["torch_rng"])
    logger.info("resumed from %s (iteration %d)", redact_uri(found), iteration)
    return found, iteration


def maybe_kill(options: DemoOptions, rank: int, iteration: int) -> None:
    """Fault injection for trying ``--resume``: SIGKILL the last rank once the checkpoint
    of ``options.kill_after`` has been saved (no cleanup, as a lost node)."""
    if options.kill_after == iteration and rank == options.world_size - 1:
        logger.warning("--kill-after %d: killing rank %d (pid %d)", iteration, rank, os.getpid())
        os.kill(os.getpid(), signal.SIGKILL)
