"""Start-up cost: the command lines that need no tensors never import torch, and the
public API (imported lazily) stays what it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor

REPO_ROOT = Path(__file__).resolve().parents[1]

# runs the CLI in-process, then reports which heavy modules it imported
_PROBE = textwrap.dedent(
    """
    import sys
    from cloudckpt import cli
    try:
        status = cli.main(sys.argv[1:])
    except SystemExit as exc:
        status = exc.code
    print("STATUS", status, "TORCH", "torch" in sys.modules, "NUMPY", "numpy" in sys.modules)
    """
)


def _probe(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("imports") / "run"
    for iteration in (1, 2):
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(3)), "it": iteration}
        cloudckpt.save(state, str(run / f"iter_{iteration:07d}"))
    return run


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["ls", "{run}"],
        ["inspect", "{run}/iter_0000002"],
        ["verify", "{run}/iter_0000002", "--deep"],
        ["gc", "{run}", "--keep-last", "1", "--dry-run"],
        ["rm", "{run}/iter_0000001", "--yes"],
    ],
    ids=lambda args: args[0],
)
def test_commands_without_tensors_do_not_import_torch(run_dir: Path, args: list[str]) -> None:
    line = _probe(*(a.format(run=run_dir) for a in args))
    assert line == "STATUS 0 TORCH False NUMPY False", line


def test_import_cloudckpt_is_lazy_and_the_api_resolves() -> None:
    code = textwrap.dedent(
        """
        import sys
        import cloudckpt
        assert "torch" not in sys.modules, "import cloudckpt imported torch"
        from cloudckpt import save, load, ShardedTensor, verify, StrictHandling, config
        assert "torch" in sys.modules
        missing = [n for n in cloudckpt.__all__ if not hasattr(cloudckpt, n)]
        assert not missing, missing
        assert set(cloudckpt.__all__) <= set(dir(cloudckpt))
        assert config.__name__ == "cloudckpt.config"
        assert save.__module__ == "cloudckpt.serialization"
        print("OK")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.stdout.strip() == "OK", proc.stdout + proc.stderr


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = cloudckpt.no_such_name  # type: ignore[attr-defined]
    assert cloudckpt.ShardedTensor is ShardedTensor
