"""``cloudckpt demo``: train a tiny tensor- and data-parallel GPT on CPU ranks, save it,
reload it into a different layout and check every tensor.

The model and its sharded state dict are in :mod:`cloudckpt.demo.model`, its distributed
training in :mod:`cloudckpt.demo.train`, the per-rank job in :mod:`cloudckpt.demo.run`
(the state dicts it saves and checks in :mod:`cloudckpt.demo.state`), the summary in
:mod:`cloudckpt.demo.report`.
"""

from __future__ import annotations

from cloudckpt.demo.model import GPTConfig, Layout
from cloudckpt.demo.options import DemoOptions
from cloudckpt.demo.report import DemoResult
from cloudckpt.demo.run import DemoVerificationError, run_demo
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
