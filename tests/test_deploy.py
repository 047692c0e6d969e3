"""The deployment files pass their offline static checks (scripts/check-deploy.sh).

The script builds its own venv (cached in ~/.cache/cloudckpt-deploy, from
constraints-deploy.txt; about two minutes the first time, then skipped by its stamp) and
runs hadolint, checkov, python-hcl2,
kubernetes-validate and terraform fmt; this test runs it and shows its report on failure.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from cloudckpt.config import from_yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"


@pytest.mark.timeout(900)
def test_check_deploy_script_passes() -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check-deploy.sh")],
        capture_output=True,
        text=True,
        check=False,
        timeout=880,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    for step in ("hadolint", "checkov", "parse and validate"):
        assert f"-- {step}" in report and f"-- {step}: FAILED" not in report, report
    assert "Failed checks: 0" in report and "Failed checks: 1" not in report, report


def test_training_configs_are_valid_cloudckpt_configs() -> None:
    """The ConfigMap sources parse as cloudckpt configs whose uri is a run URI."""
    for path, scheme in (
        (K8S / "base" / "train.yaml", "s3://"),
        (K8S / "overlays" / "eks" / "train.yaml", "s3://"),
        (K8S / "overlays" / "gke" / "train.yaml", "gs://"),
    ):
        config = from_yaml(str(path))
        assert config.uri is not None and config.uri.startswith(scheme), path
        assert "/iter_" not in config.uri, path  # the run, not one checkpoint
        assert not config.storage_options, path  # credentials come from the service account


def test_jobs_resume_from_the_configmap_config() -> None:
    """Every training container runs the demo with --resume on the mounted ConfigMap."""
    job = yaml.safe_load((K8S / "base" / "job.yaml").read_text())
    ptj = yaml.safe_load((K8S / "pytorchjob" / "pytorchjob.yaml").read_text())
    pods = [job["spec"]["template"]["spec"]] + [
        spec["template"]["spec"] for spec in ptj["spec"]["pytorchReplicaSpecs"].values()
    ]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    for pod in pods:
        (container,) = pod["containers"]
        args = container["args"]
        assert args[args.index("-m") + 1 : args.index("-m") + 3] == ["cloudckpt", "demo"]
        assert "--resume" in args and "--config=/etc/cloudckpt/train.yaml" in args
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["train-config"] == "/etc/cloudckpt" and mounts["tmp"] == "/tmp"
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] and context["capabilities"]["drop"] == ["ALL"]
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
        assert pod["serviceAccountName"] == "cloudckpt-trainer"
