"""End-to-end tests of ``cloudckpt demo``: the real command in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cloudckpt.demo.report import cli_command, next_step_lines
from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import S3_CASES, GCSEndpoint, S3Endpoint

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


def _assert_all_match(
    proc: subprocess.CompletedProcess[str], world_size: int, backend: str = "torch_dist"
) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    ranks = "1 rank " if world_size == 1 else f"{world_size} ranks "
    assert f"world size:   {ranks}(gloo, CPU)" in out
    assert f"all {NUM_TENSORS} tensors match on every rank" in out
    assert f"tensors:      {NUM_TENSORS} per rank (each rank's state dict holds its shard" in out
    assert f"              {NUM_ARRAYS} in the checkpoint (whole tensors;" in out
    # the backend is imported before training, as a training job's start-up does: the
    # save's time is the save's, not a first `import torch.distributed.checkpoint`
    assert re.search(rf"backend: +{backend}, imported at start-up in [0-9.]+ s \(before", out)
    assert re.search(r"save: +[0-9.]+ s, [0-9.]+ MB/s", out), out
    assert re.search(r"load: +[0-9.]+ s, [0-9.]+ MB/s", out), out


@pytest.mark.multirank
def test_demo_four_ranks_reshards_tp2_dp2_to_tp1_dp4(tmp_path: Path) -> None:
    proc = _demo(str(tmp_path / "ckpt"), "--world-size", "4")
    _assert_all_match(proc, 4)
    assert "save layout:  TP=2 x DP=2; load layout: TP=1 x DP=4" in proc.stdout
    assert (tmp_path / "ckpt" / "metadata.json").is_file()


def _next_steps(out: str) -> tuple[Path, list[list[str]]]:
    """The directory and the commands of the demo's "next steps" lines."""
    match = re.search(r"^next steps \(from (.+)\):\n((?:  .+\n)+)", out, re.M)
    assert match, out
    return Path(match.group(1)), [shlex.split(line) for line in match.group(2).splitlines()]


def test_demo_one_rank_prints_runnable_next_commands_and_counts_like_verify(
    tmp_path: Path,
) -> None:
    uri = tmp_path / "run" / "iter_0000010"
    proc = _demo(str(uri), "--world-size", "1")
    _assert_all_match(proc, 1)
    out = proc.stdout
    assert "1 ranks" not in out
    assert f"checkpoint:   {uri}\n" in out
    match = re.search(
        r"^objects: +(\d+) in the checkpoint, ([0-9.]+) MB \(counted as "
        r"`cloudckpt verify` does:",
        out,
        re.M,
    )
    assert match, out
    objects = int(match.group(1))
    # every stored object but the two commit records
    stored = [p for p in uri.rglob("*") if p.is_file()]
    assert objects == len(stored) - 2
    assert {"manifest.json", "metadata.json"} <= {p.name for p in stored}

    cwd, commands = _next_steps(out)
    assert [c[-2:] for c in commands] == [["ls", str(uri.parent)], [str(uri), "--deep"]]
    assert commands[1][-3] == "verify"
    listed = subprocess.run(
        commands[0], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert re.search(r"^iter_0000010 +10 +committed ", listed.stdout, re.M), listed.stdout
    verified = subprocess.run(
        commands[1], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"OK: {objects} objects, " in verified.stdout
    assert "CRC-32C checksums match the manifest" in verified.stdout


def test_demo_in_memory_with_one_rank_says_nothing_is_left_to_inspect() -> None:
    proc = _demo("memory://cloudckpt-demo/iter_0000010", "--world-size", "1")
    _assert_all_match(proc, 1)
    assert "memory:// lives only in this process and is gone now" in proc.stdout
    assert "next steps" not in proc.stdout


def test_demo_help_does_not_offer_memory_for_several_ranks() -> None:
    proc = _demo_args(["--help"])
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "memory:// only with --world-size 1" in text
    assert "`cloudckpt ls` and `cloudckpt verify --deep` commands" in text


def test_cli_command_is_what_runs_this_installation(tmp_path: Path) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"
    # no console script: the interpreter runs the package
    assert cli_command(str(python), path="", cwd="/") == f"{python} -m cloudckpt"
    script = venv_bin / "cloudckpt"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    # the console script, relative to the working directory when below it
    assert cli_command(str(python), path="/nowhere", cwd=str(tmp_path)) == "venv/bin/cloudckpt"
    assert cli_command(str(python), path="/nowhere", cwd="/") == str(script)
    # plain `cloudckpt` only when PATH finds this very script
    assert cli_command(str(python), path=str(venv_bin), cwd="/") == "cloudckpt"
    other = tmp_path / "other"
    other.mkdir()
    (other / "cloudckpt").write_text("#!/bin/sh\n")
    (other / "cloudckpt").chmod(0o755)
    assert cli_command(str(python), path=str(other), cwd="/") == str(script)


def test_next_steps_name_the_run_directory_and_the_config() -> None:
    lines = next_step_lines("s3://bucket/run/iter_0000010", "cloudckpt", config="/etc/t.yaml")
    assert lines == [
        "next steps:",
        "  cloudckpt ls s3://bucket/run --config /etc/t.yaml",
        "  cloudckpt verify s3://bucket/run/iter_0000010 --deep --config /etc/t.yaml",
    ]
    relative = next_step_lines("ckpt dir/iter_0000010", ".venv/bin/cloudckpt")
    assert relative[0] == f"next steps (from {os.getcwd()}):"
    assert relative[1:] == [
        "  .venv/bin/cloudckpt ls 'ckpt dir'",
        "  .venv/bin/cloudckpt verify 'ckpt dir/iter_0000010' --deep",
    ]


@pytest.mark.multirank
def test_demo_two_ranks(tmp_path: Path) -> None:
    proc = _demo(str(tmp_path / "ckpt"), "--world-size", "2")
    _assert_all_match(proc, 2)
    assert "save layout:  TP=2 x DP=1; load layout: TP=1 x DP=2" in proc.stdout


@pytest.mark.multirank
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


@pytest.mark.multirank
@pytest.mark.parametrize("s3_server", S3_CASES[-1:], indirect=True)  # one server: 25 s a run
def test_demo_on_s3_configured_by_the_environment(s3_server: S3Endpoint, s3_bucket) -> None:
    """`cloudckpt demo --uri s3://bucket/prefix`, 4 ranks, against the S3 API (SeaweedFS,
    or the endpoint of CLOUDCKPT_TEST_S3_ENDPOINT): the endpoint and keys come only from
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


@pytest.mark.multirank
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
        "backend": "zarr",
    }
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"model": {"layers": 2}, "cloudckpt": section}))
    proc = _demo_args(["--config", str(config), "--world-size", "2"], env=_env())
    _assert_all_match(proc, 2, backend="zarr")
    assert f"checkpoint:   {uri}" in proc.stdout
    # the next commands need the config's storage options too
    _, commands = _next_steps(proc.stdout)
    assert commands[0][-4:] == ["ls", f"{bucket_uri}/demo-run", "--config", str(config)]
    assert commands[1][-5:] == ["verify", uri, "--deep", "--config", str(config)]
    store = CheckpointStorage(uri, storage_options=options)
    stored = store.list()
    assert "metadata.json" in stored and "common.pt" in stored
    assert json.loads(store.read("metadata.json"))["sharded_backend"] == "zarr"


def test_demo_reports_a_missing_config_file(tmp_path: Path) -> None:
    proc = _demo_args(["--config", str(tmp_path / "nope.yaml")])
    assert proc.returncode == 2
    assert "cannot read --config" in proc.stderr and "nope.yaml" in proc.stderr
