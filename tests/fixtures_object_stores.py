"""pytest plugin: real object-store servers and per-test buckets.

Enable it in ``tests/conftest.py`` with ``pytest_plugins = ["tests.fixtures_object_stores"]``.

Four servers, each started once per session, the first time a test needs one (then
every server the selected tests need starts at once, in parallel threads):

=================  ======================================================================
case               server
=================  ======================================================================
``s3-moto``        moto's S3 API server (a mock: accepts a wrong CRC-32C)
``s3-seaweedfs``   SeaweedFS's S3 gateway (a real store: checks CRC-32C, create-only)
``gs-emulator``    gcp-storage-emulator (a mock: ignores ``ifGenerationMatch=0``)
``gs-fakegcs``     fake-gcs-server (create-only on simple uploads, paginates)
=================  ======================================================================

``CLOUDCKPT_TEST_S3_ENDPOINT`` (e.g. MinIO from ``docker/compose.yaml``, with
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) replaces both S3 servers by one case,
``s3-endpoint``.

What a server really does is probed once, when it starts, not assumed from its name:
:attr:`S3Endpoint.create_only` / :attr:`GCSEndpoint.create_only` (a second create-only
write of one object through cloudckpt's own create path is refused) and
:attr:`S3Endpoint.checks_crc32c` (a PUT whose CRC-32C header is wrong is refused).

Fixtures:

* ``s3_server`` / ``gcs_server`` (function, parametrised over the S3 / GCS cases): the
  session's server of that case.
* ``s3_bucket`` / ``gcs_bucket`` (function): a fresh, uniquely named bucket on that
  server, emptied and removed afterwards; yields ``(uri_prefix, storage_options)``.
* ``checkpoint_uri`` (function, parametrised ``local``, ``memory`` and every store
  case): a fresh checkpoint location as ``(uri, storage_options)``.
* :func:`bucket_location` / :func:`server_for`: the same from a fixture of a test
  module that parametrises over the cases itself.

The ``s3`` and ``gcs`` markers are set from these cases (see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import threading
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import boto3
import fsspec
import pytest
from botocore.exceptions import ClientError

from tests import servers
from tests.servers import GCSFS_ENV, ServerProcess, ServerStartError

# gcsfs chooses its filesystem class at import time from this variable (see servers.py);
# set it before anything imports gcsfs. An explicit setting in the environment wins.
for _name, _value in GCSFS_ENV.items():
    os.environ.setdefault(_name, _value)

S3_ENDPOINT_ENV = "CLOUDCKPT_TEST_S3_ENDPOINT"
EXTERNAL_S3 = bool(os.environ.get(S3_ENDPOINT_ENV))
S3_CASES: tuple[str, ...] = ("s3-endpoint",) if EXTERNAL_S3 else ("s3-moto", "s3-seaweedfs")
GS_CASES: tuple[str, ...] = ("gs-emulator", "gs-fakegcs")
STORE_CASES: tuple[str, ...] = S3_CASES + GS_CASES
GCS_PROJECT = "test"
HTTP_TIMEOUT_S = 10.0
MOTO_KEY, MOTO_SECRET = "testing-key", "testing-secret"
NEEDED_CASES = pytest.StashKey[frozenset[str]]()

StoreLocation = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class S3Endpoint:
    """Where an S3 API of the tests listens, how to sign in, and what it enforces."""

    endpoint_url: str
    key: str
    secret: str
    region: str = "us-east-1"
    kind: str = "moto"  # "moto", "seaweedfs" or "external"
    create_only: bool = False  # probed: If-None-Match: * refuses a second create
    checks_crc32c: bool = False  # probed: a PUT with a wrong x-amz-checksum-crc32c fails
    process: ServerProcess | None = field(default=None, repr=False, compare=False)

    @property
    def case(self) -> str:
        return "s3-endpoint" if self.kind == "external" else f"s3-{self.kind}"

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint (a fresh filesystem instance per call)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"region_name": self.region},
            "skip_instance_cache": True,
        }

    def boto3_client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
            region_name=self.region,
        )


@dataclass(frozen=True)
class GCSEndpoint:
    """A GCS JSON API server of the tests and what it enforces."""

    endpoint_url: str
    project: str = GCS_PROJECT
    process: ServerProcess | None = field(default=None, repr=False, compare=False)
    kind: str = "emulator"  # "emulator" or "fakegcs"
    create_only: bool = False  # probed: ifGenerationMatch=0 refuses a second create

    @property
    def case(self) -> str:
        return f"gs-{self.kind}"

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for the server (anonymous, a fresh filesystem instance per call)."""
        return {
            "endpoint_url": self.endpoint_url,
            "token": "anon",
            "project": self.project,
            "skip_instance_cache": True,
        }


Endpoint = S3Endpoint | GCSEndpoint


def _unique_bucket() -> str:
    return f"cloudckpt-test-{uuid.uuid4().hex[:16]}"


# -- buckets -----------------------------------------------------------------


def _empty_s3_bucket(client: Any, bucket: str) -> None:
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket):
        doomed = [
            {"Key": v["Key"], "VersionId": v["VersionId"]}
            for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
        ]
        if doomed:
            client.delete_objects(Bucket=bucket, Delete={"Objects": doomed, "Quiet": True})
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for upload in page.get("Uploads", []):
            client.abort_multipart_upload(
                Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )


@contextlib.contextmanager
def s3_bucket_on(server: S3Endpoint) -> Iterator[StoreLocation]:
    """A fresh bucket on ``server``: ``("s3://<bucket>", storage_options)``; removed after."""
    client = server.boto3_client()
    bucket = _unique_bucket()
    client.create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}", server.storage_options()
    finally:
        _empty_s3_bucket(client, bucket)
        client.delete_bucket(Bucket=bucket)
        client.close()


def _gcs_request(endpoint: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        endpoint + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json"} if data is not None else {},
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        payload = response.read()
    return json.loads(payload) if payload else None


def _delete_gcs_bucket(gcs: GCSEndpoint, bucket: str) -> None:
    quoted = urllib.parse.quote(bucket, safe="")
    token = ""
    while True:
        page = _gcs_request(
            gcs.endpoint_url,
            "GET",
            f"/storage/v1/b/{quoted}/o" + (f"?pageToken={token}" if token else ""),
        )
        for item in page.get("items", []):
            name = urllib.parse.quote(item["name"], safe="")
            _gcs_request(gcs.endpoint_url, "DELETE", f"/storage/v1/b/{quoted}/o/{name}")
        token = page.get("nextPageToken", "")
        if not token:
            break
    _gcs_request(gcs.endpoint_url, "DELETE", f"/storage/v1/b/{quoted}")


@contextlib.contextmanager
def gcs_bucket_on(server: GCSEndpoint) -> Iterator[StoreLocation]:
    """A fresh bucket on ``server``: ``("gs://<bucket>", storage_options)``; removed after."""
    bucket = _unique_bucket()
    _gcs_request(
        server.endpoint_url,
        "POST",
        f"/storage/v1/b?project={server.project}",
        {"name": bucket},
    )
    try:
        yield f"gs://{bucket}", server.storage_options()
    finally:
        _delete_gcs_bucket(server, bucket)


def bucket_on(server: Endpoint) -> contextlib.AbstractContextManager[StoreLocation]:
    return s3_bucket_on(server) if isinstance(server, S3Endpoint) else gcs_bucket_on(server)


# -- what a server enforces, probed once -----------------------------------------------


def probe_create_only(location: StoreLocation) -> bool:
    """Write one object twice through cloudckpt's create-only path: True when the store
    refuses the second write (real S3, SeaweedFS, MinIO, fake-gcs-server), False when it
    overwrites (gcp-storage-emulator)."""
    from cloudckpt.errors import ObjectExistsError  # noqa: PLC0415 - keep plugin import light
    from cloudckpt.storage import CheckpointStorage  # noqa: PLC0415

    bucket_uri, options = location
    storage = CheckpointStorage(f"{bucket_uri}/create-only-probe", storage_options=options)
    storage.write("object", b"first", exclusive=True)
    try:
        storage.write("object", b"second", exclusive=True)
    except ObjectExistsError:
        refused = True
    else:
        refused = False
    stored = storage.read("object")
    assert stored == (b"first" if refused else b"second"), (refused, stored)
    storage.delete("object")
    return refused


def probe_checks_crc32c(server: S3Endpoint, bucket_uri: str) -> bool:
    """PUT an object with a wrong ``x-amz-checksum-crc32c``: True when refused."""
    bucket = bucket_uri.removeprefix("s3://")
    client = server.boto3_client()
    try:
        client.put_object(
            Bucket=bucket, Key="crc32c-probe", Body=b"payload", ChecksumCRC32C="AAAAAA=="
        )
    except ClientError:
        return True
    finally:
        client.close()
    return False


def _with_s3_probes(server: S3Endpoint) -> S3Endpoint:
    with s3_bucket_on(server) as location:
        create_only = probe_create_only(location)
        checks_crc32c = probe_checks_crc32c(server, location[0])
    return S3Endpoint(
        server.endpoint_url,
        server.key,
        server.secret,
        server.region,
        server.kind,
        create_only=create_only,
        checks_crc32c=checks_crc32c,
        process=server.process,
    )


def _with_gcs_probes(server: GCSEndpoint) -> GCSEndpoint:
    with gcs_bucket_on(server) as location:
        create_only = probe_create_only(location)
    return GCSEndpoint(
        server.endpoint_url, server.project, server.process, server.kind, create_only
    )


# -- servers -----------------------------------------------------------------


def _external_s3() -> S3Endpoint:
    key = os.environ.get("AWS_ACCESS_KEY_ID")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise ServerStartError(
            f"{S3_ENDPOINT_ENV} is set but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are not"
        )
    region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
    return S3Endpoint(os.environ[S3_ENDPOINT_ENV], key, secret, region, kind="external")


def _stopping_on_error(server: ServerProcess, build: Callable[[], Endpoint]) -> Endpoint:
    try:
        return build()
    except BaseException:
        server.stop()
        raise


def _start_case(case: str) -> Endpoint:
    """Start (or, for ``s3-endpoint``, reach) the server of ``case`` and probe it."""
    if case == "s3-endpoint":
        return _with_s3_probes(_external_s3())
    if case == "s3-moto":
        moto = servers.start_moto_s3()
        endpoint = S3Endpoint(moto.endpoint, MOTO_KEY, MOTO_SECRET, kind="moto", process=moto)
        return _stopping_on_error(moto, lambda: _with_s3_probes(endpoint))
    if case == "s3-seaweedfs":
        weed = servers.start_seaweedfs_s3()
        endpoint = S3Endpoint(
            weed.endpoint,
            servers.SEAWEEDFS_KEY,
            servers.SEAWEEDFS_SECRET,
            servers.SEAWEEDFS_REGION,
            kind="seaweedfs",
            process=weed,
        )
        return _stopping_on_error(weed, lambda: _with_s3_probes(endpoint))
    if case == "gs-emulator":
        emulator = servers.start_gcs_emulator()
        gcs = GCSEndpoint(emulator.endpoint, process=emulator, kind="emulator")
        return _stopping_on_error(emulator, lambda: _with_gcs_probes(gcs))
    if case == "gs-fakegcs":
        fake = servers.start_fake_gcs()
        gcs = GCSEndpoint(fake.endpoint, process=fake, kind="fakegcs")
        return _stopping_on_error(fake, lambda: _with_gcs_probes(gcs))
    raise ValueError(f"unknown object-store case {case!r}")


class ServerLauncher:
    """The session's servers. The first request starts every server the selected tests
    need (``needed``), each in its own thread; later requests wait for theirs."""

    def __init__(self, needed: frozenset[str]) -> None:
        self._needed = needed
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, len(STORE_CASES)), thread_name_prefix="server")
        self._futures: dict[str, Future[Endpoint]] = {}

    def get(self, case: str) -> Endpoint:
        with self._lock:
            for wanted in sorted(self._needed | {case}):
                if wanted not in self._futures:
                    self._futures[wanted] = self._pool.submit(_start_case, wanted)
            future = self._futures[case]
        try:
            return future.result()
        except ServerStartError as exc:
            pytest.fail(f"the {case} server could not start: {exc}", pytrace=False)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for future in self._futures.values():
            if future.exception() is None:
                process = future.result().process
                if process is not None:
                    process.stop()


@pytest.fixture(scope="session")
def object_store_servers(request: pytest.FixtureRequest) -> Iterator[ServerLauncher]:
    launcher = ServerLauncher(request.config.stash.get(NEEDED_CASES, frozenset()))
    try:
        yield launcher
    finally:
        launcher.close()


def server_for(request: pytest.FixtureRequest, case: str) -> Endpoint:
    """The session's server of ``case`` (one of :data:`STORE_CASES`)."""
    launcher: ServerLauncher = request.getfixturevalue("object_store_servers")
    return launcher.get(case)


def bucket_location(request: pytest.FixtureRequest, case: str) -> StoreLocation:
    """A fresh bucket on the server of ``case``, removed when ``request``'s fixture (or
    test) ends: ``(bucket uri, storage_options)``."""
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    return stack.enter_context(bucket_on(server_for(request, case)))


@pytest.fixture(params=S3_CASES)
def s3_server(request: pytest.FixtureRequest) -> S3Endpoint:
    """The session's S3 server of this case (moto and SeaweedFS, or the external one)."""
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    return server


@pytest.fixture(params=GS_CASES)
def gcs_server(request: pytest.FixtureRequest) -> GCSEndpoint:
    """The session's GCS server of this case (gcp-storage-emulator and fake-gcs-server)."""
    server = server_for(request, request.param)
    assert isinstance(server, GCSEndpoint)
    return server


@pytest.fixture
def s3_bucket(s3_server: S3Endpoint) -> Iterator[StoreLocation]:
    """A fresh bucket: yields ``("s3://<bucket>", storage_options)``; removed afterwards."""
    with s3_bucket_on(s3_server) as location:
        yield location


@pytest.fixture
def gcs_bucket(gcs_server: GCSEndpoint) -> Iterator[StoreLocation]:
    """A fresh bucket: yields ``("gs://<bucket>", storage_options)``; removed afterwards."""
    with gcs_bucket_on(gcs_server) as location:
        yield location


# -- one fixture over every kind of location -------------------------------------------

CHECKPOINT_LOCATIONS = ["local", "memory", *STORE_CASES]


@pytest.fixture(params=CHECKPOINT_LOCATIONS)
def checkpoint_uri(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> Iterator[StoreLocation]:
    """A fresh checkpoint location ``(uri, storage_options)`` on local disk, memory://
    and a fresh bucket of every object-store case."""
    kind = request.param
    if kind == "local":
        yield str(tmp_path / "ckpt"), {}
    elif kind == "memory":
        prefix = f"memory://cloudckpt-tests/{uuid.uuid4().hex}"
        yield f"{prefix}/ckpt", {}
        fs = fsspec.filesystem("memory")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
    else:
        bucket_uri, options = bucket_location(request, kind)
        yield f"{bucket_uri}/run/ckpt", options


# -- which tests touch which servers ---------------------------------------------------


def store_cases_of(item: pytest.Item) -> set[str]:
    """The object-store cases a collected test runs against (from its parameters)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return set()
    return {value for value in callspec.params.values() if isinstance(value, str)} & set(
        STORE_CASES
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Remember which servers the selected tests need, to start them together."""
    needed: set[str] = set()
    for item in session.items:
        needed |= store_cases_of(item)
    session.config.stash[NEEDED_CASES] = frozenset(needed)
