"""``cloudckpt demo``: train a tiny tensor- and data-parallel GPT on CPU ranks, save it,
reload it into a different layout and check every tensor.

The model and its sharded state dict are in :mod:`cloudckpt.demo.model`, its distributed
training in :mod:`cloudckpt.demo.train`, the per-rank job and the summary in
:mod:`cloudckpt.demo.run`.
"""

from __future__ import annotations

from cloudckpt.demo.model import GPTConfig, Layout
from cloudckpt.demo.run import DemoOptions, DemoResult, DemoVerificationError, run_demo
from cloudckpt.demo.train import Trainer

__all__ = [
    "DemoOptions",
    "DemoResult",
    "DemoVerificationError",
    "GPTConfig",
    "Layout",
    "Trainer",
    "run_demo",
]
