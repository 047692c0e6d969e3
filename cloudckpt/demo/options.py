"""What the demo runs (:class:`DemoOptions`) and the checks of its sizes; imported by
the per-rank job (:mod:`.run`) and its parts (:mod:`.resume`, :mod:`.state`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloudckpt.config import CheckpointConfig
from cloudckpt.demo.model import GPTConfig, Layout


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs.

    Attributes:
        uri: checkpoint URI (a local path, ``file://``, ``s3://``, ...), kept as ``str``.
        world_size: number of CPU ranks.
        tp: tensor-parallel size when training and saving (DP = world_size / tp).
        load_tp: tensor-parallel size of the layout loaded back (DP = world_size / load_tp);
            normally different from ``tp``, so the load reshards.
        steps: training steps before the save.
        seed: seed of the initial weights and of the data.
        batch_size: sequences per DP rank and step.
        seq_len: tokens per sequence.
        lr: Adam learning rate.
        config: model sizes.
        checkpoint: storage options, part size, in-flight requests and chunk size
            (from ``--config``); None uses the defaults and the environment.
        resume: ``uri`` is a run URI: resume from its latest committed checkpoint (if
            any), train up to ``steps`` and save under it as ``iter_%07d``
            (:mod:`cloudckpt.demo.resume`).
        save_interval: with ``resume``, also save every this many steps.
        kill_after: with ``resume``, SIGKILL the last rank right after saving this
            iteration (fault injection, to try ``resume``).
    """

    uri: str
    world_size: int = 4
    tp: int = 2
    load_tp: int = 1
    steps: int = 10
    seed: int = 1234
    batch_size: int = 8
    seq_len: int = 32
    lr: float = 1e-3
    config: GPTConfig = field(default_factory=GPTConfig)
    checkpoint: CheckpointConfig | None = None
    resume: bool = False
    save_interval: int | None = None
    kill_after: int | None = None

    def layouts(self, rank: int) -> tuple[Layout, Layout]:
        """The (save, load) layouts of ``rank``."""
        return (
            Layout(self.tp, self.world_size // self.tp, rank),
            Layout(self.load_tp, self.world_size // self.load_tp, rank),
        )


def validate_options(options: DemoOptions) -> None:
    """Raise ValueError when the sizes do not fit together."""
    cfg = options.config
    for name, tp in (("tp", options.tp), ("load_tp", options.load_tp)):
        if tp < 1 or options.world_size % tp:
            raise ValueError(f"{name}={tp} must divide world size {options.world_size}")
        for dim in (cfg.vocab_size, cfg.hidden_size, cfg.ffn_hidden_size):
            if dim % tp:
                raise ValueError(f"{name}={tp} must divide the model size {dim}")
    if not 1 <= options.world_size <= 8:
        raise ValueError(f"world size must be between 1 and 8, got {options.world_size}")
    if options.seq_len > cfg.max_seq_len or options.steps < 1:
        raise ValueError("need steps >= 1 and seq_len <= max_seq_len")
    if options.save_interval is not None and options.save_interval < 1:
        raise ValueError(f"save interval must be >= 1, got {options.save_interval}")
    if not options.resume and (options.save_interval or options.kill_after is not None):
        raise ValueError("--save-interval and --kill-after need --resume")
