"""An async save keeps the bounds of its config after ``save`` returns.

``cloudckpt.save(..., async_sharded_save=True)`` returns an ``AsyncRequest`` that
carries the collective bounds in force when it was made (``heartbeat_timeout_s`` /
``collective_timeout_s`` of the save's config); ``AsyncCallsQueue`` agrees on the
request and runs its finalize functions (the commit's collectives) within them, as a
synchronous save runs within ``dist.bounded(config)``. Before, the agreement of
``maybe_finalize_async_calls`` used the defaults: a rank SIGKILLed during the upload was
named after 15.3 s ("no heartbeat for 15 s") with ``heartbeat_timeout_s: 3``.

* 3 real gloo ranks, SeaweedFS behind the fault proxy (each data object's PUT answered
  1.5 s late, so the upload is still running when a rank is killed 1 s into it): the
  survivors raise ``RankLostError`` naming it within the 3 s bound plus slack (< 8 s);
* 3 ranks, no store: a rank that dies before its finalize function's collective is
  named there within the request's bound, not the default;
* one process: a request made inside ``dist.bounded(config)`` carries those bounds,
  and its finalize functions (and ``execute_sync``) see them, from the queue's
  persistent worker or a thread per request alike.

The times to failure are printed (``-s``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor, dist
from cloudckpt.config import CheckpointConfig
from cloudckpt.dist_bounds import DEFAULT_HEARTBEAT_TIMEOUT_S, Bounds, current_bounds
from cloudckpt.launch import RankPool
from cloudckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for
from tests.test_failure_agreement import _outcome

WORLD = 3
VICTIM = 2
HEARTBEAT_S = 3.0
LIMIT_S = 8.0  # the bound plus slack for a loaded 2-core machine; the default is 15 s
FAST_RETRY = {"base_delay_s": 0.02, "max_delay_s": 0.2, "attempt_timeout_s": 5.0}
ROW = 256 * 1024  # float32 elements per rank: a 1 MiB object each


@pytest.fixture(params=[S3_CASES[-1]])  # SeaweedFS (or the external endpoint)
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, S3Endpoint, str]]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=5) as proxy:
        yield proxy, server, bucket_uri


def _kill_self(stamp: str) -> None:
    with open(stamp, "w") as out:
        out.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _state(rank: int, world: int) -> dict:
    data = torch.arange(ROW, dtype=torch.float32)[None] + rank
    return {"big": ShardedTensor.from_rank_offsets("big", data, (0, rank, world)), "step": 3}


def _async_save_with_victim(
    rank: int, world: int, uri: str, options: dict, config: dict, stamp: str
) -> dict:
    """Every rank: an async save, scheduled; the victim is killed 1 s into the upload;
    the others finalize (blocking) and report what they raised, and when."""
    dist.all_gather_object(rank)  # every rank has started (imported this module)
    request = cloudckpt.save(
        _state(rank, world),
        uri,
        storage_options=options,
        config=CheckpointConfig(**config),
        async_sharded_save=True,
    )
    assert isinstance(request, AsyncRequest)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    if rank == VICTIM:
        threading.Timer(1.0, _kill_self, (stamp,)).start()
    out = _outcome(queue.maybe_finalize_async_calls, blocking=True)
    out["bounds"] = request.bounds
    queue.close(abort=True)
    return out


def _assert_named_within_bound(outcomes: list[tuple[bool, Any]], stamp: str, what: str) -> None:
    with open(stamp) as stamped:
        killed_at = float(stamped.read())
    ok, victim_out = outcomes[VICTIM]
    assert not ok and "killed by signal 9" in victim_out, victim_out
    survivors = [out for rank, (ok, out) in enumerate(outcomes) if rank != VICTIM and ok]
    assert len(survivors) == WORLD - 1, outcomes
    took = [out["raised_at"] - killed_at for out in survivors if out.get("raised")]
    shown = [round(t, 2) for t in took]
    print(f"\n{what}: rank {VICTIM} killed, the others raised {shown} s after")
    for out in survivors:
        assert out["raised"], out
        assert "RankLostError" in out["kinds"] and "CheckpointingException" in out["kinds"], out
        assert out["failed_ranks"] == [VICTIM], out
        assert f"rank {VICTIM}:" in out["message"], out
        assert f"{HEARTBEAT_S:g} s" in out["message"], out  # the request's bound, not 15 s
    assert len(took) == WORLD - 1 and max(took) < LIMIT_S, took


@pytest.mark.multirank
def test_a_rank_killed_during_an_async_upload_is_named_within_the_configured_bound(
    proxied: tuple[FaultProxy, S3Endpoint, str], tmp_path: Any
) -> None:
    """The issue's reproduction. The queue's persistent worker runs the same agreement
    and finalize (the single-process tests below run both)."""
    proxy, server, bucket_uri = proxied
    uri = f"{bucket_uri}/async/ckpt"
    stamp = str(tmp_path / "killed")
    options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
    config = {"heartbeat_timeout_s": HEARTBEAT_S, "retry": FAST_RETRY}
    proxy.delay(1.5, methods={"PUT"}, path_contains=".distcp")  # the upload: after save
    with RankPool(WORLD, timeout_s=60) as pool:
        outcomes = pool.run_each(_async_save_with_victim, uri, options, config, stamp)
    proxy.clear()
    for rank, (ok, out) in enumerate(outcomes):
        if ok:
            assert out["bounds"].heartbeat_timeout_s == HEARTBEAT_S, (rank, out)
    _assert_named_within_bound(outcomes, stamp, "async save")
    assert not cloudckpt.latest(f"{bucket_uri}/async", storage_options=server.storage_options())


def _finalize_with_victim(rank: int, world: int, stamp: str) -> dict:
    """A request made within the bounds of a config; the victim dies in its finalize
    function, the others' finalize function runs a collective."""
    dist.all_gather_object(rank)
    config = CheckpointConfig(heartbeat_timeout_s=HEARTBEAT_S)

    def finalize() -> None:
        if rank == VICTIM:
            _kill_self(stamp)
        dist.all_gather_object(rank, what="the test's finalize collective")

    with dist.bounded(config):
        request = AsyncRequest(lambda: None, (), [finalize])
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    return _outcome(queue.maybe_finalize_async_calls, blocking=True)


@pytest.mark.multirank
def test_a_finalize_collective_runs_within_the_request_bounds(tmp_path: Any) -> None:
    stamp = str(tmp_path / "killed")
    with RankPool(WORLD, timeout_s=60) as pool:
        outcomes = pool.run_each(_finalize_with_victim, stamp)
    _assert_named_within_bound(outcomes, stamp, "finalize collective")


# -- one process: what the request carries, and what its steps see ----------------------


def test_a_request_carries_the_bounds_in_force_when_it_was_made() -> None:
    outside = AsyncRequest(None, ())
    assert outside.bounds == Bounds.resolve()
    assert outside.bounds.heartbeat_timeout_s == DEFAULT_HEARTBEAT_TIMEOUT_S
    with dist.bounded(CheckpointConfig(collective_timeout_s=42.0, heartbeat_timeout_s=2.0)):
        inside = AsyncRequest(None, ())
    assert inside.bounds == Bounds(42.0, 2.0)
    assert inside.freeze().bounds == inside.bounds  # copies keep them
    assert inside._replace(call_idx=3).bounds == inside.bounds
    assert "bounds" not in inside._asdict()  # Megatron-Core's NamedTuple view is unchanged


@pytest.mark.parametrize("persistent", [False, True], ids=["thread-per-call", "persistent"])
def test_the_queue_finalizes_within_the_request_bounds(persistent: bool) -> None:
    seen: list[tuple[str, Bounds]] = []
    with dist.bounded(CheckpointConfig(collective_timeout_s=7.0, heartbeat_timeout_s=1.0)):
        first = AsyncRequest(None, (), [lambda: seen.append(("a", current_bounds()))])
    with dist.bounded(CheckpointConfig(collective_timeout_s=9.0, heartbeat_timeout_s=0)):
        second = AsyncRequest(lambda: None, (), [lambda: seen.append(("b", current_bounds()))])
    with AsyncCallsQueue(persistent=persistent) as queue:
        queue.schedule_async_request(first)
        queue.schedule_async_request(second)
        assert current_bounds() == Bounds.resolve()  # outside: the defaults
    assert seen == [("a", Bounds(7.0, 1.0)), ("b", Bounds(9.0, 0.0))]
    assert current_bounds() == Bounds.resolve()  # and again after


def test_execute_sync_runs_within_the_request_bounds() -> None:
    seen: list[Bounds] = []
    with dist.bounded(CheckpointConfig(collective_timeout_s=5.0, heartbeat_timeout_s=0.5)):
        request = AsyncRequest(None, (), [lambda: seen.append(current_bounds())])
    request.execute_sync()
    assert seen == [Bounds(5.0, 0.5)]


def test_an_async_save_request_carries_its_config_bounds(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    config = CheckpointConfig(collective_timeout_s=11.0, heartbeat_timeout_s=4.0)
    request = cloudckpt.save(_state(0, 1), uri, config=config, async_sharded_save=True)
    assert isinstance(request, AsyncRequest) and request.bounds == Bounds(11.0, 4.0)
    with AsyncCallsQueue() as queue:
        queue.schedule_async_request(request)
    assert cloudckpt.latest(str(tmp_path)) == uri
