"""The fault proxy itself, in front of the real S3 server (SeaweedFS checks signatures
and CRC-32C): it forwards signed, streamed requests unchanged, and injects each fault."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for

REAL_S3 = S3_CASES[-1]  # SeaweedFS (or the external endpoint)
PAYLOAD = bytes(range(256)) * 12 * 1024  # 3 MiB, several proxy chunks


@pytest.fixture(params=[REAL_S3])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, Any, str]]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket = bucket_location(request, request.param)[0].removeprefix("s3://")
    with FaultProxy(server.endpoint_url, seed=1) as proxy:
        client = boto3.client(
            "s3",
            endpoint_url=proxy.endpoint_url,
            aws_access_key_id=server.key,
            aws_secret_access_key=server.secret,
            region_name=server.region,
            config=Config(
                retries={"mode": "standard", "total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=1,
            ),
        )
        yield proxy, client, bucket
        client.close()


def test_forwards_signed_streamed_requests_unchanged(proxied: tuple[FaultProxy, Any, str]) -> None:
    proxy, client, bucket = proxied
    client.put_object(Bucket=bucket, Key="k", Body=PAYLOAD)
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == PAYLOAD
    ranged = client.get_object(Bucket=bucket, Key="k", Range="bytes=10-19")["Body"].read()
    assert ranged == PAYLOAD[10:20]
    stats = proxy.stats()
    assert stats.requests == stats.forwarded == 3
    assert stats.by_method == {"PUT": 1, "GET": 2}
    assert stats.total_faults == 0


@pytest.mark.parametrize("retry_after", [None, "7"])
def test_throttle_answers_slowdown(
    proxied: tuple[FaultProxy, Any, str], retry_after: str | None
) -> None:
    proxy, client, bucket = proxied
    proxy.throttle(1.0, retry_after=retry_after)
    with pytest.raises(ClientError) as caught:
        client.put_object(Bucket=bucket, Key="k", Body=PAYLOAD)
    response = caught.value.response
    assert response["Error"]["Code"] == "SlowDown"
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert response["ResponseMetadata"]["HTTPHeaders"].get("retry-after") == retry_after
    proxy.clear()
    client.put_object(Bucket=bucket, Key="k", Body=b"after")
    assert proxy.stats().faults == {"status": 1}, proxy.stats()


def test_fraction_and_limit(proxied: tuple[FaultProxy, Any, str]) -> None:
    proxy, client, bucket = proxied
    client.put_object(Bucket=bucket, Key="k", Body=b"x")
    proxy.reset_counters()
    proxy.throttle(0.5, methods={"HEAD"}, limit=3)
    failures = 0
    for _ in range(20):
        try:
            client.head_object(Bucket=bucket, Key="k")
        except ClientError:
            failures += 1
    assert failures == 3
    assert proxy.stats().requests == 20


def test_reset_mid_upload(proxied: tuple[FaultProxy, Any, str]) -> None:
    proxy, client, bucket = proxied
    proxy.reset(1.0, methods={"PUT"}, limit=1)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError, ConnectionError)):
        client.put_object(Bucket=bucket, Key="cut", Body=PAYLOAD)
    with pytest.raises(ClientError):
        client.head_object(Bucket=bucket, Key="cut")
    client.put_object(Bucket=bucket, Key="cut", Body=PAYLOAD)  # the limit is spent
    assert client.get_object(Bucket=bucket, Key="cut")["Body"].read() == PAYLOAD


def test_truncate_and_corrupt_ranged_gets(proxied: tuple[FaultProxy, Any, str]) -> None:
    proxy, client, bucket = proxied
    client.put_object(Bucket=bucket, Key="k", Body=PAYLOAD)
    proxy.corrupt(1.0, ranged_only=True)
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == PAYLOAD  # not ranged
    got = client.get_object(Bucket=bucket, Key="k", Range="bytes=0-99")["Body"].read()
    assert len(got) == 100
    assert [i for i in range(100) if got[i] != PAYLOAD[i]] == [50]
    proxy.truncate(1.0)
    with pytest.raises(ResponseStreamingError):
        client.get_object(Bucket=bucket, Key="k")["Body"].read()
    assert proxy.stats().faults == {"corrupt": 1, "truncate": 1}


def test_delay_and_kill(proxied: tuple[FaultProxy, Any, str]) -> None:
    proxy, client, bucket = proxied
    proxy.delay(5.0)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.head_bucket(Bucket=bucket)
    assert time.monotonic() - started < 3.0  # the client's 1 s read timeout, not 5 s
    proxy.clear()
    proxy.kill()
    with pytest.raises(EndpointConnectionError):
        client.head_bucket(Bucket=bucket)
    proxy.revive()
    client.head_bucket(Bucket=bucket)
