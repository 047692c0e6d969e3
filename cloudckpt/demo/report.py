"""What the demo reports: rank 0's :class:`DemoResult`, its printed summary, and the
``cloudckpt ls`` / ``cloudckpt verify`` commands that look at the checkpoint afterwards,
runnable as printed (:func:`next_step_lines`). Imports no torch.
"""

from __future__ import annotations

import os
import posixpath
import shlex
import shutil
import sys
from dataclasses import dataclass

from cloudckpt.redact import redact_uri


@dataclass(frozen=True)
class DemoResult:
    """What rank 0 reports. Sizes in bytes, times in seconds.

    Attributes:
        world_size: ranks that ran.
        save_layout: e.g. ``"TP=2 x DP=2"``.
        load_layout: e.g. ``"TP=1 x DP=4"``.
        num_tensors: tensors in each rank's state dict (model + optimizer), each a shard
            of a global tensor.
        num_arrays: global tensors stored in the checkpoint (fused QKV stored as q, k, v).
        tensor_bytes: bytes of all global tensors (the payload saved and loaded).
        stored_objects: objects of the checkpoint as ``cloudckpt verify`` counts them:
            those its manifest lists (every object but manifest.json and metadata.json).
        stored_bytes: their total size.
        save_s: wall time of ``save`` (all ranks, barrier to barrier; the last one with
            ``resume``).
        load_s: wall time of ``load``.
        first_loss: DP-mean loss of the first step.
        last_loss: DP-mean loss of the last step.
        mismatches: differences found after the reload (empty when all match).
        checkpoint_uri: the checkpoint saved last and reloaded (with ``resume``:
            ``<run>/iter_%07d``; else the demo's URI).
        resumed_from: with ``resume``, the checkpoint the run resumed from, or "" when
            the run had none; None without ``resume``.
        start_iteration: the iteration training started from.
        backend: the sharded backend saved with (``torch_dist`` or ``zarr``).
        import_s: wall time of importing that backend's modules at start-up, before
            training (a process's first ``import torch.distributed.checkpoint`` takes
            seconds; cloudckpt, like Megatron-Core, imports a backend on first use).
    """

    world_size: int
    save_layout: str
    load_layout: str
    num_tensors: int
    num_arrays: int
    tensor_bytes: int
    stored_objects: int
    stored_bytes: int
    save_s: float
    load_s: float
    first_loss: float
    last_loss: float
    mismatches: tuple[str, ...] = ()
    checkpoint_uri: str = ""
    resumed_from: str | None = None
    start_iteration: int = 0
    backend: str = "torch_dist"
    import_s: float = 0.0

    def summary_lines(self, uri: str) -> list[str]:
        """Human-readable summary, one line each."""
        mb = self.tensor_bytes / 1e6
        resharded = ", after resharding" if self.save_layout != self.load_layout else ""
        lines = [
            f"checkpoint:   {redact_uri(uri)}",
            f"world size:   {_plural(self.world_size, 'rank')} (gloo, CPU)",
            f"save layout:  {self.save_layout}; load layout: {self.load_layout}",
            *self._resume_lines(),
            f"training:     loss {self.first_loss:.4f} -> {self.last_loss:.4f}",
            f"tensors:      {self.num_tensors} per rank (each rank's state dict holds its shard "
            "of every model and Adam tensor)",
            f"              {self.num_arrays} in the checkpoint (whole tensors; the fused QKV "
            f"stored as q, k, v), {mb:.2f} MB",
            f"objects:      {self.stored_objects} in the checkpoint, "
            f"{self.stored_bytes / 1e6:.2f} MB (counted as `cloudckpt verify` does:",
            "              the manifest's objects, without manifest.json and metadata.json)",
            f"backend:      {self.backend}, imported at start-up in {self.import_s:.3f} s "
            "(before training; not in the save)",
            f"save:         {self.save_s:.3f} s, {mb / max(self.save_s, 1e-9):.1f} MB/s",
            f"load:         {self.load_s:.3f} s, {mb / max(self.load_s, 1e-9):.1f} MB/s",
        ]
        if self.mismatches:
            lines.append(f"MISMATCH:     {len(self.mismatches)} differences")
        else:
            lines.append(
                f"result:       all {self.num_tensors} tensors match on every rank "
                f"(bit for bit{resharded})"
            )
        return lines

    def _resume_lines(self) -> list[str]:
        if self.resumed_from is None:
            return []
        if not self.resumed_from:
            return ["resumed:      no committed checkpoint in the run yet: started at 0"]
        return [
            f"resumed:      from {redact_uri(self.resumed_from)} (iteration {self.start_iteration})"
        ]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def cli_command(
    executable: str | None = None, path: str | None = None, cwd: str | None = None
) -> str:
    """How to run ``cloudckpt`` from ``cwd`` with this installation, as a shell word list.

    ``cloudckpt`` when the console script on ``PATH`` is this interpreter's; else that
    script by path (relative to ``cwd`` when below it, e.g. ``.venv/bin/cloudckpt``);
    else ``<python> -m cloudckpt``. Arguments default to this process's.
    """
    executable = executable or sys.executable
    cwd = cwd or os.getcwd()
    script = os.path.join(os.path.dirname(executable), "cloudckpt")
    if not os.access(script, os.X_OK):
        return f"{shlex.quote(_shorten(executable, cwd))} -m cloudckpt"
    on_path = shutil.which("cloudckpt", path=path)
    if on_path and os.path.realpath(on_path) == os.path.realpath(script):
        return "cloudckpt"
    return shlex.quote(_shorten(script, cwd))


def _shorten(path: str, cwd: str) -> str:
    """``path`` relative to ``cwd`` when below it (and ``cwd`` is not ``/``), else as is."""
    rel = os.path.relpath(path, cwd)
    return path if rel.startswith("..") or os.path.dirname(cwd) == cwd else rel


def next_step_lines(uri: str, command: str | None = None, config: str | None = None) -> list[str]:
    """The commands that list and check the demo's checkpoint, runnable as printed
    (``config``: the demo's ``--config`` file, which they need too)."""
    shown = redact_uri(uri)
    if shown.startswith("memory://"):
        return [
            "next:         memory:// lives only in this process and is gone now; to look at",
            "              the checkpoint afterwards, pass a path or an s3:// or gs:// --uri",
        ]
    command = command or cli_command()
    run_dir = posixpath.dirname(shown.rstrip("/")) or "."
    if "://" in shown and "://" not in run_dir:
        run_dir = shown  # the URI is a bucket root: nothing above it to list
    options = f" --config {shlex.quote(config)}" if config else ""
    # relative paths (of the command, a local checkpoint, the config) hold from here
    words = (shlex.split(command)[0], shown, config or "/")
    relative = [w for w in words if "://" not in w and w != "cloudckpt"]
    where = f" (from {os.getcwd()})" if any(not os.path.isabs(w) for w in relative) else ""
    return [
        f"next steps{where}:",
        f"  {command} ls {shlex.quote(run_dir)}{options}",
        f"  {command} verify {shlex.quote(shown)} --deep{options}",
    ]
