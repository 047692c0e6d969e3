"""pytest plugin: real object-store servers and per-test buckets.

Enable it in ``tests/conftest.py`` with ``pytest_plugins = ["tests.fixtures_object_stores"]``.

Fixtures:

* ``s3_server`` (session): moto's S3 API server on a free loopback port, or, when
  ``CLOUDCKPT_TEST_S3_ENDPOINT`` is set, that endpoint (e.g. MinIO from
  ``docker/compose.yaml``) with ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.
* ``gcs_server`` (session): gcp-storage-emulator on a free loopback port.
* ``s3_bucket`` / ``gcs_bucket`` (function): a fresh, uniquely named bucket, emptied
  and removed afterwards; yields ``(uri_prefix, storage_options)``.
* ``checkpoint_uri`` (function, parametrised ``local``, ``memory``, ``s3-moto``
  (``s3-endpoint`` against an external endpoint), ``gs-emulator``): a fresh checkpoint
  location as ``(uri, storage_options)``. Servers start only when an s3/gs case runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import fsspec
import pytest

from tests.servers import GCSFS_ENV, ServerProcess, start_gcs_emulator, start_moto_s3

# gcsfs chooses its filesystem class at import time from this variable (see servers.py);
# set it before anything imports gcsfs. An explicit setting in the environment wins.
for _name, _value in GCSFS_ENV.items():
    os.environ.setdefault(_name, _value)

S3_ENDPOINT_ENV = "CLOUDCKPT_TEST_S3_ENDPOINT"
EXTERNAL_S3 = bool(os.environ.get(S3_ENDPOINT_ENV))
S3_CASE = "s3-endpoint" if EXTERNAL_S3 else "s3-moto"
GS_CASE = "gs-emulator"
GCS_PROJECT = "test"
HTTP_TIMEOUT_S = 10.0

StoreLocation = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class S3Endpoint:
    """Where the S3 API of the tests listens and how to sign in."""

    endpoint_url: str
    key: str
    secret: str
    region: str = "us-east-1"
    kind: str = "moto"

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
    """The GCS emulator's endpoint."""

    endpoint_url: str
    project: str = GCS_PROJECT
    process: ServerProcess | None = field(default=None, repr=False, compare=False)

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for the emulator (anonymous, a fresh filesystem instance per call)."""
        return {
            "endpoint_url": self.endpoint_url,
            "token": "anon",
            "project": self.project,
            "skip_instance_cache": True,
        }


def _unique_bucket() -> str:
    return f"cloudckpt-test-{uuid.uuid4().hex[:16]}"


# -- servers -----------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Endpoint]:
    """moto's S3 API server for the session, or the endpoint named by the environment."""
    if EXTERNAL_S3:
        key = os.environ.get("AWS_ACCESS_KEY_ID")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not key or not secret:
            pytest.fail(
                f"{S3_ENDPOINT_ENV} is set but AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are not"
            )
        region = os.environ.get("AWS_DEFAULT_REGION", "us-east-1")
        yield S3Endpoint(os.environ[S3_ENDPOINT_ENV], key, secret, region, kind="external")
        return
    server = start_moto_s3()
    try:
        yield S3Endpoint(server.endpoint, "testing-key", "testing-secret")
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSEndpoint]:
    """gcp-storage-emulator for the session."""
    server = start_gcs_emulator()
    try:
        yield GCSEndpoint(server.endpoint, process=server)
    finally:
        server.stop()


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


@pytest.fixture
def s3_bucket(s3_server: S3Endpoint) -> Iterator[StoreLocation]:
    """A fresh bucket: yields ``("s3://<bucket>", storage_options)``; removed afterwards."""
    client = s3_server.boto3_client()
    bucket = _unique_bucket()
    client.create_bucket(Bucket=bucket)
    try:
        yield f"s3://{bucket}", s3_server.storage_options()
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


@pytest.fixture
def gcs_bucket(gcs_server: GCSEndpoint) -> Iterator[StoreLocation]:
    """A fresh emulator bucket: yields ``("gs://<bucket>", storage_options)``."""
    bucket = _unique_bucket()
    _gcs_request(
        gcs_server.endpoint_url,
        "POST",
        f"/storage/v1/b?project={gcs_server.project}",
        {"name": bucket},
    )
    try:
        yield f"gs://{bucket}", gcs_server.storage_options()
    finally:
        _delete_gcs_bucket(gcs_server, bucket)


# -- one fixture over all four kinds of location -------------------------------

CHECKPOINT_LOCATIONS = ["local", "memory", S3_CASE, GS_CASE]


@pytest.fixture(params=CHECKPOINT_LOCATIONS)
def checkpoint_uri(
    request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> Iterator[StoreLocation]:
    """A fresh checkpoint location ``(uri, storage_options)`` on local disk, memory://,
    the S3 API (moto, or the external endpoint) and the GCS emulator."""
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
        bucket_uri, options = request.getfixturevalue(
            "s3_bucket" if kind == S3_CASE else "gcs_bucket"
        )
        yield f"{bucket_uri}/run/ckpt", options
