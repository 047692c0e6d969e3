"""Real object-store servers for the tests, run as subprocesses on free loopback ports.

* :func:`start_moto_s3` starts moto's S3-compatible HTTP server
  (``python -m moto.server -H 127.0.0.1 -p PORT``).
* :func:`start_gcs_emulator` starts gcp-storage-emulator (in memory) through
  ``tests/_gcs_emulator_launcher.py``, which raises the server's listen backlog.

Both bind 127.0.0.1 only, wait for readiness by polling HTTP with a bounded timeout
and, on failure, raise :class:`ServerStartError` with the tail of the server's log.
:meth:`ServerProcess.stop` terminates, then kills after a timeout. Every request
these helpers send goes to the loopback server they started, with a short timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
START_ATTEMPTS = 3
LOG_TAIL_CHARS = 4000
GCS_LAUNCHER = Path(__file__).with_name("_gcs_emulator_launcher.py")

# Environment for any process that talks to the GCS emulator through gcsfs: without
# it gcsfs >= 2025.x picks its "extended" filesystem, which stalls ~60 s per call
# against the emulator. gcsfs reads it once, at import time.
GCSFS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


class ServerStartError(RuntimeError):
    """A test server did not become ready; the message carries its log."""


@dataclass
class ServerProcess:
    """A running server subprocess and where it listens."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(repr=False, default=None)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, limit: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Terminate the server; kill it if it has not exited after ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            response.read()
            return True
    except urllib.error.HTTPError:
        return True  # the server answered, even if not with 200
    except (OSError, ValueError):
        return False


def _spawn(name: str, argv: Sequence[str], port: int, env: dict[str, str]) -> ServerProcess:
    fd, log_name = tempfile.mkstemp(prefix=f"cloudckpt-{name}-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return ServerProcess(name, port, process, Path(log_name), log_file)


def _wait_ready(server: ServerProcess, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerStartError(
                f"{server.name} exited with code {server.process.returncode} before it was "
                f"ready on {server.endpoint}; its output:\n{server.log_tail()}"
            )
        if _http_ready(server.endpoint + path):
            return
        time.sleep(0.1)
    raise ServerStartError(
        f"{server.name} was not ready on {server.endpoint} within {timeout:.0f} s; "
        f"its output:\n{server.log_tail()}"
    )


def _start(
    name: str,
    argv_for_port: Callable[[int], list[str]],
    ready_path: str,
    env: dict[str, str] | None,
    timeout: float,
) -> ServerProcess:
    """Start a server on a free port; retry on a new port if it dies (e.g. a port race)."""
    full_env = {**os.environ, **(env or {})}
    error: ServerStartError | None = None
    for _ in range(START_ATTEMPTS):
        port = free_loopback_port()
        server = _spawn(name, argv_for_port(port), port, full_env)
        try:
            _wait_ready(server, ready_path, timeout)
            return server
        except ServerStartError as exc:
            died = server.process.poll() is not None
            server.stop()
            error = exc
            if not died:  # alive but never ready: another port would not help
                break
    assert error is not None
    raise error


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
