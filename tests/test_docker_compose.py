"""Static checks of docker/compose.yaml (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "compose.yaml"
PINNED = re.compile(r"^[\w./-]+:RELEASE\.\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}Z$")


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def test_minio_image_is_pinned_and_healthchecked() -> None:
    services = _compose()["services"]
    assert set(services) == {"minio", "create-bucket", "train"}
    for name in ("minio", "create-bucket"):
        assert PINNED.match(services[name]["image"]), services[name]["image"]
    minio = services["minio"]
    assert minio["healthcheck"]["test"][:2] == ["CMD", "mc"]
    assert services["create-bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"


def test_ports_are_published_on_loopback_only() -> None:
    ports = _compose()["services"]["minio"]["ports"]
    assert ports == ["127.0.0.1:9000:9000", "127.0.0.1:9001:9001"]


def test_readme_commands_match_the_compose_credentials() -> None:
    """The usage comment's credentials are the compose defaults."""
    text = COMPOSE.read_text()
    minio_env = _compose()["services"]["minio"]["environment"]
    user = re.search(r":-([^}]+)}", minio_env["MINIO_ROOT_USER"])
    password = re.search(r":-([^}]+)}", minio_env["MINIO_ROOT_PASSWORD"])
    assert user and password
    assert f"AWS_ACCESS_KEY_ID={user.group(1)}" in text
    assert f"AWS_SECRET_ACCESS_KEY={password.group(1)}" in text
    assert "CLOUDCKPT_TEST_S3_ENDPOINT=http://127.0.0.1:9000" in text


def test_train_job_checkpoints_into_minio_and_resumes() -> None:
    """The demo job: built from the CPU Dockerfile, started after the bucket exists,
    configured by the Kubernetes job's training config, resuming when restarted."""
    train = _compose()["services"]["train"]
    assert train["build"] == {"context": "..", "dockerfile": "docker/Dockerfile.cpu"}
    assert (ROOT / "docker" / "Dockerfile.cpu").is_file()
    assert train["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert train["environment"]["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    command = train["command"]
    assert command[:2] == ["cloudckpt", "demo"]
    assert "--resume" in command
    assert "--uri=s3://cloudckpt/demo-run" in command  # the bucket create-bucket makes
    (mount,) = train["volumes"]
    source, target, mode = mount.split(":")
    assert (COMPOSE.parent / source).resolve() == ROOT / "deploy" / "k8s" / "base" / "train.yaml"
    assert f"--config={target}" in command and mode == "ro"
    assert train["restart"].startswith("on-failure")
