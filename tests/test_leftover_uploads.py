"""A save leaves nothing open that it started, and ``verify`` tells what makes a
checkpoint wrong from leftovers beside it.

A request whose answer is lost (the connection reset mid-response, or the answer later
than the attempt's timeout) is retried; a retried CreateMultipartUpload creates a
second upload while the first stays open on the server. The commit aborts what is
still open under the checkpoint's prefix (nothing else can be writing there once it
committed), so ``verify --deep`` exits 0 and no upload is billed. Through the fault
proxy on SeaweedFS and moto.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt.cli import main as cli_main
from cloudckpt.config import CheckpointConfig
from cloudckpt.mapping import ShardedTensor
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.async_utils import AsyncCallsQueue
from cloudckpt.tracker import collect_garbage
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for

MiB = 2**20
FAST = {"base_delay_s": 0.02, "max_delay_s": 0.2}


@dataclass
class Proxied:
    proxy: FaultProxy
    server: S3Endpoint
    bucket_uri: str

    def options(self, direct: bool = False) -> dict[str, Any]:
        base = self.server.storage_options()
        return base if direct else {**base, "endpoint_url": self.proxy.endpoint_url}

    def cli_options(self) -> list[str]:
        return [
            f"--storage-option={k}={v}" for k, v in self.options(True).items() if isinstance(v, str)
        ]

    def open_uploads(self, uri: str) -> list[str]:
        storage = CheckpointStorage(uri, storage_options=self.options(direct=True))
        return [u.path for u in storage.open_uploads()]


@pytest.fixture(params=S3_CASES)
def proxied(request: pytest.FixtureRequest) -> Iterator[Proxied]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=30) as proxy:
        yield Proxied(proxy, server, bucket_uri)


def _big(rank: int = 0, world: int = 1, mib: int = 12) -> dict[str, Any]:
    """``mib`` MiB of float32 per rank, sharded along dim 0 (multipart with 5 MiB parts)."""
    rows = mib * MiB // 4 // 1024
    generator = torch.Generator().manual_seed(rank)
    local = torch.rand(rows, 1024, generator=generator)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}


def _config(**retry: Any) -> CheckpointConfig:
    return CheckpointConfig(part_size=5 * MiB, retry={**FAST, **retry})


def _check_saved(proxied: Proxied, uri: str, expected: dict[str, Any]) -> None:
    """Loads bit for bit, ``verify --deep`` exits 0, nothing open under the prefix."""
    assert proxied.open_uploads(uri) == []
    assert cli_main(["verify", "--deep", "--strict", uri, *proxied.cli_options()]) == 0
    empty = {
        k: ShardedTensor.from_rank_offsets("w", torch.empty_like(v.data))
        for k, v in expected.items()
    }
    loaded = cloudckpt.load(empty, uri, storage_options=proxied.options(direct=True))
    assert torch.equal(loaded["w"], expected["w"].data)


def test_a_lost_answer_to_create_multipart_upload_leaves_nothing_open(proxied: Proxied) -> None:
    """The issue's reproduction: the first ``POST ?uploads`` answered, its answer reset."""
    uri = f"{proxied.bucket_uri}/run/iter_0000001"
    proxied.proxy.reset(1.0, methods={"POST"}, path_contains="?uploads", limit=1)
    state = _big()
    cloudckpt.save(state, uri, storage_options=proxied.options(), config=_config())
    assert proxied.proxy.stats().faults == {"reset": 1}
    _check_saved(proxied, uri, state)


@pytest.mark.parametrize(
    "what, match",
    [
        ("a part's answer", {"methods": {"PUT"}, "path_contains": "partNumber="}),
        ("the completion's answer", {"methods": {"POST"}, "path_contains": "uploadId="}),
        ("the creation's answer", {"methods": {"POST"}, "path_contains": "?uploads"}),
    ],
)
def test_an_answer_later_than_the_attempt_timeout_leaves_nothing_open(
    proxied: Proxied, what: str, match: dict[str, Any]
) -> None:
    """The request reached the server and was carried out; its answer came after the
    attempt's timeout, so it was retried (a part is uploaded again, a completion finds
    its upload complete, a creation starts a second upload)."""
    uri = f"{proxied.bucket_uri}/run/late"
    proxied.proxy.delay(3.0, limit=1, **match)
    state = _big()
    config = _config(attempt_timeout_s=1.0, request_timeout_s=30.0)
    cloudckpt.save(state, uri, storage_options=proxied.options(), config=config)
    assert proxied.proxy.stats().faults == {"delay": 1}, what
    _check_saved(proxied, uri, state)


def test_an_async_save_leaves_nothing_open(proxied: Proxied) -> None:
    uri = f"{proxied.bucket_uri}/run/async"
    proxied.proxy.reset(1.0, methods={"POST"}, path_contains="?uploads", limit=1)
    state = _big()
    request = cloudckpt.save(
        state, uri, storage_options=proxied.options(), config=_config(), async_sharded_save=True
    )
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert proxied.proxy.stats().faults == {"reset": 1}
    _check_saved(proxied, uri, state)


def _save_under_resets(rank: int, world: int, uri: str, options: dict[str, Any]) -> bool:
    state = _big(rank, world, mib=11)
    cloudckpt.save(state, uri, storage_options=options, config=_config(max_attempts=20))
    empty = {
        "w": ShardedTensor.from_rank_offsets(
            "w", torch.empty_like(state["w"].data), (0, rank, world)
        )
    }
    loaded = cloudckpt.load(empty, uri, storage_options=options, config=_config(max_attempts=20))
    return torch.equal(loaded["w"], state["w"].data)


def test_four_ranks_under_30_percent_resets_leave_nothing_open(
    rank_pool: Any, proxied: Proxied
) -> None:
    uri = f"{proxied.bucket_uri}/run/resets"
    proxied.proxy.reset(0.3)
    assert all(rank_pool.run(_save_under_resets, uri, proxied.options()))
    faults = proxied.proxy.stats().faults.get("reset", 0)
    proxied.proxy.clear()
    print(f"\n4 ranks, 30% of requests reset: {faults} resets; nothing left open")
    assert faults > 0
    assert proxied.open_uploads(uri) == []
    assert cli_main(["verify", "--deep", "--strict", uri, *proxied.cli_options()]) == 0


# -- verify: leftovers are notes, not problems ---------------------------------------------


def test_leftovers_beside_a_committed_checkpoint_are_notes(
    proxied: Proxied, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = f"{proxied.bucket_uri}/run/iter_0000002"
    options = proxied.options(direct=True)
    cloudckpt.save(_big(mib=1), uri, storage_options=options)
    storage = CheckpointStorage(uri, storage_options=options)
    storage.write("notes.txt", b"a file of someone else's")
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    proxied.server.boto3_client().create_multipart_upload(Bucket=bucket, Key=f"{key}/stray.bin")
    capsys.readouterr()

    report = cloudckpt.verify(uri, deep=True, storage_options=options)
    assert report.ok and report.problems == ()
    assert sorted((n.kind, n.path) for n in report.notes) == [
        ("open-multipart-upload", "stray.bin"),
        ("orphan-object", "notes.txt"),
    ]
    assert all("not part of the checkpoint" in n.detail for n in report.notes)
    assert cli_main(["verify", uri, *proxied.cli_options()]) == 0
    out = capsys.readouterr().out
    assert "NOTE" in out and out.splitlines()[-1].endswith("2 notes (not part of the checkpoint)")

    strict = cloudckpt.verify(uri, strict=True, storage_options=options)
    assert not strict.ok and len(strict.problems) == 2 and strict.notes == ()
    assert cli_main(["verify", "--strict", uri, *proxied.cli_options()]) == 1

    # gc aborts an upload under a committed checkpoint at once, whatever the grace
    parent = uri.rsplit("/", 1)[0]
    report = collect_garbage(parent, 5, storage_options=options)
    assert [a.reason for a in report.actions] == ["multipart upload under a committed checkpoint"]
    assert proxied.open_uploads(uri) == []


def test_an_open_upload_of_an_uncommitted_checkpoint_stays_a_problem(proxied: Proxied) -> None:
    uri = f"{proxied.bucket_uri}/run/iter_0000003"
    options = proxied.options(direct=True)
    cloudckpt.save(_big(mib=1), uri, storage_options=options)
    CheckpointStorage(uri, storage_options=options).delete("metadata.json")
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    proxied.server.boto3_client().create_multipart_upload(Bucket=bucket, Key=f"{key}/late.bin")
    report = cloudckpt.verify(uri, storage_options=options)
    assert not report.ok and report.notes == ()
    assert {p.kind for p in report.problems} == {"missing-metadata", "open-multipart-upload"}
