"""``cloudckpt.megatron``: the import hook and ``python -m cloudckpt.megatron SCRIPT``.

A stand-in ``megatron.core`` package (an empty one, in a temporary directory) lets the
hook be tested without Megatron-Core; the Megatron-Core environments' tests
(``tests/compat/mcore_dropin.py``) run Megatron's own code through the same hook."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cloudckpt.errors import CheckpointingException

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import cloudckpt.serialization
import cloudckpt.strategies.torch
import megatron.core.dist_checkpointing as dc
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
assert dc is sys.modules["cloudckpt"] and serialization is cloudckpt.serialization
assert TorchDistSaveShardedStrategy is cloudckpt.strategies.torch.TorchDistSaveShardedStrategy
assert __name__ == "__main__"
try:
    import megatron.core.dist_checkpointing.no_such_module  # noqa: F401
except ModuleNotFoundError as exc:
    assert "redirected to 'cloudckpt.no_such_module'" in str(exc), exc
else:
    raise AssertionError("a module cloudckpt lacks was found")
print("ARGV", sys.argv)
print("PATH0", sys.path[0])
"""


def _fake_megatron(root: Path) -> Path:
    core = root / "site" / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "site" / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    return root / "site"


def _run(args: list[str], site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{site}"}
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt.megatron", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_script_runs_with_cloudckpt_in_place_of_dist_checkpointing(tmp_path: Path) -> None:
    site = _fake_megatron(tmp_path)
    script = tmp_path / "scripts" / "pretrain.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    done = _run([str(script), "--save", "s3://bucket/run", "--tp", "2"], site)
    assert done.returncode == 0, done.stderr
    assert f"ARGV {[str(script), '--save', 's3://bucket/run', '--tp', '2']}" in done.stdout
    assert f"PATH0 {script.parent}" in done.stdout  # as `python SCRIPT` would


def test_a_module_runs_with_dash_m(tmp_path: Path) -> None:
    site = _fake_megatron(tmp_path)
    (site / "train_mod.py").write_text(SCRIPT)
    done = _run(["-m", "train_mod", "x"], site)
    assert done.returncode == 0, done.stderr
    # runpy puts the module's file first in sys.argv, as `python -m MODULE` does
    assert f"ARGV {[str(site / 'train_mod.py'), 'x']}" in done.stdout, done.stdout


def test_usage_errors(tmp_path: Path) -> None:
    site = _fake_megatron(tmp_path)
    missing = _run([str(tmp_path / "nope.py")], site)
    assert missing.returncode == 2 and "no such script" in missing.stderr
    assert "nope.py" in missing.stderr
    bare = _run([], site)
    assert bare.returncode == 2 and "usage: python -m cloudckpt.megatron" in bare.stderr


def test_install_after_megatrons_own_import_is_refused(tmp_path: Path) -> None:
    import cloudckpt.megatron as hook  # noqa: PLC0415

    site = _fake_megatron(tmp_path)
    own = site / "megatron" / "core" / "dist_checkpointing"
    own.mkdir()
    (own / "__init__.py").write_text("")
    code = (
        "import megatron.core.dist_checkpointing\n"
        "import cloudckpt.megatron as h\n"
        "try:\n    h.install()\n"
        "except h.MegatronAlreadyImportedError as exc:\n    print('REFUSED', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{site}"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert "REFUSED megatron.core.dist_checkpointing was imported before" in done.stdout, (
        done.stdout + done.stderr
    )
    assert issubclass(hook.MegatronAlreadyImportedError, CheckpointingException)


def test_install_is_idempotent() -> None:
    import cloudckpt.megatron as hook  # noqa: PLC0415

    before = list(sys.meta_path)
    try:
        first = hook.install()
        assert hook.install() is first and hook.installed() is first
        assert sys.meta_path.count(first) == 1
    finally:
        sys.meta_path[:] = before
    assert hook.installed() is None
