"""The ``cloudckpt`` command line as a Unix tool: output piped into a
reader that stops early (``| head -1``) ends the command quietly with status 141, as a
process killed by SIGPIPE; ``ls`` of a prefix whose checkpoints sit one level deeper
says where they are. The real command in a subprocess, through real pipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.cli import EXIT_READER_GONE

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
COMMON_KEYS = 3000  # inspect prints one line per common key: ~190 kB, over a pipe's 64 KiB


def _env(unbuffered: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHONUNBUFFERED"))}
    return {**env, "PYTHONUNBUFFERED": "1"} if unbuffered else env


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cloudckpt", *args]


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A world-of-1 checkpoint whose ``inspect`` output is several pipe buffers long."""
    uri = str(tmp_path_factory.mktemp("unix") / "iter_0000001")
    common = {f"hyperparameter_{i:05d}_{'x' * 40}": i for i in range(COMMON_KEYS)}
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0)), **common}
    cloudckpt.save(state, uri, sharded_strategy=("torch_dist", 1))
    return uri


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_inspect_piped_into_head_ends_quietly(big_checkpoint: str, unbuffered: bool) -> None:
    full = subprocess.run(
        _command("inspect", big_checkpoint),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=REPO_ROOT,
    )
    assert full.returncode == 0 and len(full.stdout) > 2 * 65536, full.stderr
    line = " ".join(_command("inspect", big_checkpoint))
    pipeline = f'{line} | head -n 1; echo "status=${{PIPESTATUS[0]}}"'
    proc = subprocess.run(
        ["bash", "-c", pipeline],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=REPO_ROOT,
        env=_env(unbuffered),
    )
    assert proc.stderr == ""  # no "Broken pipe", no traceback, no "Exception ignored"
    assert proc.stdout.splitlines() == [
        full.stdout.splitlines()[0],
        f"status={EXIT_READER_GONE}",
    ]
    assert EXIT_READER_GONE == 141


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{uri}"),
        ("inspect", "--json", "{uri}"),
        ("verify", "--json", "{uri}"),
        ("ls", "{parent}"),
    ],
    ids=["inspect", "inspect-json", "verify-json", "ls"],
)
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])
def test_a_reader_gone_before_the_first_line_ends_the_command_quietly(
    big_checkpoint: str, args: tuple[str, ...], unbuffered: bool
) -> None:
    places = {"uri": big_checkpoint, "parent": str(Path(big_checkpoint).parent)}
    proc = subprocess.Popen(
        _command(*(a.format(**places) for a in args)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=_env(unbuffered),
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(TIMEOUT_S) == EXIT_READER_GONE, err
    assert err == ""


def test_a_real_error_is_still_reported_when_stdout_is_closed(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _command("inspect", str(tmp_path / "nothing")),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(TIMEOUT_S) == 2
    assert "no checkpoint at" in err and "Broken pipe" not in err, err


# -- ls of a prefix of runs -------------------------------------------------------------------


def _save(uri: str) -> None:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}
    cloudckpt.save(state, uri, sharded_strategy=("torch_dist", 1))


def test_ls_of_a_prefix_of_runs_says_where_the_checkpoints_are(tmp_path: Path) -> None:
    demo = tmp_path / "cloudckpt-demo"  # as `cloudckpt demo` lays it out: run-*/iter_*
    for run, iterations in (("run-a", (10, 20, 30)), ("run-b", (10,))):
        for iteration in iterations:
            _save(str(demo / run / f"iter_{iteration:07d}"))
    (demo / "logs").mkdir()
    (demo / "logs" / "rank0.log").write_text("not a checkpoint\n")

    def ls(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _command("ls", *args),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
            cwd=REPO_ROOT,
        )

    table = ls(str(demo))
    assert table.returncode == 0 and table.stderr == "", table.stderr
    assert table.stdout.splitlines() == [
        f"no checkpoints directly under {demo}; found checkpoints one level down in:",
        f"  {demo}/run-a (3 checkpoints)",
        f"  {demo}/run-b (1 checkpoint)",
        f"run `cloudckpt ls {demo}/run-a` to list them",
    ]
    as_json = ls(str(demo), "--json")  # the document stays a list; the hint goes to stderr
    assert as_json.returncode == 0 and json.loads(as_json.stdout) == []
    assert f"  {demo}/run-a (3 checkpoints)" in as_json.stderr.splitlines()
    followed = ls(f"{demo}/run-a")
    assert followed.returncode == 0
    assert followed.stdout.splitlines()[-1].startswith(f"3 checkpoints under {demo}/run-a")
    nothing = ls(str(tmp_path / "nothing"))  # the README's contract: nothing stored, exit 2
    assert nothing.returncode == 2 and "nothing is stored there" in nothing.stderr
