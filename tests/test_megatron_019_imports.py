"""What Megatron-Core 0.19.2's own code imports from ``megatron.core.dist_checkpointing``,
resolved in cloudckpt (``-m compat``; the sources of the ``mcore-0.19`` environment).

The import statements of the installed package are read (not run): every
``from megatron.core.dist_checkpointing[.X] import NAME`` (relative ones too) outside
``dist_checkpointing`` itself, with ``megatron.core.dist_checkpointing`` replaced by
``cloudckpt``. Those of ``megatron.core`` (the model, transformer and optimizer code) must
all resolve; ``tests/test_megatron_dropin.py`` runs that code with cloudckpt in place.
Those of ``megatron.training`` (shipped in the same wheel since 0.16; its modules need
Python >= 3.12, ``typing.override``, so they cannot be imported on this machine's 3.11)
must resolve but for the gaps listed in ``docs/megatron-compat.md``, exactly: a new gap,
or a gap closed, fails here until the list and the doc say so.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFIX = "megatron.core.dist_checkpointing"
# (module, name) that megatron.training 0.19.2 imports and cloudckpt does not provide; each
# is named in docs/megatron-compat.md ("Megatron-Core 0.19"), with why
TRAINING_GAPS = {
    (f"{PREFIX}.tensor_aware_state_dict", "MCoreTensorAwareStateDict"),
}


@pytest.fixture(scope="module")
def megatron019() -> Path:
    """The ``megatron`` package directory of the mcore-0.19 environment."""
    from tests.test_megatron_compat import megatron_package  # noqa: PLC0415 - builds the env

    package = megatron_package("mcore-0.19")
    text = (package / "core" / "package_info.py").read_text()
    assert "MINOR = 19" in text and "PATCH = 2" in text, "not Megatron-Core 0.19.2"
    return package


def _module_name(root: Path, path: Path) -> tuple[str, str]:
    """(the module's dotted name, the package its relative imports start from)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _imported(tree: ast.Module, package: str) -> Iterator[tuple[str, str]]:
    """(module, name) of each ``from ... import`` of dist_checkpointing in ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        for alias in node.names:
            if base == "megatron.core" and alias.name == "dist_checkpointing":
                yield PREFIX, ""
            elif base == PREFIX or base.startswith(PREFIX + "."):
                yield base, alias.name


def _imports(root: Path, subpackage: str) -> dict[tuple[str, str], set[str]]:
    """(module, name) -> the modules of ``root/subpackage`` importing it."""
    found: dict[tuple[str, str], set[str]] = {}
    for path in sorted((root / subpackage).rglob("*.py")):
        module, package = _module_name(root, path)
        if module.startswith(PREFIX):
            continue
        with warnings.catch_warnings():  # Megatron's sources hold invalid escapes
            warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
            tree = ast.parse(path.read_text())
        for key in _imported(tree, package):
            found.setdefault(key, set()).add(module)
    return found


def _provided(module: str, name: str) -> bool:
    ours = "cloudckpt" + module[len(PREFIX) :]
    try:
        found = importlib.import_module(ours)
    except ImportError:
        return False
    if not name or name == "*" or hasattr(found, name):
        return True
    try:
        importlib.import_module(f"{ours}.{name}")
    except ImportError:
        return False
    return True


def test_megatron_core_019_imports_resolve_in_cloudckpt(megatron019: Path) -> None:
    imports = _imports(megatron019, "core")
    missing = {key: sorted(users) for key, users in imports.items() if not _provided(*key)}
    assert not missing, missing
    # the model, transformer and optimizer code imports a real share of the module set
    assert len(imports) >= 15, sorted(imports)
    assert {module for module, _ in imports} >= {
        PREFIX,
        f"{PREFIX}.mapping",
        f"{PREFIX}.utils",
        f"{PREFIX}.dict_utils",
    }


def test_megatron_training_019_gaps_are_the_documented_ones(megatron019: Path) -> None:
    imports = _imports(megatron019, "training")
    missing = {key for key in imports if not _provided(*key)}
    assert missing == TRAINING_GAPS, (missing - TRAINING_GAPS, TRAINING_GAPS - missing)
    # and what it does import from the rest resolves: the strategies it builds
    assert len(imports) - len(missing) >= 10, sorted(imports)
    doc = (REPO_ROOT / "docs" / "megatron-compat.md").read_text()
    section = doc[doc.index("## Megatron-Core 0.19") :]
    for module, name in sorted(TRAINING_GAPS):
        assert f"`{name}`" in section, (module, name)
