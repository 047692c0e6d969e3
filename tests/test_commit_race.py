"""A save's commit racing a removal (``cloudckpt gc --grace 0``, ``cloudckpt rm``), forced
both ways with the fault proxy holding one side's requests (SeaweedFS and moto, 4 gloo
ranks): after every interleaving either the save raised on every rank and nothing of
it remains, or the checkpoint is committed, complete and kept.

The two exclude each other through one create-only write of ``manifest.json``: the
removal's tombstone or the save's manifest (``cloudckpt.removal``, ``cloudckpt.commit``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

import cloudckpt
from cloudckpt.errors import CheckpointingException, CheckpointRemovedError, CommitConflictError
from cloudckpt.storage import CheckpointStorage
from cloudckpt.tracker import REASON_COMMITTED_MEANWHILE, collect_garbage, remove_checkpoint
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, bucket_location, server_for
from tests.test_multirank import check_tp, tp_state

HOLD_S = 60.0  # the longest a request is held (each test releases it long before)
WAIT_S = 60.0
SAVED = "saved"
REMOVED = "removed"
KEPT = "kept"


@dataclass
class Race:
    server: S3Endpoint
    parent: str
    saver: FaultProxy  # in front of the save's ranks
    remover: FaultProxy  # in front of gc / rm

    def options(self, proxy: FaultProxy | None = None) -> dict[str, Any]:
        base = self.server.storage_options()
        return base if proxy is None else {**base, "endpoint_url": proxy.endpoint_url}

    def uri(self, iteration: int) -> str:
        return f"{self.parent}/iter_{iteration:07d}"

    def objects(self, iteration: int) -> list[str]:
        """What is stored under the checkpoint, and its open uploads (a fresh client)."""
        storage = CheckpointStorage(self.uri(iteration), storage_options=self.options())
        return storage.list() + [f"upload {u.path}" for u in storage.open_uploads()]


@pytest.fixture(params=S3_CASES)
def race(request: pytest.FixtureRequest) -> Iterator[Race]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    assert server.create_only, f"{server.case} must refuse a second create (If-None-Match)"
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url) as saver, FaultProxy(server.endpoint_url) as remover:
        race = Race(server, f"{bucket_uri}/run", saver, remover)
        cloudckpt.save(tp_state(0, tp=1), race.uri(1), storage_options=race.options())
        yield race


def _save(rank: int, world: int, uri: str, options: dict[str, Any]) -> str:
    """``saved``, or the error's kind and message."""
    try:
        cloudckpt.save(tp_state(rank, tp=world), uri, storage_options=options)
    except CheckpointingException as exc:
        kind = "removed" if isinstance(exc, CheckpointRemovedError) else type(exc).__name__
        return f"{kind}: {exc}"
    return SAVED


def _remove(race: Race, remover: str, proxied: bool) -> str:
    """Run ``gc --grace 0 --keep-last 1`` or ``rm`` on iteration 2: ``removed`` or ``kept``."""
    options = race.options(race.remover if proxied else None)
    uri = race.uri(2)
    if remover == "rm":
        try:
            remove_checkpoint(uri, storage_options=options)
        except CommitConflictError as exc:
            assert "committed while it was being removed" in str(exc)
            return KEPT
        return REMOVED
    report = collect_garbage(race.parent, 1, grace_s=0, storage_options=options)
    if uri in report.kept:
        assert report.actions == ()
        why = {a.uri: a for a in report.kept_why}[uri]
        # its tombstone came too late, or its manifest (metadata.json due) spared it
        reason = why.reason
        assert reason == REASON_COMMITTED_MEANWHILE or reason.startswith("uncommitted, younger")
        return KEPT
    assert [(a.uri, a.reason) for a in report.actions] == [(uri, "uncommitted")]
    return REMOVED


def _held(proxy: FaultProxy) -> Callable[[], bool]:
    return lambda: proxy.stats().faults.get("hold", 0) >= 1


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _in_background(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Future[Any]:
    return pool.submit(fn, *args)


def _assert_removed_everywhere(race: Race, outcomes: list[str]) -> None:
    """The save raised on every rank, nothing of it remains, the older one is latest."""
    assert all(o.startswith("removed: ") for o in outcomes), outcomes
    assert race.objects(2) == []
    assert cloudckpt.latest(race.parent, storage_options=race.options()) == race.uri(1)


def _assert_committed_and_kept(race: Race, outcomes: list[str]) -> None:
    assert outcomes == [SAVED] * len(outcomes)
    uri, options = race.uri(2), race.options()
    assert cloudckpt.verify(uri, deep=True, storage_options=options).ok
    assert cloudckpt.latest(race.parent, storage_options=options) == uri
    loaded = cloudckpt.load(tp_state(0, tp=1, empty=True), uri, storage_options=options)
    check_tp(loaded, 0, 1)


# -- the removal first -------------------------------------------------------------------


@pytest.mark.parametrize("remover", ["gc", "rm"])
@pytest.mark.parametrize(
    "held", ["iter_0000002/manifest.json", "iter_0000002/__1_0.distcp"], ids=["commit", "write"]
)
def test_a_removal_before_the_commit_fails_the_save_on_every_rank(
    rank_pool: Any, race: Race, remover: str, held: str
) -> None:
    """The save's manifest create (or a rank's data write) is held while the removal
    runs to its end: the held request lands after it (a data object reappears), the
    commit finds its claim gone, and the save deletes what it wrote."""
    race.saver.hold(HOLD_S, methods={"PUT"}, path_contains=held)
    with ThreadPoolExecutor(1) as pool:
        saving = _in_background(pool, rank_pool.run, _save, race.uri(2), race.options(race.saver))
        _wait_for(_held(race.saver), f"the save's PUT of {held}")
        assert _remove(race, remover, proxied=False) == REMOVED
        race.saver.release()
        _assert_removed_everywhere(race, saving.result(WAIT_S))


@pytest.mark.parametrize("remover", ["gc", "rm"])
def test_a_commit_landing_on_the_tombstone_fails_the_save_on_every_rank(
    rank_pool: Any, race: Race, remover: str
) -> None:
    """The removal took ``manifest.json``'s slot and is held at its first delete when
    the save's manifest create lands: refused, the save deletes what it wrote, and the
    removal finishes."""
    race.saver.hold(HOLD_S, methods={"PUT"}, path_contains="iter_0000002/manifest.json")
    race.remover.hold(HOLD_S, methods={"DELETE", "POST"})
    with ThreadPoolExecutor(2) as pool:
        saving = _in_background(pool, rank_pool.run, _save, race.uri(2), race.options(race.saver))
        _wait_for(_held(race.saver), "the save's PUT of manifest.json")
        removing = _in_background(pool, _remove, race, remover, True)
        _wait_for(_held(race.remover), "the removal's first delete")
        race.saver.release()
        outcomes = saving.result(WAIT_S)
        race.remover.release()
        assert removing.result(WAIT_S) == REMOVED
        _assert_removed_everywhere(race, outcomes)


# -- the commit first --------------------------------------------------------------------


@pytest.mark.parametrize("remover", ["gc", "rm"])
def test_a_commit_before_the_tombstone_keeps_the_checkpoint(
    rank_pool: Any, race: Race, remover: str
) -> None:
    """The removal saw the checkpoint uncommitted, but its tombstone is held until the
    save committed: the tombstone's create fails, nothing is deleted, and the
    checkpoint is committed, complete and kept."""
    race.saver.hold(HOLD_S, methods={"PUT"}, path_contains="iter_0000002/manifest.json")
    race.remover.hold(HOLD_S, methods={"PUT"}, path_contains="iter_0000002/manifest.json")
    with ThreadPoolExecutor(2) as pool:
        saving = _in_background(pool, rank_pool.run, _save, race.uri(2), race.options(race.saver))
        _wait_for(_held(race.saver), "the save's PUT of manifest.json")
        removing = _in_background(pool, _remove, race, remover, True)
        _wait_for(_held(race.remover), "the removal's tombstone")
        race.saver.release()
        outcomes = saving.result(WAIT_S)
        race.remover.release()
        assert removing.result(WAIT_S) == KEPT
        _assert_committed_and_kept(race, outcomes)


@pytest.mark.parametrize("remover", ["gc", "rm"])
def test_a_removal_while_the_commit_checks_its_claim(
    rank_pool: Any, race: Race, remover: str
) -> None:
    """The save created its manifest and its read of the claim is held. ``gc --grace
    0`` spares a checkpoint whose manifest won (its ``metadata.json`` is due): the
    save commits. ``rm`` removes it as asked: the save finds its claim gone, raises on
    every rank and deletes what it wrote."""
    race.saver.hold(HOLD_S, methods={"GET"}, path_contains="iter_0000002/.cloudckpt-claim.json")
    with ThreadPoolExecutor(1) as pool:
        saving = _in_background(pool, rank_pool.run, _save, race.uri(2), race.options(race.saver))
        _wait_for(_held(race.saver), "the commit's read of the claim")
        outcome = _remove(race, remover, proxied=False)
        race.saver.release()
        outcomes = saving.result(WAIT_S)
    if remover == "gc":
        assert outcome == KEPT
        _assert_committed_and_kept(race, outcomes)
    else:
        assert outcome == REMOVED
        _assert_removed_everywhere(race, outcomes)
