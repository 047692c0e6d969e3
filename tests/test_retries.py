"""Retries, deadlines and the adaptive limit, through the fault proxy in front of the
real S3 server (SeaweedFS checks signatures and every part's CRC-32C): throttled saves
complete and verify, a store that stops answering fails within the request deadline
with a clear error, connections reset mid-body are retried with the same bytes, and
multipart aborts are retried."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.cli import main as cli_main
from cloudckpt.config import CheckpointConfig, ConfigError, from_dict
from cloudckpt.errors import StorageError, StorageTimeoutError
from cloudckpt.retry_policy import RetryPolicy
from cloudckpt.storage import CheckpointStorage, OpenUpload
from cloudckpt.storage.buffers import crc32c
from cloudckpt.storage.pool import AdaptiveLimit, process_stats
from cloudckpt.storage.retry import RequestStats, classify, retry_after
from cloudckpt.strategies.torch import TorchDistSaveShardedStrategy
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for
from tests.test_multirank import check_tp, tp_state

REAL_S3 = S3_CASES[-1]  # SeaweedFS (or the external endpoint)
MiB = 2**20
FAST = {"base_delay_s": 0.02, "max_delay_s": 0.2}  # quick backoff for the tests


@dataclass
class Proxied:
    proxy: FaultProxy
    server: S3Endpoint
    bucket_uri: str

    def options(self) -> dict[str, Any]:
        """s3fs options that go through the proxy."""
        return {**self.server.storage_options(), "endpoint_url": self.proxy.endpoint_url}

    def storage(self, name: str, **config: Any) -> CheckpointStorage:
        retry = {**FAST, **config.pop("retry", {})}
        return CheckpointStorage(
            f"{self.bucket_uri}/{name}",
            storage_options=self.options(),
            config=CheckpointConfig(retry=retry, **config),
        )


@pytest.fixture(params=[REAL_S3])
def proxied(request: pytest.FixtureRequest) -> Iterator[Proxied]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=12) as proxy:
        yield Proxied(proxy, server, bucket_uri)


# -- 4 ranks under 20 % 503 SlowDown ---------------------------------------------------


def _save_load_throttled(rank: int, world: int, uri: str, options: dict, retry: dict) -> dict:
    config = CheckpointConfig(retry=retry, max_in_flight=8)
    before = process_stats()
    started = time.monotonic()
    cloudckpt.save(tp_state(rank, tp=world), uri, storage_options=options, config=config)
    saved_s = time.monotonic() - started
    loaded = cloudckpt.load(
        tp_state(rank, tp=world, empty=True), uri, storage_options=options, config=config
    )
    check_tp(loaded, rank, world)
    stats = process_stats() - before
    return {"saved_s": saved_s, **vars(stats)}


@pytest.mark.parametrize("retry_after_s", [None, "1"], ids=["no-retry-after", "retry-after"])
def test_four_ranks_save_and_load_under_20_percent_slowdown(
    rank_pool: Any, proxied: Proxied, retry_after_s: str | None
) -> None:
    uri = f"{proxied.bucket_uri}/run/throttled"
    proxied.proxy.throttle(0.2, retry_after=retry_after_s)
    per_rank = rank_pool.run(_save_load_throttled, uri, proxied.options(), FAST)
    faults = proxied.proxy.stats()
    proxied.proxy.clear()
    total = sum((RequestStats(**{k: v for k, v in r.items() if k != "saved_s"}) for r in per_rank),
                RequestStats())  # fmt: skip
    print(  # the figures of the closing note
        f"\n4 ranks, 20% 503 SlowDown (Retry-After: {retry_after_s}): proxy saw "
        f"{faults.requests} requests, answered {faults.faults.get('status', 0)} with 503; "
        f"cloudckpt: {total.requests} requests, {total.summary()}; save took "
        f"{max(r['saved_s'] for r in per_rank):.2f} s"
    )
    assert faults.faults.get("status", 0) > 0
    assert total.throttled > 0 and total.retries >= total.throttled - total.gave_up
    assert total.gave_up == 0
    if retry_after_s is not None:  # every throttled request waited at least 1 s
        assert max(r["saved_s"] for r in per_rank) >= 1.0
    direct = proxied.server.storage_options()
    options = [f"--storage-option={k}={v}" for k, v in direct.items() if isinstance(v, str)]
    assert cli_main(["verify", "--deep", uri, *options]) == 0


# -- deadlines ---------------------------------------------------------------------------


def test_delayed_responses_hit_the_request_deadline(proxied: Proxied) -> None:
    # a request deadline of 5 attempt timeouts: room for a second attempt on a loaded
    # machine (with 3, a slow first attempt left none, and the test failed at times)
    storage = proxied.storage("slow", retry={"attempt_timeout_s": 0.5, "request_timeout_s": 2.5})
    proxied.proxy.delay(30.0)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError) as info:
        storage.write("weights/0.0", b"x" * 1000)
    elapsed = time.monotonic() - started
    proxied.proxy.clear()
    message = str(info.value)
    assert elapsed < 5.0, elapsed
    for part in ("rank 0", f"{storage.uri}/weights/0.0", "retry.request_timeout_s=2.5"):
        assert part in message, (part, message)
    assert isinstance(info.value, StorageError) and isinstance(info.value, TimeoutError)
    assert storage.transport.counters.snapshot().timeouts >= 2


def test_operation_deadline_bounds_a_save(proxied: Proxied) -> None:
    storage = proxied.storage("op", retry={"operation_timeout_s": 1.0, "attempt_timeout_s": 0.3})
    proxied.proxy.delay(30.0)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match=r"operation_timeout_s=1\b"):
        storage.write_many([(f"o{i}", b"y" * 100) for i in range(4)])
    assert time.monotonic() - started < 3.0


# -- resets mid-body: retried with the same bytes and CRC-32C ----------------------------


def test_resets_mid_body_are_retried_with_the_same_bytes(proxied: Proxied) -> None:
    storage = proxied.storage("reset", part_size=5 * MiB)
    data = torch.randint(0, 256, (11 * MiB,), dtype=torch.uint8, generator=torch.Generator())
    proxied.proxy.reset(1.0, methods={"PUT"}, limit=2)  # two of the three parts
    result = storage.write("big", memoryview(data.numpy()))
    assert proxied.proxy.stats().faults == {"reset": 2}
    proxied.proxy.truncate(1.0, limit=1)  # and one GET body cut short
    stored = storage.read("big")
    assert stored == data.numpy().tobytes()
    assert result.crc32c == crc32c(stored) and result.size == 11 * MiB
    assert proxied.proxy.stats().faults == {"reset": 2, "truncate": 1}
    stats = storage.transport.counters.snapshot()
    # the cut GET is retried by cloudckpt; a PUT cut on a reused keep-alive connection
    # may be resent once by aiohttp itself before cloudckpt sees an error
    assert 1 <= stats.connection_errors <= 3 and stats.retries == stats.connection_errors
    assert stats.gave_up == 0
    assert proxied.server.checks_crc32c  # so SeaweedFS checked every part's CRC-32C


def test_retry_after_is_honoured(proxied: Proxied) -> None:
    storage = proxied.storage("after")
    proxied.proxy.throttle(1.0, retry_after="1", limit=1)
    started = time.monotonic()
    storage.write("a", b"after")
    assert time.monotonic() - started >= 1.0
    assert storage.transport.counters.snapshot().throttled == 1
    assert storage.read("a") == b"after"


# -- aborts ------------------------------------------------------------------------------


def test_failed_upload_is_aborted_with_retries(proxied: Proxied) -> None:
    storage = proxied.storage(
        "abort", part_size=5 * MiB, max_in_flight=1, retry={"max_attempts": 3}
    )
    # part 1: three 503s (it gives up; part 2 is skipped), then the abort: two 503s
    proxied.proxy.throttle(1.0, methods={"PUT", "DELETE"}, limit=5)
    with pytest.raises(StorageError, match=r"part 1 .*gave up .*retry\.max_attempts=3"):
        storage.write("w", bytes(6 * MiB))
    assert proxied.proxy.stats().by_method.get("DELETE") == 3
    assert storage.open_uploads() == []
    assert storage.transport.counters.snapshot().throttled == 5


def test_gc_abort_of_an_open_upload_is_retried(proxied: Proxied) -> None:
    storage = proxied.storage("gc")
    bucket = proxied.bucket_uri.removeprefix("s3://")
    client = proxied.server.boto3_client()
    client.create_multipart_upload(Bucket=bucket, Key="gc/left/behind")
    (upload,) = storage.open_uploads()
    assert upload.path == "left/behind"
    proxied.proxy.throttle(1.0, methods={"DELETE"}, limit=2, retry_after="0")
    storage.abort_upload(OpenUpload(upload.path, upload.upload_id, upload.initiated))
    assert storage.open_uploads() == []
    assert proxied.proxy.stats().faults == {"status": 2}


# -- pieces, without a server ------------------------------------------------------------


def test_adaptive_limit_halves_once_per_round_and_recovers() -> None:
    limit = AdaptiveLimit(8)
    with limit as ticket:
        limit.throttled(ticket)
        limit.throttled(ticket)  # the same round: no second decrease
    assert limit.limit == 4
    with limit as ticket:
        limit.throttled(ticket)
    assert limit.limit == 2
    for _ in range(2 + 3 + 4 + 5 + 6 + 7):
        limit.succeeded()
    assert limit.limit == 8


def test_retry_after_headers_and_classification() -> None:
    def answer(status: int, code: str, **headers: str) -> Exception:
        error = Exception(code)
        error.response = {  # type: ignore[attr-defined]
            "Error": {"Code": code},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        }
        return error

    assert retry_after(answer(503, "SlowDown", **{"retry-after": "3"})) == 3.0
    assert retry_after(answer(503, "SlowDown", **{"x-amz-retry-after": "1500"})) == 1.5
    dated = retry_after(answer(503, "SlowDown", **{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}))
    assert dated == 0.0  # a date in the past
    assert retry_after(answer(503, "SlowDown")) is None
    kinds = [classify(answer(s, c)) for s, c in ((503, "SlowDown"), (429, ""), (500, ""))]
    assert [k.name if k else None for k in kinds] == ["THROTTLED", "THROTTLED", "SERVER_ERROR"]
    assert classify(answer(403, "AccessDenied")) is None
    assert classify(answer(412, "PreconditionFailed")) is None
    assert classify(ConnectionResetError()) is not None and classify(ValueError()) is None


def test_retry_settings_from_a_config_section() -> None:
    config = from_dict({"retry": {"max_attempts": 3, "request_timeout_s": 5}})
    assert config.retry == RetryPolicy(max_attempts=3, request_timeout_s=5)
    assert "retry=RetryPolicy(max_attempts=3" in repr(config)
    with pytest.raises(ConfigError, match=r"unknown retry setting.*'attempts'"):
        from_dict({"retry": {"attempts": 3}})
    with pytest.raises(ConfigError, match=r"retry\.max_attempts"):
        from_dict({"retry": {"max_attempts": 0}})


# -- request-rate scaling: hashed key prefixes for torch_dist data objects ----------------


def _save_hashed(rank: int, world: int, uri: str) -> list[str]:
    config = CheckpointConfig(hashed_key_prefix=2)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1)
    cloudckpt.save(tp_state(rank, tp=world), uri, sharded_strategy=strategy, config=config)
    loaded = cloudckpt.load(tp_state(rank, tp=world, empty=True), uri)  # no setting needed
    check_tp(loaded, rank, world)
    return sorted(CheckpointStorage(uri).list())


def test_hashed_key_prefix_spreads_torch_dist_objects(rank_pool: Any, tmp_path: Any) -> None:
    uri = str(tmp_path / "hashed")
    listed = rank_pool.run(_save_hashed, uri)[0]
    data = [p for p in listed if p.endswith(".distcp")]
    assert len(data) == 4 and all(re.fullmatch(r"[0-9a-f]{2}/__\d+_\d*\.distcp", p) for p in data)
    assert len({p.split("/")[0] for p in data}) == 4  # one prefix per rank's object here
    assert cli_main(["verify", "--deep", uri]) == 0
