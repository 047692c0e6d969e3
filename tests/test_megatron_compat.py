"""Compatibility with real Megatron-Core releases, both ways (select with ``-m compat``).

* Megatron-Core 0.15.3 (the last with the zarr backend): a checkpoint it saves with
  ``("zarr", 1)`` loads in cloudckpt, resharded, bfloat16 included, and its arrays are
  byte for byte what cloudckpt writes; a cloudckpt zarr checkpoint loads in its
  ``dist_checkpointing.load`` (default TensorStore loader and ZarrLoadShardedStrategy),
  resharded, and in its ``load_plain_tensors``.
* Megatron-Core 0.19 (current, torch_dist): a cloudckpt torch_dist checkpoint loads
  in its ``dist_checkpointing.load`` resharded with ``strict="raise_all"``, and one it
  saves (common state as the DCP object ``common_state``) loads in cloudckpt.

Megatron-Core runs in its own virtual environment, built and cached by
``scripts/compat-env.sh`` (a session fixture runs it; the first build takes about a
minute), under the script ``tests/compat/mcore_ckpt.py`` on gloo CPU ranks; the two
sides exchange checkpoints through directories and compare SHA-256 digests of every
tensor's bytes with the values both derive from ``tests/compat/spec.py``. Where an
environment cannot be installed here (no package index, no wheel for this platform),
its tests are skipped with the pip error; any other failure fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.checker import MEGATRON_INTEGRITY_FNAME, check_integrity
from cloudckpt.errors import IntegrityCheckError, StrategyNotFoundError
from cloudckpt.strategies.base import get_default_strategy
from tests.compat import spec

# the first build of an environment can take minutes; later runs find it cached
pytestmark = [pytest.mark.compat, pytest.mark.timeout(1200)]


REPO_ROOT = Path(__file__).resolve().parents[1]
MCORE_SCRIPT = REPO_ROOT / "tests" / "compat" / "mcore_ckpt.py"
ENV_SCRIPT = REPO_ROOT / "scripts" / "compat-env.sh"
INSTALL_IMPOSSIBLE = 3  # scripts/compat-env.sh: pip could not install the pinned packages
SAVE_WORLD = 4  # ranks that save (both sides); loads use other layouts
ALL_TENSORS = sorted(spec.TENSORS)


@dataclass(frozen=True)
class MegatronEnv:
    """A virtual environment with one Megatron-Core release (built by compat-env.sh)."""

    name: str
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, out: Path, *args: str) -> dict[str, Any]:
        """Run ``tests/compat/mcore_ckpt.py ARGS --out OUT``; its JSON result."""
        cmd = [str(self.python), str(MCORE_SCRIPT), *args, "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=out.parent
        )
        assert proc.returncode == 0, (
            f"{self.name}: {' '.join(cmd[1:])} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def _build(name: str) -> MegatronEnv:
    proc = subprocess.run(
        ["bash", str(ENV_SCRIPT), name],
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    if proc.returncode == INSTALL_IMPOSSIBLE:
        pytest.skip(
            f"!!! MEGATRON-CORE COMPATIBILITY NOT TESTED: environment {name} cannot be "
            f"installed on this machine (scripts/compat-env.sh {name}); pip said:\n"
            f"{proc.stderr[-3000:]}"
        )
    assert proc.returncode == 0, (
        f"scripts/compat-env.sh {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    )
    venv = Path(proc.stdout.strip().splitlines()[-1])
    assert (venv / "bin" / "python").is_file(), proc.stdout + proc.stderr
    return MegatronEnv(name, venv)


def megatron_package(name: str) -> Path:
    """The installed ``megatron`` package directory of compat environment ``name``
    (built and cached if needed), for tests that read Megatron-Core's sources."""
    env = _build(name)
    found = sorted(env.venv.glob("lib/python*/site-packages/megatron"))
    assert found and (found[0] / "core" / "dist_checkpointing").is_dir(), env.venv
    return found[0]


@pytest.fixture(scope="session")
def mcore15() -> MegatronEnv:
    return _build("mcore-0.15")


@pytest.fixture(scope="session")
def mcore19() -> MegatronEnv:
    return _build("mcore-0.19")


def _require_torch_dist() -> None:
    """cloudckpt's torch_dist backend must be there: a missing one fails, never skips."""
    try:
        get_default_strategy("save_sharded", "torch_dist", 1)
        get_default_strategy("load_sharded", "torch_dist", 1)
    except StrategyNotFoundError as exc:
        pytest.fail(
            "cloudckpt has no ('torch_dist', 1) strategies (cloudckpt/strategies/torch.py), "
            f"so Megatron-Core 0.19 compatibility cannot be shown: {exc}"
        )


# -- what runs on cloudckpt's ranks (module-level: the rank pool pickles them) -------------


def _cloudckpt_save(rank: int, world: int, uri: str, tp: int, backend: str) -> int:
    state = spec.build_state(ShardedTensor, ShardedObject, rank, tp, object_world=world)
    # torch_dist: as Megatron-Core 0.19 saves with --verify-integrity (integrity.json)
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1), verify_integrity=backend != "zarr")
    return rank


def _cloudckpt_load(rank: int, world: int, uri: str, tp: int, object_world: int) -> dict:
    request = spec.build_state(
        ShardedTensor, ShardedObject, rank, tp, object_world, empty=True, common=False
    )
    loaded = cloudckpt.load(request, uri, strict="raise_all")
    assert isinstance(loaded, dict)
    return spec.describe_loaded(loaded)


def _expect_loaded(described: dict, tp: int, tp_rank: int, object_world: int | None) -> None:
    """``described`` (:func:`spec.describe_loaded`) is the TP=``tp`` layout's rank
    ``tp_rank``, bit-exact, with the common values and (unless None) every object piece."""
    assert described["tensors"] == spec.expected_digests(tp, tp_rank)
    assert described["common"] == spec.describe_object(spec.COMMON)
    if object_world is not None:
        assert described["objects"] == spec.expected_objects(object_world)


def _load_in_cloudckpt(rank_pool: Any, uri: str, object_world: int) -> None:
    """Resharded loads on 4 ranks (TP=4 and TP=1 x DP=4) and in this process alone."""
    for tp in (4, 1):
        results = rank_pool.run(_cloudckpt_load, uri, tp, object_world)
        for rank, described in enumerate(results):
            _expect_loaded(described, tp, rank % tp, object_world)
    alone = _cloudckpt_load(0, 1, uri, 1, object_world)  # no process group: a world of 1
    _expect_loaded(alone, 1, 0, object_world)
    plain = cloudckpt.load_plain_tensors(uri)
    assert spec.describe_loaded(plain)["tensors"] == spec.expected_digests(1, 0)


def _expect_tensors_metadata(uri: str) -> None:
    metadata = cloudckpt.load_tensors_metadata(uri)
    assert sorted(metadata) == ALL_TENSORS
    for key, (shape, dtype, _) in spec.TENSORS.items():
        assert tuple(metadata[key].global_shape) == shape, key
        assert metadata[key].dtype == dtype, key


def _expect_megatron_loaded(result: dict, tp: int, loaders: list[str], object_world: int) -> None:
    assert [r["rank"] for r in result["ranks"]] == list(range(result["world"]))
    for r in result["ranks"]:
        loads = r["loads"]
        assert sorted(loads) == sorted(loaders)
        for name in loaders:
            described = loads[name]
            if name == "plain":
                assert described["tensors"] == spec.expected_digests(1, 0), name
                continue
            _expect_loaded(described, tp, r["rank"] % tp, object_world)
            assert described["missing"] == [] and described["unexpected"] == [], name
            assert described["keys"] == sorted([*spec.TENSORS, spec.OBJECT_KEY, *spec.COMMON])


# -- Megatron-Core 0.15.3: zarr ------------------------------------------------------------


@pytest.fixture(scope="module")
def mcore15_zarr_ckpt(mcore15: MegatronEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint Megatron-Core 0.15.3 saved with ("zarr", 1): 4 ranks, TP=2 x DP=2."""
    base = tmp_path_factory.mktemp("mcore15-zarr")
    ckpt = base / "ckpt"
    result = mcore15.run(
        base / "save.json", "save", "--dir", str(ckpt), "--world", str(SAVE_WORLD),
        "--tp", "2", "--backend", "zarr",
    )  # fmt: skip
    assert [r["megatron_version"] for r in result["ranks"]] == ["0.15.3"] * SAVE_WORLD
    return ckpt


def test_mcore015_zarr_checkpoint_loads_in_cloudckpt_resharded(
    rank_pool: Any, mcore15_zarr_ckpt: Path
) -> None:
    uri = str(mcore15_zarr_ckpt)
    assert json.loads((mcore15_zarr_ckpt / "metadata.json").read_text()) == {
        "sharded_backend": "zarr",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert not (mcore15_zarr_ckpt / "manifest.json").exists()  # a foreign, committed one
    assert cloudckpt.check_is_distributed_checkpoint(uri)
    zarray = json.loads((mcore15_zarr_ckpt / "embedding.weight" / ".zarray").read_text())
    assert zarray["dtype"] == "bfloat16" and zarray["chunks"] == [8, 4]
    _load_in_cloudckpt(rank_pool, uri, object_world=SAVE_WORLD)
    _expect_tensors_metadata(uri)
    assert cloudckpt.load_common_state_dict(uri) == spec.COMMON


def _zarray_doc(path: Path) -> dict[str, Any]:
    """A ``.zarray`` document with zarr v2's default made explicit: cloudckpt writes
    ``"dimension_separator": "."``, zarr 2.18 (so Megatron-Core 0.15) leaves it out."""
    doc: dict[str, Any] = json.loads(path.read_text())
    doc.setdefault("dimension_separator", ".")
    return doc


def test_mcore015_and_cloudckpt_write_the_same_zarr_arrays(
    rank_pool: Any, mcore15_zarr_ckpt: Path, tmp_path: Path
) -> None:
    """Same state, same layout (4 ranks, TP=2 x DP=2): every chunk object is identical
    byte for byte, every .zarray the same document, metadata.json the same bytes;
    sharded objects and common state load equal (torch.save archives are not
    byte-stable: their record prefix follows the file name)."""
    ours = tmp_path / "cloudckpt"
    assert rank_pool.run(_cloudckpt_save, str(ours), 2, "zarr") == [0, 1, 2, 3]
    for key in ALL_TENSORS:
        theirs_files = sorted(os.listdir(mcore15_zarr_ckpt / key))
        assert sorted(os.listdir(ours / key)) == theirs_files, key
        for fname in theirs_files:
            a, b = (mcore15_zarr_ckpt / key / fname), (ours / key / fname)
            if fname == ".zarray":
                assert _zarray_doc(b) == _zarray_doc(a), key
            else:
                assert b.read_bytes() == a.read_bytes(), f"{key}/{fname}"
    theirs_objects = sorted(os.listdir(mcore15_zarr_ckpt / spec.OBJECT_KEY))
    assert sorted(os.listdir(ours / spec.OBJECT_KEY)) == theirs_objects
    for fname in theirs_objects:
        a = torch.load(mcore15_zarr_ckpt / spec.OBJECT_KEY / fname, weights_only=True)
        b = torch.load(ours / spec.OBJECT_KEY / fname, weights_only=True)
        assert spec.describe_object(a) == spec.describe_object(b), fname
    common_a = torch.load(mcore15_zarr_ckpt / "common.pt", weights_only=True)
    assert torch.load(ours / "common.pt", weights_only=True) == common_a == spec.COMMON
    metadata = (mcore15_zarr_ckpt / "metadata.json").read_bytes()
    assert (ours / "metadata.json").read_bytes() == metadata


@pytest.fixture(scope="module")
def cloudckpt_zarr_ckpt(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cloudckpt zarr checkpoint: 4 ranks, TP=4."""
    ckpt = tmp_path_factory.mktemp("cloudckpt-zarr") / "ckpt"
    assert rank_pool.run(_cloudckpt_save, str(ckpt), 4, "zarr") == [0, 1, 2, 3]
    assert (ckpt / "manifest.json").is_file() and (ckpt / ".cloudckpt-claim.json").is_file()
    return ckpt


def test_cloudckpt_zarr_checkpoint_loads_in_mcore015_resharded(
    mcore15: MegatronEnv, cloudckpt_zarr_ckpt: Path, tmp_path: Path
) -> None:
    """Megatron-Core 0.15.3 on 2 ranks (TP=2): default loader (TensorStore), its
    ZarrLoadShardedStrategy and load_plain_tensors, with cloudckpt's manifest and
    claim objects in the directory."""
    loaders = ["default", "zarr", "plain"]
    result = mcore15.run(
        tmp_path / "load.json", "load", "--dir", str(cloudckpt_zarr_ckpt), "--world", "2",
        "--tp", "2", "--object-world", str(SAVE_WORLD), "--loaders", ",".join(loaders),
    )  # fmt: skip
    assert result["world"] == 2
    _expect_megatron_loaded(result, 2, loaders, object_world=SAVE_WORLD)


# -- Megatron-Core 0.19: torch_dist --------------------------------------------------------


@pytest.fixture(scope="module")
def mcore19_ckpt(mcore19: MegatronEnv, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint Megatron-Core 0.19 saved (torch_dist): 4 ranks, TP=2 x DP=2."""
    base = tmp_path_factory.mktemp("mcore19")
    ckpt = base / "ckpt"
    result = mcore19.run(
        base / "save.json", "save", "--dir", str(ckpt), "--world", str(SAVE_WORLD),
        "--tp", "2", "--backend", "torch_dist",
    )  # fmt: skip
    assert all(r["megatron_version"].startswith("0.19.") for r in result["ranks"])
    return ckpt


def test_mcore019_checkpoint_loads_in_cloudckpt_resharded(
    rank_pool: Any, mcore19_ckpt: Path
) -> None:
    _require_torch_dist()
    uri = str(mcore19_ckpt)
    assert json.loads((mcore19_ckpt / "metadata.json").read_text())["sharded_backend"] == (
        "torch_dist"
    )
    # 0.19 keeps the common state in the DCP checkpoint (object "common_state"), no common.pt
    assert not (mcore19_ckpt / "common.pt").exists()
    assert (mcore19_ckpt / ".metadata").is_file()
    assert cloudckpt.check_is_distributed_checkpoint(uri)
    _load_in_cloudckpt(rank_pool, uri, object_world=SAVE_WORLD)
    _expect_tensors_metadata(uri)
    assert cloudckpt.load_common_state_dict(uri) == spec.COMMON


def test_mcore019_integrity_record_is_checked_by_verify_integrity(
    mcore19_ckpt: Path, tmp_path: Path
) -> None:
    """Saved with ``verify_integrity=True``, 0.19 wrote its integrity.json (SHA-256 per
    file): ``load(..., verify_integrity=True)``'s check passes on it, and names a file
    changed behind its back."""
    record = json.loads((mcore19_ckpt / MEGATRON_INTEGRITY_FNAME).read_text())
    assert record["algorithm"] == "sha256" and ".metadata" in record["files"]
    assert check_integrity(str(mcore19_ckpt)) == len(record["files"]) > 2
    copy = tmp_path / "ckpt"
    shutil.copytree(mcore19_ckpt, copy)
    damaged = max(copy.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1
    damaged.write_bytes(bytes(data))
    with pytest.raises(IntegrityCheckError, match=f"checksum-mismatch {damaged.name}: SHA-256"):
        check_integrity(str(copy))


@pytest.fixture(scope="module")
def cloudckpt_torch_dist_ckpt(rank_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cloudckpt torch_dist checkpoint: 4 ranks, TP=4."""
    _require_torch_dist()
    ckpt = tmp_path_factory.mktemp("cloudckpt-torch-dist") / "ckpt"
    assert rank_pool.run(_cloudckpt_save, str(ckpt), 4, "torch_dist") == [0, 1, 2, 3]
    assert (ckpt / ".metadata").is_file() and (ckpt / "manifest.json").is_file()
    return ckpt


def test_cloudckpt_torch_dist_checkpoint_loads_in_mcore019_resharded_strict(
    mcore19: MegatronEnv, cloudckpt_torch_dist_ckpt: Path, tmp_path: Path
) -> None:
    """Megatron-Core 0.19 on 2 ranks (TP=2), strict="raise_all" (no missing or
    unexpected key) and verify_integrity=True (the integrity.json cloudckpt wrote), and
    load_plain_tensors."""
    assert (cloudckpt_torch_dist_ckpt / MEGATRON_INTEGRITY_FNAME).is_file()
    loaders = ["default", "plain"]
    result = mcore19.run(
        tmp_path / "load.json", "load", "--dir", str(cloudckpt_torch_dist_ckpt),
        "--world", "2", "--tp", "2", "--object-world", str(SAVE_WORLD),
        "--loaders", ",".join(loaders), "--strict", "raise_all", "--verify-integrity",
    )  # fmt: skip
    assert result["world"] == 2
    _expect_megatron_loaded(result, 2, loaders, object_world=SAVE_WORLD)


def test_spec_layouts_cover_every_tensor() -> None:
    """The shared spec itself: TP shards tile each tensor, so a reshard is meaningful."""
    for key, (shape, _, axis) in spec.TENSORS.items():
        for tp in (1, 2, 4):
            shards = [spec.local_shard(key, tp, r) for r in range(tp)]
            whole = shards[0] if axis is None else torch.cat(shards, dim=axis)
            assert torch.equal(whole, spec.reference(key)) and tuple(whole.shape) == shape
