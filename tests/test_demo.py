"""End-to-end tests of ``cloudckpt demo``: the real command in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Default model: 29 parameters, each with exp_avg and exp_avg_sq. The fused QKV weight and
# bias of both layers (4 parameters, x 3 with their states) are stored as 3 arrays each.
NUM_TENSORS = 29 * 3
NUM_ARRAYS = NUM_TENSORS + 4 * 3 * (3 - 1)


def _demo(uri: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", "demo", "--uri", uri, *extra],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


def _assert_all_match(proc: subprocess.CompletedProcess[str], world_size: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"world size:   {world_size} ranks" in out
    assert f"all {NUM_TENSORS} tensors match on every rank" in out
    assert f"{NUM_TENSORS} per rank, {NUM_ARRAYS} in the checkpoint" in out
    assert re.search(r"save: +[0-9.]+ s, [0-9.]+ MB/s", out), out
    assert re.search(r"load: +[0-9.]+ s, [0-9.]+ MB/s", out), out


def test_demo_four_ranks_reshards_tp2_dp2_to_tp1_dp4(tmp_path: Path) -> None:
    proc = _demo(str(tmp_path / "ckpt"), "--world-size", "4")
    _assert_all_match(proc, 4)
    assert "save layout:  TP=2 x DP=2; load layout: TP=1 x DP=4" in proc.stdout
    assert (tmp_path / "ckpt" / "metadata.json").is_file()


def test_demo_two_ranks(tmp_path: Path) -> None:
    proc = _demo(str(tmp_path / "ckpt"), "--world-size", "2")
    _assert_all_match(proc, 2)
    assert "save layout:  TP=2 x DP=1; load layout: TP=1 x DP=2" in proc.stdout


def test_demo_refuses_existing_checkpoint_unless_overwrite(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    first = _demo(uri, "--world-size", "2")
    assert first.returncode == 0, first.stdout + first.stderr

    second = _demo(uri, "--world-size", "2")
    assert second.returncode == 1
    assert "pass --overwrite" in second.stderr
    assert uri in second.stderr
    assert "Traceback" not in second.stderr

    third = _demo(uri, "--world-size", "2", "--overwrite")
    _assert_all_match(third, 2)


def test_demo_rejects_bad_layout_without_spawning(tmp_path: Path) -> None:
    proc = _demo(str(tmp_path / "ckpt"), "--world-size", "4", "--tp", "3")
    assert proc.returncode == 2
    assert "tp=3 must divide world size 4" in proc.stderr
    assert not (tmp_path / "ckpt").exists()
