"""`cloudckpt.convert.convert` and `cloudckpt convert`: copies between stores and backends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.checker import verify
from cloudckpt.convert import convert
from cloudckpt.errors import CommitConflictError, UncommittedCheckpointError
from cloudckpt.manifest import MANIFEST_FNAME
from cloudckpt.mapping import ShardedObject, ShardedTensor
from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import StoreLocation

REPO_ROOT = Path(__file__).resolve().parents[1]


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {
        "decoder.w": torch.randn(96, 40, generator=gen).to(torch.bfloat16),
        "decoder.b": torch.randn(40, generator=gen),
        "embedding": torch.randn(50, 16, generator=gen),
    }


def _save_source(uri: str, options: dict[str, Any] | None = None) -> None:
    """A committed source: bfloat16 and float32 tensors, an object, common state."""
    full = _full()
    state: dict[str, Any] = {
        key: ShardedTensor.from_rank_offsets(key, value) for key, value in full.items()
    }
    state["rng"] = ShardedObject("rng", {"seed": 11}, (1,), (0,))
    state["iteration"] = 100
    state["args"] = {"lr": 0.01}
    cloudckpt.save(state, uri, storage_options=options)


def _check_copy(uri: str, options: dict[str, Any] | None = None) -> None:
    loaded = cloudckpt.load_plain_tensors(uri, storage_options=options)
    for key, value in _full().items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert loaded["iteration"] == 100 and loaded["args"] == {"lr": 0.01}
    obj = cloudckpt.load(
        {"rng": ShardedObject("rng", None, (1,), (0,))}, uri, storage_options=options
    )
    assert obj["rng"] == {"seed": 11}
    report = verify(uri, deep=True, storage_options=options)
    assert report.ok, report.problems


def test_convert_local_zarr_to_the_s3_api_in_small_batches(
    tmp_path: Path, s3_bucket: StoreLocation
) -> None:
    src = str(tmp_path / "src")
    _save_source(src)
    bucket_uri, options = s3_bucket
    dst = f"{bucket_uri}/converted/iter_0000100"
    seen: list[int] = []
    manifest = convert(
        src, dst, "zarr", dst_storage_options=options, max_batch_bytes=1, progress=seen.append
    )
    assert sorted(t.key for t in manifest.tensors) == sorted(_full())
    assert sorted(seen) == sorted(v.numel() * v.element_size() for v in _full().values())
    assert manifest.common_keys == ("args.lr", "iteration")
    _check_copy(dst, options)


def test_convert_refuses_uncommitted_source_and_non_empty_destination(tmp_path: Path) -> None:
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _save_source(src)
    convert(src, dst)
    with pytest.raises(CommitConflictError, match="holds a committed checkpoint"):
        convert(src, dst)
    CheckpointStorage(src).delete(MANIFEST_FNAME)
    with pytest.raises(UncommittedCheckpointError, match=r"manifest\.json"):
        convert(src, str(tmp_path / "other"))


def test_cloudckpt_convert_command(tmp_path: Path, checkpoint_uri: StoreLocation) -> None:
    """The real command, local source to every kind of destination store."""
    src = str(tmp_path / "src")
    _save_source(src)
    dst, options = checkpoint_uri
    if dst.startswith("memory://"):  # memory:// lives in one process: check in-process
        convert(src, dst, dst_storage_options=options)
        _check_copy(dst, options)
        return
    extra = [f"--dst-storage-option={key}={value}" for key, value in _cli_options(options).items()]
    proc = subprocess.run(
        [sys.executable, "-m", "cloudckpt", "convert", src, dst, "--no-progress", *extra],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(zarr): 3 tensors" in proc.stdout
    _check_copy(dst, options)


def _cli_options(options: dict[str, Any]) -> dict[str, str]:
    return {
        key: value if isinstance(value, str) else json.dumps(value)
        for key, value in options.items()
    }


def test_convert_zarr_to_torch_dist_and_back(tmp_path: Path, s3_bucket: StoreLocation) -> None:
    """zarr (local) -> torch_dist (S3 API, moto) -> zarr (local): every copy loads
    bit-exact and verifies, and the torch_dist copy is written in bounded batches."""
    src = str(tmp_path / "src")
    _save_source(src)
    bucket_uri, options = s3_bucket
    middle = f"{bucket_uri}/dcp/iter_0000100"
    manifest = convert(src, middle, "torch_dist", dst_storage_options=options, max_batch_bytes=1)
    paths = [e.path for e in manifest.objects]
    assert paths.count(".metadata") == 1
    # one DCP save per batch (max_batch_bytes=1: one tensor each), one .metadata for all
    assert len({p.rsplit("_", 1)[0] for p in paths if p.endswith(".distcp")}) == len(_full())
    _check_copy(middle, options)
    back = str(tmp_path / "back")
    convert(middle, back, "zarr", src_storage_options=options)
    _check_copy(back)


def test_a_batched_torch_dist_copy_reads_with_stock_dcp(tmp_path: Path) -> None:
    """The merged .metadata of a copy written in several DCP saves is plain DCP."""
    import warnings  # noqa: PLC0415

    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    _save_source(src)
    convert(src, dst, "torch_dist", max_batch_bytes=1)
    target = {key: torch.zeros_like(value) for key, value in _full().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
        dcp.load(target, checkpoint_id=dst)
    for key, value in _full().items():
        assert torch.equal(target[key], value), key
