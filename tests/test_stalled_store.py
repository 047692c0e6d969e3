"""A store that stops answering (every response held by the fault proxy) fails every
call within cloudckpt's deadlines: listings, HEADs and deletes are cloudckpt's own
retried requests (:mod:`cloudckpt.storage.s3_listing`), not s3fs's, so a save (2 real
gloo ranks), ``verify``, ``list_checkpoints``, ``latest``, ``collect_garbage`` and the
CLI's ``ls`` / ``verify`` / ``rm`` end with a ``StorageTimeoutError`` (exit status 2)
within a few ``request_timeout_s``, or within ``operation_timeout_s`` when that is
less. Before, a save took 155 s, ``verify`` 158 s and ``ls`` 150 s at
``request_timeout_s=5``.

The S3 listings also keep s3fs's answers where the store answers (pagination past 1000
keys, recursive deletes in batches, a missing bucket). The measured times are printed
(``-s``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.cli import main as cli_main
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import BucketNotFoundError, StorageTimeoutError
from cloudckpt.launch import RankPool
from cloudckpt.storage import CheckpointStorage
from cloudckpt.tracker import collect_garbage, latest, list_checkpoints
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import (
    GS_CASES,
    S3_CASES,
    GCSEndpoint,
    S3Endpoint,
    bucket_location,
    server_for,
)
from tests.test_failure_agreement import _outcome

REAL_S3 = S3_CASES[-1]  # SeaweedFS (or the external endpoint)
HELD_S = 600.0  # every response held this long: the store stopped answering
ATTEMPT_S, REQUEST_S = 1.0, 3.0
RETRY = {
    "attempt_timeout_s": ATTEMPT_S,
    "request_timeout_s": REQUEST_S,
    "base_delay_s": 0.02,
    "max_delay_s": 0.2,
}
# the probe of a new filesystem (at most attempt_timeout_s), then one request that
# passes its deadline; room for a loaded 2-core machine
BOUND_S = 3 * REQUEST_S
OPERATION_S = 1.5  # operation_timeout_s well below request_timeout_s: the call ends by it
OPERATION_RETRY = {**RETRY, "request_timeout_s": 10.0, "operation_timeout_s": OPERATION_S}
OPERATION_BOUND_S = OPERATION_S + 3.0  # a request alone could take 10 s


@dataclass
class Stalled:
    proxy: FaultProxy
    server: S3Endpoint
    bucket_uri: str
    case: str

    def options(self) -> dict[str, Any]:
        """s3fs options through the proxy (a fresh filesystem per call)."""
        return {**self.server.storage_options(), "endpoint_url": self.proxy.endpoint_url}

    def cli_options(self) -> list[str]:
        """``--storage-option`` flags through the proxy."""
        return [
            f"--storage-option={k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in self.options().items()
        ]

    def stall(self) -> None:
        self.proxy.delay(HELD_S)

    def held(self) -> int:
        """Requests whose response the proxy held."""
        return self.proxy.stats().faults.get("delay", 0)


@pytest.fixture(params=[REAL_S3])  # what the store is does not matter: it never answers
def stalled(request: pytest.FixtureRequest) -> Iterator[Stalled]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=7) as proxy:
        yield Stalled(proxy, server, bucket_uri, request.param)


def _timed(what: str, case: str, call: Callable[[], Any]) -> tuple[BaseException, float]:
    """Run ``call``, which must raise; the error and the seconds it took (printed)."""
    started = time.monotonic()
    with pytest.raises(Exception) as info:  # the caller checks the type
        call()
    elapsed = time.monotonic() - started
    print(f"\n{case}: {what} on a stalled store failed in {elapsed:.2f} s: {info.value!r}")
    return info.value, elapsed


def _concurrently(
    case: str, calls: dict[str, Callable[[], Any]]
) -> dict[str, tuple[BaseException, float]]:
    """:func:`_timed` of every call, all at once (each on its own filesystem): the
    test takes one deadline, not one per call; each still measures its own time."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {what: pool.submit(_timed, what, case, call) for what, call in calls.items()}
        return {what: future.result() for what, future in futures.items()}


def _assert_timed_out(error: BaseException, elapsed: float, bound: float, *words: str) -> None:
    assert isinstance(error, StorageTimeoutError), repr(error)
    assert elapsed < bound, (elapsed, error)
    for word in ("rank 0", *words):
        assert word in str(error), (word, str(error))


# -- the library calls --------------------------------------------------------------------


def test_verify_list_latest_and_gc_end_within_the_request_deadline(stalled: Stalled) -> None:
    config = CheckpointConfig(retry=RETRY)
    parent, ckpt = f"{stalled.bucket_uri}/run", f"{stalled.bucket_uri}/run/iter_0000010"
    kwargs: dict[str, Any] = {"storage_options": stalled.options(), "config": config}
    stalled.stall()
    calls: dict[str, Callable[[], Any]] = {
        "verify": lambda: cloudckpt.verify(ckpt, **kwargs),
        "list_checkpoints": lambda: list_checkpoints(parent, **kwargs),
        "latest": lambda: latest(parent, **kwargs),
        "collect_garbage": lambda: collect_garbage(parent, 1, grace_s=0, **kwargs),
    }
    for what, (error, elapsed) in _concurrently(stalled.case, calls).items():
        uri = ckpt if what == "verify" else parent
        _assert_timed_out(error, elapsed, BOUND_S, uri, f"retry.request_timeout_s={REQUEST_S:g}")
    assert stalled.held() >= len(calls)


def test_storage_lookups_listings_and_deletes_end_within_the_request_deadline(
    stalled: Stalled,
) -> None:
    storage = CheckpointStorage(
        f"{stalled.bucket_uri}/ckpt",
        storage_options=stalled.options(),
        config=CheckpointConfig(retry=RETRY),
    )
    stalled.stall()
    calls: dict[str, Callable[[], Any]] = {
        "exists": lambda: storage.exists("metadata.json"),
        "list": storage.list,
        "list_children": storage.list_children,
        "delete": lambda: storage.delete("a/b"),
        "recursive delete": lambda: storage.delete("a", recursive=True),
        "open_uploads": storage.open_uploads,
    }
    for what, call in calls.items():
        error, elapsed = _timed(what, stalled.case, call)
        # after the first request gave up, the others make one attempt each
        assert isinstance(error, StorageTimeoutError | OSError), repr(error)
        assert elapsed < REQUEST_S + 1.5, (what, elapsed, error)
        assert f"{storage.uri}" in str(error) and "rank 0" in str(error), str(error)
    stats = storage.transport.counters.snapshot()
    assert stats.timeouts >= len(calls) and stats.gave_up == len(calls)


def test_operation_deadline_bounds_verify_and_list(stalled: Stalled) -> None:
    config = CheckpointConfig(retry=OPERATION_RETRY)
    kwargs: dict[str, Any] = {"storage_options": stalled.options(), "config": config}
    parent = f"{stalled.bucket_uri}/run"
    stalled.stall()
    calls: dict[str, Callable[[], Any]] = {
        "verify (operation_timeout_s)": lambda: cloudckpt.verify(f"{parent}/iter_1", **kwargs),
        "list_checkpoints (operation_timeout_s)": lambda: list_checkpoints(parent, **kwargs),
        "latest (operation_timeout_s)": lambda: latest(parent, **kwargs),
    }
    for error, elapsed in _concurrently(stalled.case, calls).values():
        _assert_timed_out(
            error, elapsed, OPERATION_BOUND_S, f"retry.operation_timeout_s={OPERATION_S:g}"
        )


def test_opening_a_storage_on_a_stalled_store_is_bounded(stalled: Stalled) -> None:
    stalled.stall()
    started = time.monotonic()
    CheckpointStorage(  # the first-request probe: no error, the real requests decide
        f"{stalled.bucket_uri}/open",
        storage_options=stalled.options(),
        config=CheckpointConfig(retry=RETRY),
    )
    elapsed = time.monotonic() - started
    print(f"\n{stalled.case}: opening a storage on a stalled store took {elapsed:.2f} s")
    assert stalled.held() == 1
    assert elapsed < ATTEMPT_S + 3.0, elapsed  # the probe waited attempt_timeout_s


# -- the CLI ------------------------------------------------------------------------------


def test_cli_ls_verify_and_rm_exit_2_within_the_deadline(stalled: Stalled, tmp_path: Path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"cloudckpt": {"retry": RETRY}}))
    parent = f"{stalled.bucket_uri}/run"
    common = ["--config", str(config), *stalled.cli_options()]
    stalled.stall()

    def run(args: list[str]) -> tuple[int, float]:
        started = time.monotonic()
        status = cli_main([*args, *common])
        return status, time.monotonic() - started

    commands = {
        "ls": ["ls", parent],
        "verify": ["verify", f"{parent}/iter_1"],
        "rm": ["rm", "--yes", f"{parent}/iter_1"],
        "gc": ["gc", parent, "--keep-last", "1"],
    }
    with ThreadPoolExecutor(len(commands)) as pool:
        futures = {name: pool.submit(run, args) for name, args in commands.items()}
        for name, future in futures.items():
            status, elapsed = future.result()
            print(
                f"\n{stalled.case}: cloudckpt {name} on a stalled store: exit {status} "
                f"in {elapsed:.2f} s"
            )
            assert status == 2, name
            assert elapsed < BOUND_S, (name, elapsed)
    assert stalled.held() >= len(commands)


# -- GCS: gcsfs's requests have no timeout at all; its listings, lookups, deletes do here


@pytest.mark.parametrize("case", GS_CASES[-1:])
def test_gcs_listings_lookups_and_deletes_end_within_the_deadlines(
    request: pytest.FixtureRequest, case: str
) -> None:
    server = server_for(request, case)
    assert isinstance(server, GCSEndpoint)
    bucket_uri, _ = bucket_location(request, case)
    parent = f"{bucket_uri}/run"
    with FaultProxy(server.endpoint_url, seed=9) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
        config = CheckpointConfig(retry=RETRY)
        kwargs: dict[str, Any] = {"storage_options": options, "config": config}
        storage = CheckpointStorage(f"{parent}/iter_1", **kwargs)
        operation = CheckpointConfig(retry=OPERATION_RETRY)
        proxy.delay(HELD_S)
        calls: dict[str, Callable[[], Any]] = {
            "list_checkpoints": lambda: list_checkpoints(parent, **kwargs),
            "verify": lambda: cloudckpt.verify(f"{parent}/iter_1", **kwargs),
            "exists": lambda: storage.exists("metadata.json"),
            "delete": lambda: storage.delete("a/b"),
            "latest (operation_timeout_s)": lambda: latest(
                parent, storage_options=options, config=operation
            ),
        }
        timed = _concurrently(case, calls)
        held = proxy.stats().faults.get("delay", 0)
    for what, (error, elapsed) in timed.items():
        if "operation" in what:
            deadline, bound = f"retry.operation_timeout_s={OPERATION_S:g}", OPERATION_BOUND_S
        else:
            deadline, bound = f"retry.request_timeout_s={REQUEST_S:g}", REQUEST_S + 1.5
        _assert_timed_out(error, elapsed, bound, bucket_uri, deadline)
    assert held >= len(calls)


# -- a save on 2 ranks --------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[RankPool]:
    with RankPool(2, timeout_s=120) as pool:
        pool.run(_warm)  # imports done: the save's time is the save's
        yield pool


def _warm(rank: int, world: int) -> int:
    import cloudckpt.storage.s3  # noqa: F401, PLC0415 - s3fs, aiobotocore
    from cloudckpt.strategies import torch  # noqa: F401, PLC0415

    return rank


def _state(rank: int, world: int) -> dict:
    import torch  # noqa: PLC0415 - in the rank's process

    row = torch.arange(1024, dtype=torch.float32)[None] + rank
    return {"w": ShardedTensor.from_rank_offsets("w", row, (0, rank, world)), "step": 3}


def _save(rank: int, world: int, uri: str, options: dict, retry: dict) -> dict:
    config = CheckpointConfig(retry=retry)
    return _outcome(
        cloudckpt.save, _state(rank, world), uri, storage_options=options, config=config
    )


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("retry", "bound", "deadline"),
    [
        (RETRY, BOUND_S, f"retry.request_timeout_s={REQUEST_S:g}"),
        (
            OPERATION_RETRY,
            OPERATION_BOUND_S,
            f"retry.operation_timeout_s={OPERATION_S:g}",
        ),
    ],
    ids=["request-deadline", "operation-deadline"],
)
def test_a_save_fails_on_every_rank_within_the_deadline(
    two_ranks: RankPool, request: pytest.FixtureRequest, retry: dict, bound: float, deadline: str
) -> None:
    server = server_for(request, REAL_S3)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, REAL_S3)
    with FaultProxy(server.endpoint_url, seed=5) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
        uri = f"{bucket_uri}/run/iter_0000001"
        proxy.delay(HELD_S)
        outcomes = two_ranks.run(_save, uri, options, retry)
        held = proxy.stats().faults.get("delay", 0)
    for rank, out in enumerate(outcomes):
        print(f"\n{REAL_S3}: save on 2 ranks, rank {rank}: raised in {out['elapsed']:.2f} s")
        assert out["raised"], (rank, out)
        assert "StorageTimeoutError" in out["kinds"], (rank, out)
        assert out["elapsed"] < bound, (rank, out)
        assert uri in out["message"] and deadline in out["message"], (rank, out)
    assert held >= 1


# -- what the S3 listings answer when the store answers -----------------------------------


Bucket = tuple[str, dict[str, Any], S3Endpoint]


def _bucket(request: pytest.FixtureRequest, case: str) -> Bucket:
    server = server_for(request, case)
    assert isinstance(server, S3Endpoint)
    uri, options = bucket_location(request, case)
    return uri, options, server


@pytest.mark.parametrize("case", S3_CASES)
def test_listings_keep_s3fs_answers(request: pytest.FixtureRequest, case: str) -> None:
    uri, options, server = _bucket(request, case)
    name = uri.removeprefix("s3://")
    client = server.boto3_client()
    keys = ["r/a", "r/sub/b", "r/sub/deep/c", "r/m/", "r/gone/x", "r0/sibling"]
    for key in keys:
        client.put_object(Bucket=name, Key=key, Body=b"" if key.endswith("/") else b"12345")
    client.delete_object(Bucket=name, Key="r/gone/x")  # SeaweedFS keeps r/gone/
    storage = CheckpointStorage(f"{uri}/r", storage_options=options)
    assert storage.list_sizes() == {"a": 5, "sub/b": 5, "sub/deep/c": 5}
    assert storage.list("sub") == ["sub/b", "sub/deep/c"]
    children = storage.list_children()
    assert {"m", "sub"} <= set(children) <= {"gone", "m", "sub"}
    assert storage.exists("a") and not storage.exists("sub") and not storage.exists("nope")
    storage.delete("sub", recursive=True)
    assert storage.list() == ["a"]
    assert "sub" not in storage.list_children()  # its "directories" went too (SeaweedFS)
    storage.delete("a")
    storage.delete("a")  # deleting what is gone is no error
    assert storage.list() == [] and storage.is_empty()
    assert client.list_objects_v2(Bucket=name, Prefix="r0/")["KeyCount"] == 1
    missing = CheckpointStorage(f"{uri}-missing/r", storage_options=options)
    with pytest.raises(BucketNotFoundError):
        missing.list()
    with pytest.raises(BucketNotFoundError):
        missing.list_children()


@pytest.mark.parametrize("case", S3_CASES[:1])  # moto: 1,003 PUTs take seconds
def test_listings_and_recursive_deletes_page_past_1000_keys(
    request: pytest.FixtureRequest, case: str
) -> None:
    uri, options, _ = _bucket(request, case)
    storage = CheckpointStorage(f"{uri}/many", storage_options=options)
    count = 1003
    storage.write_many([(f"d/{i:05d}", b"x") for i in range(count)])
    before = storage.transport.counters.snapshot().requests
    listed = storage.list_sizes()
    assert list(listed) == [f"d/{i:05d}" for i in range(count)]
    assert storage.transport.counters.snapshot().requests - before == 2  # two pages
    storage.delete("d", recursive=True)
    assert storage.is_empty()
