"""A killed training job resumes bit-identically: ``cloudckpt demo --resume`` as the
Kubernetes job runs it (the ConfigMap's training config, deploy/k8s/base/train.yaml),
against the S3 API, configured only by the standard AWS variables as on a pod.

One run trains 4 steps uninterrupted, saving iterations 2 and 4. Another is killed
(SIGKILL of a rank, as a lost node) right after iteration 2 commits, then restarted with
``--resume``: it must resume from iteration 2 (cloudckpt.latest of the run) and end with
a checkpoint whose every object - each tensor chunk, the common state, the per-rank RNG
states - is byte-identical to the uninterrupted run's. (The resumed run also reloads its
final checkpoint into another TP layout and checks every tensor bit for bit.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cloudckpt
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME
from cloudckpt.storage import open_checkpoint
from tests.fixtures_object_stores import S3_CASES, S3Endpoint

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = ROOT / "deploy" / "k8s" / "base" / "train.yaml"
# what differs between two commits of the same state: who claimed it and when
RUN_SPECIFIC = {CLAIM_FNAME, MANIFEST_FNAME, "metadata.json"}


def _demo(run_uri: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["--config", str(TRAIN_CONFIG), "--uri", run_uri, "--resume"]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cloudckpt",
            "demo",
            *args,
            "--world-size",
            "2",
            "--steps",
            "4",
            "--save-interval",
            "2",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
        env=env,
    )


def _objects(uri: str, options: dict[str, object]) -> dict[str, bytes]:
    store = open_checkpoint(uri, storage_options=options)
    return {path: store.read(path) for path in store.list() if path not in RUN_SPECIFIC}


# One S3 server (SeaweedFS, a real store, or CLOUDCKPT_TEST_S3_ENDPOINT's): three 2-rank
# runs take 50 s on two cores alone, 100 s beside the rest of the suite; the storage
# layer is tested against every server elsewhere.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("s3_server", S3_CASES[-1:], indirect=True)
def test_killed_job_resumes_from_latest_bit_identical(
    s3_server: S3Endpoint, s3_bucket: tuple[str, dict[str, object]]
) -> None:
    bucket_uri, options = s3_bucket
    try:
        _check_resume(s3_server, bucket_uri, options)
    finally:  # ~1,200 objects: leave the bucket empty for its fixture to remove
        _empty(s3_server, bucket_uri.removeprefix("s3://"))


def _empty(server: S3Endpoint, bucket: str) -> None:
    client = server.boto3_client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    keys = [{"Key": obj["Key"]} for page in pages for obj in page.get("Contents", [])]
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[start : start + 1000]})


def _check_resume(s3_server: S3Endpoint, bucket_uri: str, options: dict[str, object]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMULATOR"))}
    env.update(
        AWS_ENDPOINT_URL_S3=s3_server.endpoint_url,
        AWS_ACCESS_KEY_ID=s3_server.key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret,
        AWS_DEFAULT_REGION=s3_server.region,
    )
    straight, killed = f"{bucket_uri}/straight", f"{bucket_uri}/killed"

    proc = _demo(straight, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed:      no committed checkpoint in the run yet: started at 0" in proc.stdout

    proc = _demo(killed, env, "--kill-after", "2")
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "killed by signal 9" in proc.stderr, proc.stderr
    assert cloudckpt.latest(killed, storage_options=options) == f"{killed}/iter_0000002"

    proc = _demo(killed, env)  # the restart
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed:      from {killed}/iter_0000002 (iteration 2)" in proc.stdout
    assert "result:       all 87 tensors match on every rank (bit for bit" in proc.stdout
    assert cloudckpt.latest(killed, storage_options=options) == f"{killed}/iter_0000004"

    for iteration in ("iter_0000002", "iter_0000004"):
        want = _objects(f"{straight}/{iteration}", options)
        got = _objects(f"{killed}/{iteration}", options)
        assert len(want) > 100 and got.keys() == want.keys()
        differ = [path for path in want if got[path] != want[path]]
        assert not differ, f"{iteration}: {len(differ)} objects differ, e.g. {differ[:5]}"
