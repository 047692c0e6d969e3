"""An unreachable S3 endpoint or refused credentials fail within seconds (not after
botocore's retries with backoff) with an error naming the settings to fix; against a real
server: a closed loopback port and moto's S3 API server with authentication on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cloudckpt.errors import StorageAccessDeniedError, StorageError, StorageUnreachableError
from cloudckpt.storage import open_checkpoint
from tests.servers import LOOPBACK, ServerProcess, _start, free_loopback_port

REPO_ROOT = Path(__file__).resolve().parents[1]
FAST_S = 10.0  # generous: the target is < 5 s; botocore's retries took 13-40 s
SECRET = "fake-secret-do-not-print"


@pytest.fixture(scope="module")
def auth_s3() -> Iterator[str]:
    """moto's S3 API server checking credentials (it accepts any key by default)."""
    server: ServerProcess = _start(
        "moto-s3-auth",
        lambda port: [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)],
        "/moto-api/",
        {"AWS_DEFAULT_REGION": "us-east-1", "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
        60,
    )
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials or endpoint from the environment or ~/.aws."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _closed_port_endpoint() -> str:
    return f"http://{LOOPBACK}:{free_loopback_port()}"


def _options(endpoint: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}, **extra}


def _timed_open(uri: str, options: dict[str, Any]) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        open_checkpoint(uri, storage_options=options)
    return caught.value, time.monotonic() - started


@pytest.mark.usefixtures("no_aws_env")
def test_a_closed_port_fails_fast_naming_the_endpoint_settings() -> None:
    endpoint = _closed_port_endpoint()
    error, elapsed = _timed_open("s3://bucket/run/iter_1", _options(endpoint, key="k", secret="s"))
    assert isinstance(error, StorageUnreachableError) and isinstance(error, ConnectionError)
    message = str(error)
    assert f"cannot reach the S3 endpoint {endpoint} for s3://bucket/run/iter_1" in message
    for setting in ("AWS_ENDPOINT_URL_S3", "--storage-option endpoint_url=", "storage_options"):
        assert setting in message
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"


@pytest.mark.usefixtures("no_aws_env")
def test_refused_credentials_fail_fast_naming_the_credential_settings(auth_s3: str) -> None:
    options = _options(auth_s3, key="AKIAFAKEFAKEFAKE", secret=SECRET)
    error, elapsed = _timed_open("s3://bucket/run", options)
    assert isinstance(error, StorageAccessDeniedError) and isinstance(error, PermissionError)
    message = str(error)
    assert "refused the credentials for s3://bucket/run" in message
    assert "InvalidAccessKeyId" in message
    for setting in ("AWS_ACCESS_KEY_ID", "--storage-option key=", "storage_options"):
        assert setting in message
    assert SECRET not in message
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"


@pytest.mark.usefixtures("no_aws_env")
def test_missing_credentials_say_where_to_set_them(auth_s3: str) -> None:
    error, elapsed = _timed_open("s3://bucket/run", _options(auth_s3))
    assert isinstance(error, StorageAccessDeniedError)
    assert "no S3 credentials for s3://bucket/run" in str(error)
    assert "AWS_ACCESS_KEY_ID" in str(error)
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"


def _cli_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true", **settings}


@pytest.mark.parametrize("command", ["ls", "verify"])
@pytest.mark.parametrize("case", ["closed-port", "fake-keys"])
def test_cli_fails_fast_with_exit_status_2(auth_s3: str, case: str, command: str) -> None:
    endpoint = _closed_port_endpoint() if case == "closed-port" else auth_s3
    env = _cli_env(
        AWS_ENDPOINT_URL_S3=endpoint,
        AWS_ACCESS_KEY_ID="AKIAFAKEFAKEFAKE",
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "cloudckpt", command, "s3://bucket/run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    closed = case == "closed-port"
    assert ("cannot reach the S3 endpoint" if closed else "refused the credentials") in proc.stderr
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"
