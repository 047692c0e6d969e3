"""Packaging: declared dependencies match the imports, object-store extras, the license
metadata, and scripts/setup-env.sh (fails with pip, skips a current environment)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from cloudckpt.errors import CheckpointingException, StorageError
from cloudckpt.storage import CheckpointStorage, MissingDependencyError

REPO_ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _name(requirement: str) -> str:
    """Normalised distribution name of a requirement string ("moto[server]>=5" -> "moto")."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def _imported_top_level_modules(package: Path) -> set[str]:
    """Top-level modules imported anywhere in ``package`` (function-level imports too)."""
    modules: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.partition(".")[0])
    return modules - set(sys.stdlib_module_names) - {"cloudckpt"}


# imported only on an extra's code path (cloudckpt/storage/s3.py), from a package that
# the extra's own dependency brings: module -> (the extra's distribution, the module's)
FROM_EXTRAS = {
    "botocore": ("s3fs", "botocore"),
    "aiohttp": ("s3fs", "aiohttp"),  # the request bodies sent from memory (_ViewPayload)
}
# imported only by `cloudckpt bench` (cloudckpt/bench/), declared by its own extra; and
# there only when importable, declared nowhere (the AWS CRT: the user's choice), or
# brought by boto3 (s3transfer, its transfer managers)
FROM_BENCH_EXTRA = {"boto3", "matplotlib"}
BENCH_OPTIONAL = {"awscrt", "s3transfer"}


def _requires(dist: str) -> set[str]:
    return {_name(r) for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r}


def test_runtime_dependencies_are_exactly_the_imported_distributions() -> None:
    by_module = importlib.metadata.packages_distributions()
    imported = {
        _name(dist)
        for module in _imported_top_level_modules(REPO_ROOT / "cloudckpt")
        - set(FROM_EXTRAS)
        - FROM_BENCH_EXTRA
        - BENCH_OPTIONAL
        for dist in by_module[module]
    }
    bench = {_name(r) for r in PROJECT["optional-dependencies"]["bench"]}
    assert bench == FROM_BENCH_EXTRA
    assert "s3transfer" in _requires("boto3")
    for extra_dist, dist in FROM_EXTRAS.values():  # s3fs -> aiobotocore -> botocore
        below = _requires(extra_dist)
        assert dist in below | {d for b in below for d in _requires(b)}, (extra_dist, dist)
    declared = {_name(r) for r in PROJECT["dependencies"]}
    assert declared == imported, (
        f"imported but not declared: {sorted(imported - declared)}; "
        f"declared but not imported: {sorted(declared - imported)}"
    )
    assert {"numcodecs", "fsspec", "torch"} <= declared
    assert not {"zarr", "boto3", "s3fs", "gcsfs"} & declared


def test_object_stores_are_extras_and_dev_includes_all() -> None:
    extras = {k: [_name(r) for r in v] for k, v in PROJECT["optional-dependencies"].items()}
    raw = PROJECT["optional-dependencies"]
    assert extras["s3"] == ["s3fs"]
    assert extras["gcs"] == ["gcsfs"]
    assert raw["all"] == ["cloudckpt[s3,gcs]"]
    assert "cloudckpt[all]" in raw["dev"]
    # only the tests use boto3 (damaging objects) and zarr-python (interoperability)
    assert {"boto3", "zarr", "pytest", "moto"} <= set(extras["dev"])


def test_license_is_an_spdx_expression_built_without_deprecation_warnings(
    tmp_path: Path,
) -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO_ROOT / "LICENSE").read_text()
    requires = PYPROJECT["build-system"]["requires"]
    assert any(
        re.fullmatch(r"setuptools>=(\d+).*", r) and int(r[12:].split(".")[0]) >= 77
        for r in requires
    ), requires
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, src / name)
    (src / "cloudckpt").mkdir()
    (src / "cloudckpt" / "__init__.py").write_text("")
    out = tmp_path / "meta"
    out.mkdir()
    code = (
        "import sys, setuptools.build_meta as b; "
        "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c", code, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Deprecat" not in proc.stdout + proc.stderr, proc.stderr
    metadata = (out / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: s3" in metadata and "Provides-Extra: all" in metadata


def test_editable_install_is_a_path_file_built_without_warnings(tmp_path: Path) -> None:
    # a flat layout without package-dir makes setuptools install a meta path finder and
    # warn ("Editable installation. ... Please be careful with folders in your working
    # directory"), which pip >= 25 prints on every install of scripts/setup-env.sh
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"": "."}
    src = tmp_path / "src"
    (src / "cloudckpt").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO_ROOT / name, src / name)
    (src / "cloudckpt" / "__init__.py").write_text("")
    out = tmp_path / "wheel"
    out.mkdir()
    code = "import sys, setuptools.build_meta as b; print(b.build_editable(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c", code, str(out)],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "Please be careful" not in proc.stderr, proc.stderr
    wheel = out / proc.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        pth = [n for n in archive.namelist() if n.endswith(".pth")]
        assert pth == ["__editable__.cloudckpt-0.1.0.pth"], archive.namelist()
        assert archive.read(pth[0]).decode().strip() == str(src.resolve())


# -- a URI whose object store is not installed -------------------------------------------


@pytest.mark.parametrize(
    ("uri", "package", "protocols", "extra"),
    [
        ("s3://bucket/run/iter_0000010", "s3fs", ("s3", "s3a"), "s3"),
        ("gs://bucket/run/iter_0000010", "gcsfs", ("gs", "gcs"), "gcs"),
    ],
)
def test_uri_of_a_missing_store_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, uri: str, package: str, protocols: tuple[str, ...], extra: str
) -> None:
    # as if the package were not installed: importing it fails, and fsspec has not
    # registered its filesystem yet (an earlier test may have imported it)
    registry = importlib.import_module("fsspec.registry")
    for protocol in protocols:
        monkeypatch.delitem(registry._registry, protocol, raising=False)
    monkeypatch.setitem(sys.modules, package, None)

    with pytest.raises(MissingDependencyError) as info:
        CheckpointStorage(uri)

    error = info.value
    assert isinstance(error, CheckpointingException) and isinstance(error, StorageError)
    assert error.extra == extra
    message = str(error)
    assert uri in message
    assert package in message
    assert f"pip install 'cloudckpt[{extra}]'" in message


def test_local_checkpoints_need_no_extra_and_no_test_tools(tmp_path: Path) -> None:
    """The core install (no extras) saves and loads local checkpoints; s3:// then asks
    for the s3 extra. Run in a fresh interpreter where the extras' and the test tools'
    packages cannot be imported."""
    code = textwrap.dedent(
        """
        import sys
        for name in ("s3fs", "gcsfs", "boto3", "botocore", "aiobotocore", "zarr", "moto"):
            sys.modules[name] = None
        import torch
        import cloudckpt
        from cloudckpt import ShardedTensor
        from cloudckpt.storage import MissingDependencyError

        uri = sys.argv[1]
        weight = torch.arange(12.0).reshape(3, 4)
        cloudckpt.save({"w": ShardedTensor.from_rank_offsets("w", weight), "it": 7}, uri)
        loaded = cloudckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, uri)
        assert torch.equal(loaded["w"], weight) and loaded["it"] == 7, loaded
        try:
            cloudckpt.latest("s3://bucket/run")
        except MissingDependencyError as exc:
            print("missing:", exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "missing: cannot open s3://bucket/run" in proc.stdout, proc.stdout
    assert "pip install 'cloudckpt[s3]'" in proc.stdout
    assert (tmp_path / "ckpt" / "metadata.json").is_file()


# -- scripts/setup-env.sh -----------------------------------------------------------------

# Stands in for .venv/bin/python: logs its arguments, prints the warning line this
# machine's pip config produces, and fails `pip install` when an argument matches
# $FAKE_PIP_FAIL.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../../calls.log"
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "WARNING: Location 'file:///opt/x/' is ignored: it is neither a file nor a directory." >&2
  if [ -n "${FAKE_PIP_FAIL:-}" ] && [[ " $* " == *" $FAKE_PIP_FAIL "* ]]; then
    echo "ERROR: No matching distribution found for torch==2.13.0" >&2
    exit 1
  fi
fi
exit 0
"""

FAKE_CLOUDCKPT = """#!/usr/bin/env bash
echo "cloudckpt $*" >> "$(dirname "$0")/../../calls.log"
"""


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    """A copy of the scripts and install inputs, with a fake .venv."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "scripts", repo / "scripts")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(REPO_ROOT / name, repo / name)
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("cloudckpt", FAKE_CLOUDCKPT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return repo


def _run(repo: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "CLOUDCKPT_REINSTALL"}
    return subprocess.run(
        ["bash", str(repo / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**full_env, **env},
    )


def _pip_installs(repo: Path) -> list[str]:
    log = repo / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [c.removeprefix("-m pip install --quiet ") for c in calls if "pip install" in c]


def test_setup_env_fails_when_pip_fails(fake_repo: Path) -> None:
    proc = _run(fake_repo, "setup-env.sh", FAKE_PIP_FAIL="torch==2.13.0")
    assert proc.returncode != 0
    assert "ERROR: No matching distribution found for torch==2.13.0" in proc.stderr
    assert "pip install -c constraints.txt torch==2.13.0 failed" in proc.stderr
    assert "WARNING: Location" not in proc.stderr
    # nothing after the failure ran, and the environment is not marked current
    assert not any("-e" in c.split() for c in _pip_installs(fake_repo))
    assert not (fake_repo / ".venv" / ".cloudckpt-setup").exists()


def test_setup_env_succeeds_when_the_filter_leaves_no_line(fake_repo: Path) -> None:
    """grep -v exits 1 when pip printed only filtered lines: not a failure."""
    proc = _run(fake_repo, "setup-env.sh", "dev")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert _pip_installs(fake_repo) == [
        "--upgrade pip>=24",
        "-c constraints.txt torch==2.13.0",
        "-c constraints.txt -e .[dev]",
    ]


def test_setup_env_installs_all_by_default_and_only_when_inputs_change(
    fake_repo: Path,
) -> None:
    assert _run(fake_repo, "setup-env.sh").returncode == 0
    assert _pip_installs(fake_repo)[-1] == "-c constraints.txt -e .[all]"

    # current: no pip at all
    assert _run(fake_repo, "setup-env.sh").returncode == 0
    assert _pip_installs(fake_repo) == []
    assert _run(fake_repo, "setup-env.sh", "all").returncode == 0
    assert _pip_installs(fake_repo) == []

    # another extra installs once, and then both are current
    assert _run(fake_repo, "setup-env.sh", "dev").returncode == 0
    assert _pip_installs(fake_repo)[-1] == "-c constraints.txt -e .[dev]"
    for extra in ("dev", "all"):
        assert _run(fake_repo, "setup-env.sh", extra).returncode == 0
        assert _pip_installs(fake_repo) == []

    # a changed pyproject.toml or constraints.txt reinstalls
    with (fake_repo / "pyproject.toml").open("a") as f:
        f.write("\n# changed\n")
    assert _run(fake_repo, "setup-env.sh").returncode == 0
    assert _pip_installs(fake_repo)[-1] == "-c constraints.txt -e .[all]"
    with (fake_repo / "constraints.txt").open("a") as f:
        f.write("six==1.17.0\n")
    assert _run(fake_repo, "setup-env.sh", "all").returncode == 0
    assert len(_pip_installs(fake_repo)) == 3

    # and CLOUDCKPT_REINSTALL forces one
    assert _run(fake_repo, "setup-env.sh", CLOUDCKPT_REINSTALL="1").returncode == 0
    assert len(_pip_installs(fake_repo)) == 3


def test_demo_script_help_skips_the_install_when_current(fake_repo: Path) -> None:
    first = _run(fake_repo, "demo.sh", "--help")
    assert first.returncode == 0, first.stderr
    calls = (fake_repo / "calls.log").read_text()
    assert "-e .[all]" in calls
    assert calls.splitlines()[-1] == "cloudckpt demo --help"
    (fake_repo / "calls.log").unlink()

    second = _run(fake_repo, "demo.sh", "--help")
    assert second.returncode == 0, second.stderr
    calls = (fake_repo / "calls.log").read_text().splitlines()
    assert not [c for c in calls if "pip" in c]
    assert calls[-1] == "cloudckpt demo --help"


# -- the design document ----------------------------------------------------------------


def test_readme_links_the_design_shipped_in_the_repo() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "[docs/design.md](docs/design.md)" in readme
    assert "shared/" not in readme
    assert (REPO_ROOT / "docs" / "design.md").is_file()


def test_design_names_only_modules_that_exist_and_the_commit_objects() -> None:
    design = (REPO_ROOT / "docs" / "design.md").read_text()
    layout = design[design.index("## Package layout") : design.index("## Checkpoint layout")]
    named = set(re.findall(r"(?<!tests/)\b([a-z0-9_]+\.py)\b", layout))
    package = REPO_ROOT / "cloudckpt"
    existing = {p.name for p in package.rglob("*.py")}
    assert named - existing == set()
    # every package is on the map; every module describes itself in its docstring
    packages = {p.parent.relative_to(REPO_ROOT).as_posix() for p in package.rglob("__init__.py")}
    assert {p for p in packages if p.removeprefix("cloudckpt/") not in layout} == set()
    for module in package.rglob("*.py"):
        if module.name != "__main__.py":
            assert ast.get_docstring(ast.parse(module.read_text())), module
    for fact in (
        ".cloudckpt-claim.json",
        "amend_manifest",
        "exchange_tensors",
        "plan_flat_chunks",
        "MissingDependencyError",
    ):
        assert fact in design, fact
    code = "\n".join(p.read_text() for p in package.rglob("*.py"))
    for name in (
        "amend_manifest",
        "exchange_tensors",
        "plan_flat_chunks",
        "MissingDependencyError",
        "check_compatibility",
        "validate_relpath",
    ):
        assert f"def {name}(" in code or f"class {name}(" in code, name
