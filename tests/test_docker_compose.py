"""Static checks of docker/compose.yaml (no Docker engine runs here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
PINNED = re.compile(r"^[\w./-]+:RELEASE\.\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}Z$")


def _compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


def test_minio_image_is_pinned_and_healthchecked() -> None:
    services = _compose()["services"]
    assert set(services) == {"minio", "create-bucket"}
    for service in services.values():
        assert PINNED.match(service["image"]), service["image"]
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
