"""What a save and a load log, with 4 real gloo ranks.

A clean load logs nothing at WARNING or above; cloudckpt's progress lines are INFO; and
the PyTorch DCP calls of the torch_dist backend do not leak PyTorch's DEBUG records into
the caller's handlers, even with the root logger at DEBUG.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import logger as dcp_logger

import cloudckpt
from tests.test_multirank import check_tp, tp_state

BACKENDS = ["torch_dist", "zarr"]


class _All(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _from_torch(record: logging.LogRecord) -> bool:
    """A record of PyTorch's (its loggers, or the root logger called from its code)."""
    return record.name.startswith(("torch", "c10d")) or (
        os.sep + "torch" + os.sep in record.pathname and "cloudckpt" not in record.pathname
    )


def _describe(records: list[logging.LogRecord]) -> list[str]:
    return [f"{r.levelname} {r.name}: {r.getMessage()[:200]}" for r in records]


def _logging_scenario(rank: int, world: int, uri: str, backend: str) -> dict[str, Any]:
    root = logging.getLogger()
    handler, level = _All(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    # as a logging configuration may (dictConfig, pytest's capture): DCP's event logger
    # propagates and torch's loggers are at DEBUG
    dcp_events = dcp_logger._dcp_logger
    dcp_events.propagate = True
    logging.getLogger("torch").setLevel(logging.DEBUG)
    try:
        cloudckpt.save(tp_state(rank, tp=2), uri, sharded_strategy=(backend, 1))
        saved = list(handler.records)
        handler.records.clear()
        loaded = cloudckpt.load(tp_state(rank, tp=4, empty=True), uri)
        assert check_tp(loaded, rank, 4) == 3
        loaded = cloudckpt.load(
            tp_state(rank, tp=2, empty=True), uri, strict="log_all", validate_access_integrity=True
        )
        loads = list(handler.records)
        handler.records.clear()
        # the caller's own DCP calls keep logging: the setup above does leak DCP's records
        dcp.save({f"x{rank}": torch.ones(2)}, checkpoint_id=f"{uri}-plain-dcp")
        own = [r for r in handler.records if _from_torch(r) and r.levelno == logging.DEBUG]
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        dcp_events.propagate = False
        logging.getLogger("torch").setLevel(logging.NOTSET)
    records = saved + loads
    return {
        "torch": _describe([r for r in records if _from_torch(r)]),
        "load_warnings": _describe([r for r in loads if r.levelno >= logging.WARNING]),
        "save_warnings": _describe([r for r in saved if r.levelno >= logging.WARNING]),
        "progress": [
            (r.levelname, r.getMessage())
            for r in records
            if r.name.startswith("cloudckpt")
            and f"rank {rank} " in r.getMessage()
            and (" saved " in r.getMessage() or " loaded " in r.getMessage())
        ],
        "own_dcp_debug": len(own),
        "info": _describe([r for r in records if r.levelno >= logging.INFO]),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_save_and_load_log_no_warnings_and_no_torch_debug(rank_pool, tmp_path, backend):
    for rank, out in enumerate(rank_pool.run(_logging_scenario, str(tmp_path / "ckpt"), backend)):
        assert out["torch"] == [], (rank, out["torch"])
        assert out["load_warnings"] == [], (rank, out["load_warnings"])
        assert out["save_warnings"] == [], (rank, out["save_warnings"])
        levels = [level for level, _ in out["progress"]]
        assert levels == ["DEBUG"] * 3, (rank, out["progress"])  # one save, two loads
        # nothing at INFO or above, as Megatron-Core (its own tests check caplog.text == "")
        assert out["info"] == [], (rank, out["info"])
        assert out["own_dcp_debug"] > 0, rank  # what would have leaked
