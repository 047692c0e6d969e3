"""cloudckpt.tracker: listing, latest, removal and garbage collection of a run's
checkpoints, on a local directory and on the S3 API (moto, or MinIO when
``CLOUDCKPT_TEST_S3_ENDPOINT`` is set).

Every run starts from the same layout under ``<parent>``::

    iter_0000001/   committed
    iter_0000002/   committed
    iter_0000003/   uncommitted (its metadata.json and manifest.json deleted: a save that
                    failed before its commit)
    tensorboard/    not a checkpoint
"""

from __future__ import annotations

import datetime
import pathlib
import time
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.checker import verify
from cloudckpt.errors import (
    CheckpointNotFoundError,
    StorageError,
    UncommittedCheckpointError,
)
from cloudckpt.storage import CheckpointStorage
from cloudckpt.tracker import (
    CheckpointInfo,
    collect_garbage,
    latest,
    list_checkpoints,
    remove_checkpoint,
)
from tests.fixtures_object_stores import S3_CASES, S3Endpoint, StoreLocation, bucket_location
from tests.test_checker import S3Calls, shared_client

ZARR = ("zarr", 1)  # these tests look at the zarr layout (chunk objects)

COMMIT_FILES = ("metadata.json", "manifest.json")
STRAY = "tensorboard/events.out.tfevents"


def _state(iteration: int) -> dict[str, Any]:
    weight = torch.full((64, 32), float(iteration))
    return {"w": ShardedTensor.from_rank_offsets("w", weight), "iteration": iteration}


def _save(parent_uri: str, options: dict[str, Any], iteration: int) -> str:
    uri = f"{parent_uri}/iter_{iteration:07d}"
    cloudckpt.save(
        _state(iteration), uri, storage_options=shared_client(options), sharded_strategy=ZARR
    )
    return uri


def _objects(uri: str, options: dict[str, Any]) -> dict[str, int]:
    """What is stored under ``uri`` (fresh filesystem: no cached listing)."""
    return CheckpointStorage(uri, storage_options=options).list_sizes()


def _data_size(uri: str, options: dict[str, Any]) -> int:
    """Bytes of the objects a manifest lists: everything but the two commit files."""
    return sum(n for p, n in _objects(uri, options).items() if p not in COMMIT_FILES)


def _populate(parent: str, options: dict[str, Any]) -> StoreLocation:
    for iteration in (1, 2, 3):
        _save(parent, options, iteration)
    unfinished = CheckpointStorage(f"{parent}/iter_0000003", storage_options=options)
    unfinished.delete("metadata.json")
    unfinished.delete("manifest.json")
    CheckpointStorage(parent, storage_options=options).write(STRAY, b"not a checkpoint")
    return parent, options


@pytest.fixture(params=["local", *S3_CASES])
def run(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> StoreLocation:
    """A parent prefix holding the layout of the module docstring, locally and on S3."""
    if request.param == "local":
        return _populate(str(tmp_path / "run"), {})
    bucket_uri, options = bucket_location(request, request.param)
    return _populate(f"{bucket_uri}/run", options)


@pytest.fixture
def s3_run(s3_bucket: StoreLocation) -> StoreLocation:
    """The same layout on the S3 API only (for botocore hooks and multipart uploads)."""
    bucket_uri, options = s3_bucket
    return _populate(f"{bucket_uri}/run", options)


def test_list_checkpoints_and_latest(run: StoreLocation) -> None:
    parent, options = run
    infos = list_checkpoints(parent, storage_options=options)

    assert [(i.name, i.iteration, i.committed) for i in infos] == [
        ("iter_0000001", 1, True),
        ("iter_0000002", 2, True),
        ("iter_0000003", 3, False),
    ]
    for info in infos[:2]:
        assert info.uri == f"{parent}/{info.name}"
        assert info.size == _data_size(info.uri, options) > 64 * 32 * 4
        assert info.world_size == 1 and not info.foreign
        assert info.created.endswith("Z")
    assert (infos[2].size, infos[2].created, infos[2].world_size) == (None, "", None)
    assert latest(parent, storage_options=options) == f"{parent}/iter_0000002"
    assert latest(f"{parent}/tensorboard", storage_options=options) is None

    newest = _save(parent, options, 4)
    assert latest(parent, storage_options=options) == newest
    assert [i.name for i in list_checkpoints(parent, storage_options=options)][-1] == (
        "iter_0000004"
    )


def test_foreign_checkpoint_is_listed_as_committed(run: StoreLocation) -> None:
    parent, options = run
    uri = _save(parent, options, 10)
    storage = CheckpointStorage(uri, storage_options=options)
    storage.delete("manifest.json")
    storage.delete(".cloudckpt-claim.json")
    info = list_checkpoints(parent, storage_options=options)[-1]
    assert info == CheckpointInfo(uri, "iter_0000010", 10, True, True, None, "", None)
    assert latest(parent, storage_options=options) == uri


def test_remove_checkpoint(run: StoreLocation) -> None:
    parent, options = run
    uri = f"{parent}/iter_0000001"
    before = _objects(uri, options)
    others = {n: _objects(f"{parent}/{n}", options) for n in ("iter_0000002", "iter_0000003")}
    progress: list[int] = []

    removed = remove_checkpoint(uri, storage_options=options, progress=progress.append)

    assert removed == len(before) == sum(progress) >= 5
    assert _objects(uri, options) == {}
    if "://" not in parent:  # no empty directories left behind either
        assert not pathlib.Path(uri).exists()
    for name, objects in others.items():
        assert _objects(f"{parent}/{name}", options) == objects
    assert verify(f"{parent}/iter_0000002", deep=True, storage_options=options).ok
    assert [i.name for i in list_checkpoints(parent, storage_options=options)] == [
        "iter_0000002",
        "iter_0000003",
    ]
    with pytest.raises(CheckpointNotFoundError, match="iter_0000001"):
        remove_checkpoint(uri, storage_options=options)


def test_remove_refuses_a_prefix_that_is_not_a_checkpoint(run: StoreLocation) -> None:
    parent, options = run
    everything = _objects(parent, options)
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint at .*a parent prefix"):
        remove_checkpoint(parent, storage_options=options)
    assert _objects(parent, options) == everything


def test_remove_takes_the_manifest_slot_then_uncommits_first_on_s3(s3_run: StoreLocation) -> None:
    """The order of a removal's writes: the tombstone over ``manifest.json`` before any
    delete, ``metadata.json`` first, the claim and then the tombstone last."""
    parent, options = s3_run
    uri = f"{parent}/iter_0000001"
    prefix = uri.split("/", 3)[3] + "/"
    calls = S3Calls()

    removed = remove_checkpoint(uri, storage_options=calls.options(options))

    writes = [
        (op, key.removeprefix(prefix))
        for op, key in calls.calls
        if op in ("PutObject", "DeleteObject", "DeleteObjects")
        and key.startswith(prefix)
        and key != prefix  # SeaweedFS also gets the emptied "directory" deleted
    ]
    assert writes[0] == ("PutObject", "manifest.json")  # the tombstone, replacing it
    deleted = [key for op, key in writes[1:] if op != "PutObject"]
    assert len(deleted) == removed
    assert deleted[0] == "metadata.json"
    assert deleted[-2:] == [".cloudckpt-claim.json", "manifest.json"]


def test_interrupted_removal_leaves_an_uncommitted_checkpoint(s3_run: StoreLocation) -> None:
    """A delete refused half way (S3 access denied, injected by a botocore hook): the
    remains are refused by load, listed as uncommitted, and a second removal finishes."""
    parent, options = s3_run
    uri = f"{parent}/iter_0000002"
    storage = CheckpointStorage(uri, storage_options=options)
    blocked = "w/0.0"

    with pytest.raises(StorageError, match=blocked):
        remove_checkpoint(uri, storage_options=_failing_delete(options, blocked))

    assert storage.exists(blocked) and storage.exists(".cloudckpt-claim.json")
    assert not storage.exists("metadata.json")
    assert storage.read("manifest.json").startswith(b'{"cloudckpt_removal"')  # the tombstone
    with pytest.raises(UncommittedCheckpointError, match=r"metadata\.json"):
        cloudckpt.load(_state(0), uri, storage_options=options)
    assert latest(parent, storage_options=options) == f"{parent}/iter_0000001"
    info = [i for i in list_checkpoints(parent, storage_options=options) if i.uri == uri]
    assert len(info) == 1 and not info[0].committed and info[0].removing
    assert remove_checkpoint(uri, storage_options=options) >= 2
    assert _objects(uri, options) == {}


def _failing_delete(options: dict[str, Any], relpath: str) -> dict[str, Any]:
    calls = S3Calls()
    failing = calls.options(options)

    def refuse(params: dict[str, Any], model: Any, **_: Any) -> None:
        keys = [o["Key"] for o in params.get("Delete", {}).get("Objects", [])]
        if any(k.endswith("/" + relpath) for k in [*keys, str(params.get("Key"))]):
            raise PermissionError(f"injected: access denied to {relpath}")

    failing["session"].register("before-parameter-build.s3.DeleteObjects", refuse)
    failing["session"].register("before-parameter-build.s3.DeleteObject", refuse)
    return failing


def test_collect_garbage(run: StoreLocation) -> None:
    parent, options = run
    uri = {i: f"{parent}/iter_{i:07d}" for i in (1, 2, 3)}
    with pytest.raises(ValueError, match="keep_last"):
        collect_garbage(parent, 0, storage_options=options)

    # a large grace: the young uncommitted checkpoint may be a save still running
    young = collect_garbage(parent, 1, grace_s=1e6, storage_options=options)
    assert [(a.uri, a.reason) for a in young.actions] == [(uri[1], "older than the newest 1")]
    assert young.kept == (uri[2], uri[3]) and not young.dry_run
    assert _objects(uri[1], options) == {}

    everything = _objects(parent, options)
    dry = collect_garbage(parent, 1, grace_s=0, dry_run=True, storage_options=options)
    assert dry.dry_run and dry.kept == (uri[2],)
    assert [(a.uri, a.reason) for a in dry.actions] == [(uri[3], "uncommitted")]
    assert _objects(parent, options) == everything

    done = collect_garbage(parent, 1, grace_s=0, storage_options=options)
    assert [(a.uri, a.reason) for a in done.actions] == [(a.uri, a.reason) for a in dry.actions]
    assert done.kept == dry.kept
    assert [i.uri for i in list_checkpoints(parent, storage_options=options)] == [uri[2]]
    assert _objects(uri[3], options) == {}
    assert STRAY in _objects(parent, options)  # not a checkpoint: never touched
    assert verify(uri[2], deep=True, storage_options=options).ok
    assert done.to_dict()["actions"][0]["reason"] == "uncommitted"


def test_collect_garbage_aborts_stale_uploads(s3_run: StoreLocation, s3_server: S3Endpoint) -> None:
    parent, options = s3_run
    client = s3_server.boto3_client()
    bucket, prefix = parent.removeprefix("s3://").split("/", 1)
    for key in ("iter_0000002/w/0.1", "tensorboard/big.bin", "iter_0000003/w/0.1"):
        client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{key}")
    # under a committed checkpoint no save can be writing: aborted whatever its age
    committed_upload = (
        f"{parent}/iter_0000002/w/0.1",
        "multipart upload under a committed checkpoint",
    )
    stale_uploads = [committed_upload, (f"{parent}/tensorboard/big.bin", "stale multipart upload")]

    # MinIO and S3 list an upload's real start; moto lists 2010-11-10 for every upload.
    # The young uncommitted checkpoint's upload is its save's: spared either way.
    patient = collect_garbage(parent, 2, grace_s=1e6, dry_run=True, storage_options=options)
    real_dates = all(time.time() - u[1].timestamp() < 3600 for u in _uploads(client, bucket))
    expected_patient = [committed_upload] if real_dates else stale_uploads
    assert [(a.uri, a.reason) for a in patient.actions] == expected_patient

    dry = collect_garbage(parent, 2, grace_s=0, dry_run=True, storage_options=options)
    expected = [(f"{parent}/iter_0000003", "uncommitted"), *stale_uploads]
    assert [(a.uri, a.reason) for a in dry.actions] == expected
    assert len(_uploads(client, bucket)) == 3

    done = collect_garbage(parent, 2, grace_s=0, storage_options=options)
    assert [(a.uri, a.reason) for a in done.actions] == expected
    assert _uploads(client, bucket) == []  # iter_0000003's went with it
    assert [i.name for i in list_checkpoints(parent, storage_options=options)] == [
        "iter_0000001",
        "iter_0000002",
    ]


def _uploads(client: Any, bucket: str) -> list[tuple[str, datetime.datetime]]:
    page = client.list_multipart_uploads(Bucket=bucket)
    return [(u["Key"], u["Initiated"]) for u in page.get("Uploads", [])]


def test_every_backend(checkpoint_uri: StoreLocation) -> None:
    """list, latest, remove and gc on local, memory://, the S3 API and the GCS emulator."""
    uri, options = checkpoint_uri
    parent = uri.rsplit("/", 1)[0]
    first, second = _save(parent, options, 1), _save(parent, options, 2)
    infos = list_checkpoints(parent, storage_options=options)
    assert [(i.name, i.committed, i.size) for i in infos] == [
        ("iter_0000001", True, _data_size(first, options)),
        ("iter_0000002", True, _data_size(second, options)),
    ]
    assert latest(parent, storage_options=options) == second
    report = collect_garbage(parent, 1, grace_s=0, storage_options=options)
    assert [(a.uri, a.reason) for a in report.actions] == [(first, "older than the newest 1")]
    assert _objects(first, options) == {}
    assert [i.uri for i in list_checkpoints(parent, storage_options=options)] == [second]
    stored = len(_objects(second, options))
    assert remove_checkpoint(second, storage_options=options) == stored == 6
    assert list_checkpoints(parent, storage_options=options) == []
    assert latest(parent, storage_options=options) is None


def _save_in_another_process(uri: str, options: dict) -> None:
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    cloudckpt.save(state, uri, storage_options=options, sharded_strategy=ZARR)


def test_latest_sees_checkpoints_committed_by_other_processes(s3_bucket) -> None:
    """No listing cache: a poller in one process sees another job's new checkpoint."""
    import multiprocessing as mp  # noqa: PLC0415

    bucket_uri, options = s3_bucket
    shared = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    parent = f"{bucket_uri}/poll"
    ctx = mp.get_context("spawn")
    for step in (1, 2):
        job = ctx.Process(
            target=_save_in_another_process, args=(f"{parent}/iter_{step:07d}", shared)
        )
        job.start()
        job.join(timeout=120)
        assert job.exitcode == 0
        assert latest(parent, storage_options=shared) == f"{parent}/iter_{step:07d}"
