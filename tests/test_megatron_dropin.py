"""cloudckpt as a drop-in for Megatron-Core's ``dist_checkpointing`` (``-m compat``), for
0.15.3 (the last release with the zarr backend) and 0.19.2 (the current one).

Megatron-Core runs in the ``mcore-0.15-dropin`` or the ``mcore-0.19`` environment (built
and cached by ``scripts/compat-env.sh``: Megatron-Core plus cloudckpt's runtime
dependencies) with cloudckpt imported from this repository and an import hook
(``tests/compat/dropin.py``) that makes ``megatron.core.dist_checkpointing`` be
cloudckpt. ``tests/compat/mcore_dropin.py`` builds Megatron's own GPT model on 4 gloo
CPU ranks, takes one Adam step, and saves the model's and the optimizer's sharded state
dicts through ``megatron.core.dist_checkpointing.save`` to a bucket on the S3 test
server (SeaweedFS); then it loads them into another tensor-parallel x data-parallel
layout. This side checks every saved and every loaded shard, bit for bit, against the
slice of the stored global tensors (``cloudckpt.load_plain_tensors``) that the shard's
own metadata names. The fully parallel save and load run with 0.15.3. Where an
environment cannot be installed here, the tests skip with pip's error, as the other
compatibility tests do.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import cloudckpt
from tests.compat import spec
from tests.fixtures_object_stores import S3_CASES, bucket_location
from tests.test_megatron_compat import MegatronEnv, _build

pytestmark = [pytest.mark.compat, pytest.mark.timeout(1200)]

REPO_ROOT = Path(__file__).resolve().parents[1]
DROPIN_SCRIPT = REPO_ROOT / "tests" / "compat" / "mcore_dropin.py"
REAL_S3 = [case for case in S3_CASES if case != "s3-moto"]  # SeaweedFS, or an external one


# Megatron-Core release -> its environment, and the TP size its save is loaded back into
# (the other TP size of the two: 4 = TP 2 -> 4, 1 = TP 2 -> 1 x DP 4; one load each keeps the
# file's time down, as the resharding itself is cloudckpt's code in both)
DROPIN_ENVS = {"0.15.3": ("mcore-0.15-dropin", 1), "0.19.2": ("mcore-0.19", 4)}


@pytest.fixture(scope="session")
def mcore15_dropin() -> MegatronEnv:
    return _build("mcore-0.15-dropin")


@pytest.fixture(scope="module", params=list(DROPIN_ENVS), ids=lambda v: f"mcore{v}")
def dropin_env(request: pytest.FixtureRequest) -> tuple[str, MegatronEnv]:
    """(Megatron-Core version, the environment whose Megatron-Core runs with cloudckpt in
    place of its dist_checkpointing): the last release with zarr, and the current one."""
    version = request.param
    if version.startswith("0.15."):
        return version, request.getfixturevalue("mcore15_dropin")
    return version, _build(DROPIN_ENVS[version][0])


@pytest.fixture(scope="module", params=REAL_S3)
def s3_location(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return bucket_location(request, request.param)


def _s3_env(options: dict[str, Any]) -> dict[str, str]:
    """The environment a Megatron user sets for an S3-compatible store."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({
        "PYTHONPATH": str(REPO_ROOT),
        "AWS_ENDPOINT_URL_S3": options["endpoint_url"],
        "AWS_ACCESS_KEY_ID": options["key"],
        "AWS_SECRET_ACCESS_KEY": options["secret"],
        "AWS_DEFAULT_REGION": options.get("client_kwargs", {}).get("region_name", "us-east-1"),
    })  # fmt: skip
    return env


def _run(env: MegatronEnv, options: dict[str, Any], out: Path, *args: str) -> dict[str, Any]:
    cmd = [str(env.python), str(DROPIN_SCRIPT), *args, "--out", str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, check=False, env=_s3_env(options),
        cwd=out.parent,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{env.name}: {' '.join(cmd[1:])} failed ({proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-12000:]}"
    )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _expected_slice(whole: torch.Tensor, shard: dict[str, Any]) -> torch.Tensor:
    """The part of the global tensor ``whole`` that a described ShardedTensor holds."""
    prepend = shard["prepend_axis_num"]
    offsets = shard["global_offset"]
    index: list[Any] = list(offsets[:prepend])
    for offset, size in zip(offsets[prepend:], shard["local_shape"], strict=True):
        index.append(slice(offset, offset + size))
    part = whole[tuple(index)]
    flat = shard["flattened_range"]
    if flat is not None:
        part = part.reshape(-1)[flat[0] : flat[1]]
    return part


def _check_shards(result: dict[str, Any], plain: dict[str, Any]) -> int:
    """Every shard of every rank equals its slice of the stored tensors; how many."""
    checked = 0
    for rank in result["ranks"]:
        for shard in rank["shards"]:
            whole = plain[shard["key"]]
            if shard["flattened_range"] is not None:
                # saved N-D flattened: load_plain_tensors gives it flat, as Megatron-Core's
                assert whole.dim() == 1, shard["key"]
                whole = whole.reshape(shard["global_shape"])
            assert list(whole.shape) == shard["global_shape"], shard["key"]
            expected = spec.digest(_expected_slice(whole, shard))
            assert shard["digest"] == expected, (rank["rank"], shard["key"], shard["path"])
            checked += 1
    return checked


@pytest.fixture(scope="module")
def saved(
    dropin_env: tuple[str, MegatronEnv],
    s3_location: tuple[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Megatron-Core's GPT model and optimizer state, saved by cloudckpt in its place to
    the S3 server from 4 ranks, TP=2 x DP=2: (uri, storage options, save result)."""
    version, env = dropin_env
    bucket, options = s3_location
    uri = f"{bucket}/gpt-{version}/iter_0000007"
    out = tmp_path_factory.mktemp("dropin") / "save.json"
    result = _run(env, options, out, "save", "--uri", uri, "--world", "4", "--tp", "2")
    return uri, options, result


def test_megatron_gpt_saved_through_cloudckpt_to_s3(
    dropin_env: tuple[str, MegatronEnv],
    saved: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    uri, options, result = saved
    ranks = result["ranks"]
    assert [r["megatron_version"] for r in ranks] == [dropin_env[0]] * 4
    assert {r["dist_checkpointing"] for r in ranks} == {"cloudckpt"}  # the hook redirected it
    assert [(r["tp"], r["dp"]) for r in ranks] == [(2, 2)] * 4
    assert cloudckpt.check_is_distributed_checkpoint(uri, storage_options=options)
    plain = cloudckpt.load_plain_tensors(uri, storage_options=options)
    assert plain["iteration"] == 7
    keys = {s["key"] for r in ranks for s in r["shards"]}
    assert any(k.startswith("decoder.layers.") for k in keys)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    assert any(k.startswith("optimizer.distributed.exp_avg_sq.") for k in keys)
    assert keys <= set(plain)
    assert _check_shards(result, plain) == sum(len(r["shards"]) for r in ranks) > 20


def test_megatron_gpt_loads_resharded_from_s3(
    dropin_env: tuple[str, MegatronEnv],
    saved: tuple[str, dict[str, Any], dict[str, Any]],
    tmp_path: Path,
) -> None:
    """Loaded into TP=1 x DP=4 (0.15) or TP=4 x DP=1 (0.19), strict, on Megatron-Core's
    own model."""
    version, env = dropin_env
    tp = DROPIN_ENVS[version][1]
    uri, options, _ = saved
    result = _run(
        env, options, tmp_path / "load.json", "load", "--uri", uri, "--world", "4",
        "--tp", str(tp),
    )  # fmt: skip
    ranks = result["ranks"]
    assert [(r["tp"], r["dp"]) for r in ranks] == [(tp, 4 // tp)] * 4
    assert all(r["iteration"] == 7 and r["model_params_match"] for r in ranks)
    plain = cloudckpt.load_plain_tensors(uri, storage_options=options)
    assert _check_shards(result, plain) == sum(len(r["shards"]) for r in ranks) > 20


# -- fully parallel, as Megatron's training sets it up for torch_dist ----------------------


def _bytes_by_writer(uri: str, options: dict[str, Any]) -> dict[int, int]:
    """Bytes of the ``__<rank>_<i>.distcp`` objects, by the rank that wrote them."""
    fs = fsspec.filesystem("s3", **options)
    by_rank: dict[int, int] = {}
    for path, info in fs.find(uri, detail=True).items():
        match = re.fullmatch(r"__(\d+)_\d+\.distcp", posixpath.basename(path))
        if match:
            rank = int(match.group(1))
            by_rank[rank] = by_rank.get(rank, 0) + int(info["size"])
    return by_rank


@pytest.fixture(scope="module")
def saved_fully_parallel(
    mcore15_dropin: MegatronEnv,
    s3_location: tuple[str, dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The same state saved with torch_dist through FullyParallelSaveStrategyWrapper over
    Megatron's data-parallel groups (TP=2 x DP=2), as megatron/training does."""
    bucket, options = s3_location
    uri = f"{bucket}/gpt-fully-parallel/iter_0000007"
    out = tmp_path_factory.mktemp("dropin-fp") / "save.json"
    result = _run(
        mcore15_dropin, options, out, "save", "--uri", uri, "--world", "4", "--tp", "2",
        "--fully-parallel",
    )  # fmt: skip
    return uri, options, result


def test_megatron_gpt_fully_parallel_save_spreads_replicas(
    saved_fully_parallel: tuple[str, dict[str, Any], dict[str, Any]],
) -> None:
    """Every rank writes a share (without the wrapper only DP rank 0 of each TP rank,
    ranks 0 and 1, would), and what was stored is what the ranks held."""
    uri, options, result = saved_fully_parallel
    written = _bytes_by_writer(uri, options)
    assert sorted(written) == [0, 1, 2, 3] and all(n > 0 for n in written.values()), written
    plain = cloudckpt.load_plain_tensors(uri, storage_options=options)
    ranks = result["ranks"]
    assert _check_shards(result, plain) == sum(len(r["shards"]) for r in ranks) > 20


def test_megatron_gpt_fully_parallel_load_resharded(
    mcore15_dropin: MegatronEnv,
    saved_fully_parallel: tuple[str, dict[str, Any], dict[str, Any]],
    tmp_path: Path,
) -> None:
    """Loaded into TP=1 x DP=4 through FullyParallelLoadStrategyWrapper (each shard read
    by one rank of its data-parallel group, broadcast to the others)."""
    uri, options, _ = saved_fully_parallel
    result = _run(
        mcore15_dropin, options, tmp_path / "load.json", "load", "--uri", uri, "--world", "4",
        "--tp", "1", "--fully-parallel",
    )  # fmt: skip
    ranks = result["ranks"]
    assert [(r["tp"], r["dp"]) for r in ranks] == [(1, 4)] * 4
    assert all(r["iteration"] == 7 and r["model_params_match"] for r in ranks)
    plain = cloudckpt.load_plain_tensors(uri, storage_options=options)
    assert _check_shards(result, plain) == sum(len(r["shards"]) for r in ranks) > 20
