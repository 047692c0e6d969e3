"""Bounded failure, 4 real gloo ranks, the S3 test server (SeaweedFS) behind the fault
proxy: a failure anywhere reaches every rank within seconds, never after a collective
timeout, and the last good checkpoint stays safe.

* the server dies midway through a save: every rank raises, the previous checkpoint
  still loads and verifies, the failed one is uncommitted, ``gc`` explains why it
  keeps it and, with ``--grace 0``, removes it and its open multipart uploads;
* a rank killed (SIGKILL) or frozen (SIGSTOP) mid-save: the others raise a
  ``CollectiveError`` naming it (heartbeat, or the collective timeout);
* one rank's reads delayed past the request deadline in a load: every rank raises,
  naming that rank.

The times to failure are printed (``-s``) for the closing note.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor, dist, dist_guard
from cloudckpt.cli import main as cli_main
from cloudckpt.config import CheckpointConfig, ConfigError, from_dict
from cloudckpt.dist_bounds import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    ENV_COLLECTIVE_TIMEOUT,
    ENV_HEARTBEAT_TIMEOUT,
    Bounds,
)
from cloudckpt.formats.dcp.steps import GuardedDistWrapper
from cloudckpt.launch import RankPool
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for
from tests.test_failure_agreement import _outcome  # the same outcome record
from tests.test_multirank import tp_state

REAL_S3 = S3_CASES[-1]  # SeaweedFS (or the external endpoint)
MiB = 2**20
WORLD = 4
BOUND_S = 30.0  # the bound: a failure reaches every rank within 30 s
FAST = {
    "base_delay_s": 0.02,
    "max_delay_s": 0.2,
    "attempt_timeout_s": 2.0,
    "request_timeout_s": 5.0,
}
ROW = 6 * MiB // 4  # float32 elements per rank: a 6 MiB object, two multipart parts


@dataclass
class Proxied:
    proxy: FaultProxy
    server: S3Endpoint
    bucket_uri: str

    @property
    def bucket(self) -> str:
        return self.bucket_uri.removeprefix("s3://")

    def options(self) -> dict[str, Any]:
        """s3fs options through the proxy."""
        return {**self.server.storage_options(), "endpoint_url": self.proxy.endpoint_url}

    def cli_options(self) -> list[str]:
        """``--storage-option`` flags straight to the server (not through the proxy)."""
        direct = self.server.storage_options()
        return [f"--storage-option={k}={v}" for k, v in direct.items() if isinstance(v, str)]

    def open_uploads(self, prefix: str) -> list[str]:
        client = self.server.boto3_client()
        found = client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return [u["Key"] for u in found.get("Uploads", [])]

    def objects(self, prefix: str) -> list[str]:
        client = self.server.boto3_client()
        found = client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for o in found.get("Contents", [])]


@pytest.fixture(params=[REAL_S3])
def proxied(request: pytest.FixtureRequest) -> Iterator[Proxied]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=3) as proxy:
        yield Proxied(proxy, server, bucket_uri)


def big_state(rank: int, world: int, row: int = ROW, empty: bool = False) -> dict:
    """One (world, row) float32 tensor, a row per rank, and a plain value."""
    data = torch.empty(1, row) if empty else torch.arange(row, dtype=torch.float32)[None] + rank
    return {"big": ShardedTensor.from_rank_offsets("big", data, (0, rank, world)), "step": 7}


def _save(rank: int, world: int, uri: str, options: dict, config: dict, row: int = ROW) -> dict:
    state = big_state(rank, world, row)
    return _outcome(
        cloudckpt.save, state, uri, storage_options=options, config=CheckpointConfig(**config)
    )


class Killer(threading.Thread):
    """Kills the proxy (the server dies) once ``held`` multipart parts are stored and
    their answers held back, so uploads are open on the server."""

    def __init__(self, proxy: FaultProxy, held: int) -> None:
        super().__init__(daemon=True)
        self.proxy, self.held = proxy, held
        self.killed_at: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while self.proxy.stats().faults.get("delay", 0) < self.held:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        time.sleep(0.2)  # let a few more parts arrive
        self.killed_at = time.time()
        self.proxy.kill()


def test_server_dying_mid_save_fails_every_rank_and_gc_cleans_up(
    rank_pool: RankPool, proxied: Proxied, capsys: pytest.CaptureFixture[str]
) -> None:
    root = f"{proxied.bucket_uri}/run"
    good, failed = f"{root}/iter_0000001", f"{root}/iter_0000002"
    config = {"part_size": 5 * MiB, "max_in_flight": 2, "retry": FAST}
    first = rank_pool.run(_save, good, proxied.options(), config)
    assert [o["raised"] for o in first] == [False] * WORLD, first

    proxied.proxy.delay(60.0, methods={"PUT"}, path_contains="partNumber")
    killer = Killer(proxied.proxy, held=WORLD)
    killer.start()
    outcomes = rank_pool.run(_save, failed, proxied.options(), config)
    killer.join(5)
    assert killer.killed_at is not None
    took = [out["raised_at"] - killer.killed_at for out in outcomes if out["raised"]]
    with capsys.disabled():
        print(f"\nserver killed mid-save: ranks raised {[round(t, 2) for t in took]} s after")
    for rank, out in enumerate(outcomes):
        assert out["raised"] and "CheckpointingException" in out["kinds"], (rank, out)
        assert "DistributedCheckpointError" in out["kinds"], (rank, out)
    assert len(took) == WORLD and max(took) < BOUND_S

    # the previous checkpoint loads and verifies; the failed one is uncommitted
    direct = proxied.server.storage_options()
    request = {"big": ShardedTensor.from_rank_offsets("big", torch.empty(WORLD, ROW))}
    loaded = cloudckpt.load(request, good, storage_options=direct)
    expected = torch.arange(ROW, dtype=torch.float32)[None] + torch.arange(WORLD)[:, None]
    assert torch.equal(loaded["big"], expected) and loaded["step"] == 7
    capsys.readouterr()
    assert cli_main(["verify", "--deep", good, *proxied.cli_options()]) == 0
    assert cli_main(["verify", failed, *proxied.cli_options()]) != 0
    assert "not committed" in capsys.readouterr().out

    # gc keeps it within the grace period, and says why; --grace 0 removes it now
    prefix = "run/iter_0000002/"
    uploads = proxied.open_uploads(prefix)
    assert uploads, "the killed save left no open multipart upload"
    assert cli_main(["gc", root, "--keep-last", "1", *proxied.cli_options()]) == 0
    out = capsys.readouterr().out
    assert f"{failed}: uncommitted, younger than the grace period 1 h" in out, out
    assert f"{len(uploads)} open multipart upload" in out and "--grace 0" in out, out
    assert f"{good}: committed, among the newest 1" in out, out
    assert proxied.open_uploads(prefix) == uploads

    assert cli_main(["gc", root, "--keep-last", "1", "--grace", "0", *proxied.cli_options()]) == 0
    out = capsys.readouterr().out
    removed = [line for line in out.splitlines() if line.startswith("removed")]
    assert len(removed) == 1 and failed in removed[0] and "uncommitted" in removed[0], out
    assert f"{len(uploads)} open multipart upload" in removed[0], out
    assert proxied.open_uploads(prefix) == [] and proxied.objects(prefix) == []
    assert proxied.objects("run/iter_0000001/")
    assert cli_main(["verify", "--deep", good, *proxied.cli_options()]) == 0


# -- a rank killed or frozen mid-save ------------------------------------------------------


def _signal_self(signame: str, stamp: str) -> None:
    with open(stamp, "w") as out:
        out.write(repr(time.time()))
    os.kill(os.getpid(), getattr(signal, signame))


def _save_with_victim(
    rank: int,
    world: int,
    uri: str,
    options: dict,
    config: dict,
    victim: int,
    signame: str,
    after_s: float,
    stamp: str,
    pids: list[int],
) -> dict:
    dist.all_gather_object(rank)  # every rank has started (imported this module)
    if rank == victim:
        threading.Timer(after_s, _signal_self, (signame, stamp)).start()
    out = _outcome(
        cloudckpt.save,
        tp_state(rank, tp=world),
        uri,
        storage_options=options,
        config=CheckpointConfig(**config),
    )
    if rank == 0 and signame == "SIGSTOP":
        os.kill(pids[victim], signal.SIGCONT)  # it resumes, and raises in turn
    return out


# bounds with room for a loaded machine: a live rank's heartbeat thread or a slower
# rank's upload must not pass for a lost rank
SIGNALLED = [
    pytest.param("SIGKILL", {"heartbeat_timeout_s": 3.0}, "RankLostError", id="killed"),
    pytest.param(
        "SIGSTOP",
        {"heartbeat_timeout_s": 0, "collective_timeout_s": 6.0},
        "CollectiveTimeoutError",
        id="frozen-collective-timeout",
    ),
    pytest.param("SIGSTOP", {"heartbeat_timeout_s": 3.0}, "RankLostError", id="frozen-heartbeat"),
]


@pytest.mark.multirank
@pytest.mark.parametrize(("signame", "bounds", "kind"), SIGNALLED)
def test_a_rank_killed_or_frozen_mid_save_is_named_on_every_other_rank(
    proxied: Proxied, tmp_path: Any, signame: str, bounds: dict, kind: str
) -> None:
    victim, stamp = 2, str(tmp_path / "signalled")
    uri = f"{proxied.bucket_uri}/run/{signame.lower()}"
    config = {"retry": FAST, **bounds}
    proxied.proxy.delay(0.8, methods={"PUT"})  # every upload takes a while: mid-save
    with RankPool(WORLD, timeout_s=60) as pool:
        outcomes = pool.run_each(
            _save_with_victim, uri, proxied.options(), config, victim, signame, 1.2, stamp,
            pool.pids,
        )  # fmt: skip
    with open(stamp) as stamped:
        signalled_at = float(stamped.read())
    survivors = [out for rank, (ok, out) in enumerate(outcomes) if rank != victim and ok]
    assert len(survivors) == WORLD - 1, outcomes
    took = [out["raised_at"] - signalled_at for out in survivors if out.get("raised")]
    shown = [round(t, 2) for t in took]
    print(f"\n{signame} rank {victim} ({bounds}): the others raised {shown} s after")
    for out in survivors:
        assert out["raised"], out
        assert kind in out["kinds"] and "CheckpointingException" in out["kinds"], out
        assert f"rank {victim}:" in out["message"], out
        if bounds["heartbeat_timeout_s"]:
            assert out["failed_ranks"] == [victim], out
        else:  # no heartbeats: a rank frozen inside a backend collective, which all
            # waiting ranks entered, can only be named among the peers none saw leave
            assert victim in out["failed_ranks"], out
    # the survivors first finish their own uploads, then wait one bound at most
    assert max(took) < BOUND_S, took
    ok, victim_out = outcomes[victim]
    if signame == "SIGKILL":
        assert not ok and "killed by signal 9" in victim_out
    else:  # resumed after the others gave up: it learns the same verdict
        assert ok and victim_out["raised"] and kind in victim_out["kinds"], victim_out


# -- one rank's reads hit the request deadline in a load ---------------------------------------


def _load(rank: int, world: int, uri: str, options: dict, retry: dict) -> dict:
    out = _outcome(
        cloudckpt.load,
        big_state(rank, world, row=1000, empty=True),
        uri,
        storage_options=options,
        config=CheckpointConfig(retry=retry),
    )
    return out


def test_a_delayed_read_on_one_rank_fails_the_load_on_every_rank(
    rank_pool: RankPool, proxied: Proxied
) -> None:
    uri = f"{proxied.bucket_uri}/run/load"
    direct = proxied.server.storage_options()
    saved = rank_pool.run(_save, uri, direct, {"backend": "zarr"}, 1000)  # one object per row
    assert [o["raised"] for o in saved] == [False] * WORLD, saved
    assert proxied.objects("run/load/big/1.0")  # rank 1's row is that object alone
    proxied.proxy.delay(30.0, methods={"GET"}, path_contains="/big/1.0")
    # generous for the other ranks' reads on a loaded machine; rank 1's never come
    retry = {**FAST, "attempt_timeout_s": 3.0, "request_timeout_s": 6.0}
    outcomes = rank_pool.run(_load, uri, proxied.options(), retry)
    proxied.proxy.clear()
    shown = [round(o["elapsed"], 2) for o in outcomes]
    print(f"\none rank's reads delayed: the ranks raised after {shown} s")
    for rank, out in enumerate(outcomes):
        assert out["raised"] and out["failed_ranks"] == [1], (rank, out["message"])
        assert "StorageTimeoutError" in out["kinds"] and "rank 1:" in out["message"], out
        assert "retry.request_timeout_s=6" in out["message"], out
        assert out["elapsed"] < 20.0, out


# -- the check-in itself, on the shared pool (every rank ends on the same verdict) ----------


def _one_rank_late(rank: int, world: int, late: int, sleep_s: float) -> dict:
    dist.all_gather_object(rank)  # every rank has started (imported this module)
    config = CheckpointConfig(collective_timeout_s=1.0, heartbeat_timeout_s=0)
    with dist.bounded(config):
        if rank == late:
            time.sleep(sleep_s)  # alive (not frozen), just elsewhere
        out = _outcome(dist.all_gather_object, rank, what="gathering the test's ranks")
    after = dist.all_gather_object(rank)  # the group still works: same verdict everywhere
    return {**out, "after": after}


def test_a_rank_that_does_not_arrive_is_named_after_the_collective_timeout(
    rank_pool: RankPool,
) -> None:
    # rank 3 arrives 4 s late: the others must give up after their 1 s timeout, long
    # before it (3.5 s leaves room for a loaded 2-core machine)
    outcomes = rank_pool.run(_one_rank_late, 3, 4.0)
    for rank, out in enumerate(outcomes):
        assert out["raised"] and "CollectiveTimeoutError" in out["kinds"], (rank, out)
        assert "TimeoutError" in out["kinds"] and out["failed_ranks"] == [3], (rank, out)
        assert "gathering the test's ranks" in out["message"], out
        assert "rank 3: did not arrive within collective_timeout_s=1" in out["message"], out
        assert out["after"] == [0, 1, 2, 3]
    assert all(out["elapsed"] < 3.5 for out in outcomes[:3]), outcomes


# -- settings and gc's report, without a server ---------------------------------------------


def test_collective_bounds_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = from_dict({"collective_timeout_s": 30, "heartbeat_timeout_s": 0})
    assert (config.collective_timeout_s, config.heartbeat_timeout_s) == (30, 0)
    assert "collective_timeout_s=30" in repr(config)
    for bad in (
        {"collective_timeout_s": 0},
        {"heartbeat_timeout_s": -1},
        {"collective_timeout_s": "1"},
    ):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            from_dict(bad)
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "12.5")
    monkeypatch.setenv(ENV_HEARTBEAT_TIMEOUT, "3")
    assert Bounds.resolve() == Bounds(12.5, 3.0)
    assert Bounds.resolve(collective_timeout_s=7) == Bounds(7.0, 3.0)
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "soon")
    with pytest.raises(ConfigError, match=ENV_COLLECTIVE_TIMEOUT):
        Bounds.resolve()
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT)
    monkeypatch.delenv(ENV_HEARTBEAT_TIMEOUT)
    assert Bounds.resolve() == Bounds(DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_HEARTBEAT_TIMEOUT_S)


def test_gc_says_why_it_keeps_an_uncommitted_checkpoint_and_removes_it_with_no_grace(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    for name in ("iter_0000001", "iter_0000002"):
        cloudckpt.save(big_state(0, 1, row=10), str(root / name))
    for name in ("metadata.json", "manifest.json"):  # as if its save had failed
        os.remove(root / "iter_0000002" / name)
    capsys.readouterr()
    assert cli_main(["gc", str(root), "--keep-last", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["actions"] == []
    why = {k["uri"]: k for k in report["kept_why"]}
    assert why[str(root / "iter_0000001")]["reason"] == "committed, among the newest 1"
    young = why[str(root / "iter_0000002")]
    assert young["reason"] == "uncommitted, younger than the grace period 1 h"
    assert "last activity" in young["detail"] and "--grace 0" in young["detail"]

    assert cli_main(["gc", str(root), "--keep-last", "1", "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed" in out and "iter_0000002" in out and "uncommitted" in out, out
    assert f"{root / 'iter_0000001'}: committed, among the newest 1" in out, out
    assert not (root / "iter_0000002").exists()
    assert cli_main(["verify", str(root / "iter_0000001")]) == 0


# -- a rank that dies inside the backend's collective ----------------------------------------


def _collective(rank: int, world: int, name: str) -> Any:
    """One of the object collectives PyTorch DCP's save runs (through cloudckpt's
    GuardedDistWrapper) or cloudckpt runs itself, by ``name``."""
    wrapper = GuardedDistWrapper(None, 0, "the test's collective")
    if name == "all_gather":
        return wrapper.all_gather_object(f"rank {rank} " * rank)
    if name == "gather":
        return wrapper.gather_object({"rank": rank, "pad": b"x" * 100 * rank})
    if name == "scatter":
        return wrapper.scatter_object([f"to {r}" * r for r in range(world)] if rank == 0 else None)
    return wrapper.broadcast_object(list(range(1000)) if rank == 0 else None)


COLLECTIVES = ["all_gather", "gather", "scatter", "broadcast"]


def test_the_bounded_object_collectives_deliver_what_torch_distributed_does(
    rank_pool: RankPool,
) -> None:
    """Objects of different sizes on each rank arrive whole, where torch.distributed's
    own object collectives would put them (the coordinator is rank 0)."""
    results = {name: rank_pool.run(_collective, name) for name in COLLECTIVES}
    assert results["all_gather"] == [[f"rank {r} " * r for r in range(WORLD)]] * WORLD
    gathered = [{"rank": r, "pad": b"x" * 100 * r} for r in range(WORLD)]
    assert results["gather"] == [gathered] + [None] * (WORLD - 1)
    assert results["scatter"] == [f"to {r}" * r for r in range(WORLD)]
    assert results["broadcast"] == [list(range(1000))] * WORLD


def _stop_inside_the_collective(
    rank: int, world: int, victim: int, how: str, name: str, pids: list[int]
) -> dict:
    dist.all_gather_object(rank)  # every rank has started (imported this module)
    with dist.bounded(CheckpointConfig(heartbeat_timeout_s=1.0)):
        if rank == victim:  # checked in, then gone before the backend's collective
            dist_guard.check_in("the test's collective: " + name)
            time.sleep(0.3)
            if how == "frozen":
                os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 has raised
            os._exit(3)
        out = _outcome(_collective, rank, world, name)
    if rank == 0 and how == "frozen":
        os.kill(pids[victim], signal.SIGCONT)
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("how", "name"),
    [
        ("killed", "all_gather"),
        ("frozen", "gather"),
        ("frozen", "scatter"),
        ("killed", "broadcast"),
    ],
)
def test_a_rank_lost_inside_a_collective_is_named_on_every_peer(how: str, name: str) -> None:
    """The rank checked in, then died or froze before the backend's collective (the one
    window the check-in cannot cover): every peer raises a RankLostError naming it
    within the heartbeat bound, never gloo's raw RuntimeError, and none stays blocked
    until the process group's own timeout (cloudckpt polls the backend's collective
    and watches the heartbeats meanwhile)."""
    victim = 1
    with RankPool(WORLD, timeout_s=30) as pool:
        outcomes = pool.run_each(_stop_inside_the_collective, victim, how, name, pool.pids)
    assert outcomes[victim][0] is False and "exit status 3" in outcomes[victim][1], outcomes
    peers = [out for rank, (ok, out) in enumerate(outcomes) if rank != victim]
    assert all(ok for ok, _ in (o for r, o in enumerate(outcomes) if r != victim)), outcomes
    shown = [round(o["elapsed"], 2) for o in peers]
    print(f"\nrank {victim} {how} inside gloo's {name}: the peers raised after {shown} s")
    for out in peers:
        assert out["raised"] and "RankLostError" in out["kinds"], out
        assert "ConnectionError" in out["kinds"] and out["failed_ranks"] == [victim], out
        assert f"rank {victim}: " in out["message"], out
        assert "process gone" in out["message"] or "no heartbeat" in out["message"], out
        assert out["elapsed"] < 15.0, out
