"""End-to-end tests of ``cloudckpt demo``: the real command in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import GCSEndpoint, S3Endpoint

REPO_ROOT = Path(__file__).resolve().parents[1]

# Default model: 29 parameters, each with exp_avg and exp_avg_sq. The fused QKV weight and
# bias of both layers (4 parameters, x 3 with their states) are stored as 3 arrays each.
NUM_TENSORS = 29 * 3
NUM_ARRAYS = NUM_TENSORS + 4 * 3 * (3 - 1)


def _demo(
    uri: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return _demo_args(["--uri", uri, *extra], env=env)


def _demo_args(
    args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", "demo", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env=env,
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


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMULATOR"))}
    return {**env, **extra}


def test_demo_on_s3_configured_by_the_environment(s3_server: S3Endpoint, s3_bucket) -> None:
    """`cloudckpt demo --uri s3://bucket/prefix`, 4 ranks, against the S3 API (moto, or
    the endpoint of CLOUDCKPT_TEST_S3_ENDPOINT): the endpoint and keys come only from
    the standard AWS variables, as on a Kubernetes pod."""
    bucket_uri, _ = s3_bucket
    uri = f"{bucket_uri}/demo-run/iter_0000010"
    env = _env(
        AWS_ENDPOINT_URL_S3=s3_server.endpoint_url,
        AWS_ACCESS_KEY_ID=s3_server.key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret,
        AWS_DEFAULT_REGION=s3_server.region,
    )
    proc = _demo(uri, "--world-size", "4", env=env)
    _assert_all_match(proc, 4)
    assert f"checkpoint:   {uri}" in proc.stdout
    bucket = bucket_uri.removeprefix("s3://")
    keys = {
        obj["Key"]
        for obj in s3_server.boto3_client()
        .list_objects_v2(Bucket=bucket, Prefix="demo-run/")
        .get("Contents", [])
    }
    assert {"demo-run/iter_0000010/metadata.json", "demo-run/iter_0000010/common.pt"} <= keys
    assert s3_server.secret not in proc.stdout + proc.stderr


def test_demo_on_gcs_configured_by_a_yaml_file(
    gcs_server: GCSEndpoint, gcs_bucket, tmp_path: Path
) -> None:
    """`cloudckpt demo --config train.yaml`: uri and storage options from the
    training config's `cloudckpt` section, against the GCS emulator."""
    bucket_uri, options = gcs_bucket
    uri = f"{bucket_uri}/demo-run/iter_0000010"
    section = {
        "uri": uri,
        "storage_options": {k: v for k, v in options.items() if k != "skip_instance_cache"},
        "part_size": "8MiB",
        "max_in_flight": 4,
    }
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"model": {"layers": 2}, "cloudckpt": section}))
    proc = _demo_args(["--config", str(config), "--world-size", "2"], env=_env())
    _assert_all_match(proc, 2)
    assert f"checkpoint:   {uri}" in proc.stdout
    stored = CheckpointStorage(uri, storage_options=options).list()
    assert "metadata.json" in stored and "common.pt" in stored


def test_demo_reports_a_missing_config_file(tmp_path: Path) -> None:
    proc = _demo_args(["--config", str(tmp_path / "nope.yaml")])
    assert proc.returncode == 2
    assert "cannot read --config" in proc.stderr and "nope.yaml" in proc.stderr
