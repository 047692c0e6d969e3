"""What the real servers add over the mocks, and the markers that select them.

* ``cloudckpt rm`` then ``cloudckpt verify`` says "no checkpoint" on every store,
  SeaweedFS included (it keeps empty "directories" after their objects are deleted).
* A part corrupted in flight: SeaweedFS checks the CRC-32C cloudckpt sends with every
  part and refuses it (400 BadDigest), the save fails naming the part and nothing is
  committed; on a store that does not check (moto) the manifest's CRC-32C catches it
  (``verify --deep`` and ``load`` refuse the object).
* ``-m s3`` / ``-m gcs`` / ``-m multirank`` select exactly the tests that use an S3
  server / a GCS server / several ranks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
import cloudckpt.storage.s3
from cloudckpt import ShardedTensor
from cloudckpt.checker import verify
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptObjectError,
    StorageError,
)
from cloudckpt.storage import CheckpointStorage
from tests.fixtures_object_stores import (
    GS_CASES,
    S3_CASES,
    STORE_CASES,
    GCSEndpoint,
    S3Endpoint,
    bucket_location,
    server_for,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
MiB = 2**20


def _state(iteration: int) -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4) + iteration),
        "iteration": iteration,
    }


def _cli_env(server: S3Endpoint | GCSEndpoint) -> dict[str, str]:
    """The environment that points the ``cloudckpt`` command at ``server``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "STORAGE_EMULATOR"))}
    if isinstance(server, S3Endpoint):
        return {
            **env,
            "AWS_ENDPOINT_URL_S3": server.endpoint_url,
            "AWS_ACCESS_KEY_ID": server.key,
            "AWS_SECRET_ACCESS_KEY": server.secret,
            "AWS_DEFAULT_REGION": server.region,
        }
    return {**env, "STORAGE_EMULATOR_HOST": server.endpoint_url}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloudckpt", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env=env,
        stdin=subprocess.DEVNULL,
    )


# -- rm, then verify ---------------------------------------------------------------------


@pytest.mark.parametrize("case", STORE_CASES)
def test_rm_then_verify_says_no_checkpoint(case: str, request: pytest.FixtureRequest) -> None:
    """After ``cloudckpt rm`` nothing is listed under the checkpoint, on every store:
    ``verify`` says "no checkpoint" (not "INCONSISTENT: not committed", which SeaweedFS's
    left-over empty directory once produced) and ``ls`` shows the other checkpoint only."""
    bucket_uri, options = bucket_location(request, case)
    env = _cli_env(server_for(request, case))
    run = f"{bucket_uri}/run"
    for iteration in (1, 2):
        cloudckpt.save(_state(iteration), f"{run}/iter_{iteration:07d}", storage_options=options)
    gone = f"{run}/iter_0000001"

    removed = _cli("rm", gone, "--yes", env=env)
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert re.fullmatch(rf"removed \d+ objects from {re.escape(gone)}", removed.stdout.strip())
    storage = CheckpointStorage(gone, storage_options=options)
    assert storage.list() == [] and storage.list_sizes() == {} and storage.is_empty()

    verified = _cli("verify", gone, env=env)
    assert verified.returncode == 2, verified.stdout + verified.stderr
    # "nothing is stored there", not "objects but no metadata.json" (a left-over prefix)
    assert re.search(rf"no checkpoint at '?{re.escape(gone)}'?: nothing is stored", verified.stderr)
    assert "INCONSISTENT" not in verified.stdout + verified.stderr

    kept = _cli("verify", f"{run}/iter_0000002", "--deep", env=env)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    listed = _cli("ls", run, env=env)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "iter_0000002" in listed.stdout and "iter_0000001" not in listed.stdout
    with pytest.raises(CheckpointNotFoundError):
        cloudckpt.load(_state(0), gone, storage_options=options)


# -- a part corrupted in flight ------------------------------------------------------------

CORRUPT_OFFSET = 12345  # the byte of every full part flipped after its CRC-32C was computed


class _CorruptingPayload(cloudckpt.storage.s3._ViewPayload):
    """A request body (sent from memory, after botocore signed the request: payloads to
    loopback are unsigned, their CRC-32C header signed) with one byte of a full part
    flipped on its way out, after cloudckpt computed the part's CRC-32C: only that
    checksum can tell. Every attempt is corrupted alike."""

    part_size = 5 * MiB

    def __init__(self, pieces: list[memoryview]) -> None:
        if sum(piece.nbytes for piece in pieces) == self.part_size:
            damaged = bytearray(b"".join(pieces))
            damaged[CORRUPT_OFFSET] ^= 0xFF
            pieces = [memoryview(damaged)]
        super().__init__(pieces)


@pytest.mark.parametrize("case", S3_CASES)
def test_a_part_corrupted_in_flight_is_never_committed_unnoticed(
    case: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = server_for(request, case)
    assert isinstance(server, S3Endpoint)
    if server.kind in ("moto", "seaweedfs"):  # what the fixture's probe found, as expected
        assert server.checks_crc32c is (server.kind == "seaweedfs")
    bucket_uri, options = bucket_location(request, case)
    uri = f"{bucket_uri}/run/iter_0000001"
    weight = torch.randn(3 * MiB, generator=torch.Generator().manual_seed(0))  # 12 MiB
    state = {"w": ShardedTensor.from_rank_offsets("w", weight), "iteration": 1}
    config = CheckpointConfig(part_size=5 * MiB, chunk_size=None, backend="zarr")  # w/0: one object
    monkeypatch.setattr(cloudckpt.storage.s3, "_ViewPayload", _CorruptingPayload)

    if server.checks_crc32c:
        with pytest.raises(CheckpointingException) as info:
            cloudckpt.save(state, uri, storage_options=options, config=config)
        message = str(info.value)
        chain = [info.value, *_causes(info.value)]
        assert any(isinstance(e, StorageError) for e in chain), chain
        assert re.search(r"failed to upload part \d \(bytes \d+-\d+\) of s3://\S+/w/0", message)
        assert "BadDigest" in message, message
        monkeypatch.undo()
        storage = CheckpointStorage(uri, storage_options=options)
        assert storage.open_uploads() == []  # the failed upload was aborted
        assert "w/0" not in storage.list()
        report = verify(uri, storage_options=options)
        assert not report.ok
        with pytest.raises(CheckpointingException, match=r"not committed|no checkpoint"):
            cloudckpt.load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.empty(3 * MiB))},
                uri,
                storage_options=options,
            )
        return

    # The store kept the corrupt part: the commit went through, but the manifest holds
    # the CRC-32C of the bytes in memory, so a deep verify and every load refuse them.
    cloudckpt.save(state, uri, storage_options=options, config=config)
    monkeypatch.undo()
    report = verify(uri, deep=True, storage_options=options)
    assert [(p.kind, p.path) for p in report.problems] == [("checksum-mismatch", "w/0")], (
        report.problems
    )
    # the load reads w/0 whole into the tensor, and checks it block by block
    with pytest.raises(CorruptObjectError, match=r"w/0: bytes 0-\d+ \(block 0 of 12.*CRC-32C"):
        cloudckpt.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(3 * MiB))},
            uri,
            storage_options=options,
        )


def _causes(exc: BaseException) -> list[BaseException]:
    found = []
    while exc.__cause__ is not None:
        exc = exc.__cause__
        found.append(exc)
    return found


# -- markers --------------------------------------------------------------------------------

MARKER_MODULES = ("test_object_stores", "test_commit", "test_torch_dist")


def _collect(*selections: str) -> list[set[str]]:
    """The test ids ``pytest --collect-only -q [-m SELECTION]`` lists, for each selection
    ("" for none), collected in parallel subprocesses."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:randomly",
                "-p",
                "no:cacheprovider",
                *(["-m", selection] if selection else []),
                *(f"tests/{module}.py" for module in MARKER_MODULES),
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for selection in selections
    ]
    found = []
    for proc in procs:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, out
        found.append({line for line in out.splitlines() if "::" in line})
    return found


def test_markers_select_the_tests_of_each_server_kind() -> None:
    everything, s3, gcs, multirank = _collect("", "s3", "gcs", "multirank")

    def cases(test_id: str) -> set[str]:
        params = test_id.partition("[")[2].rstrip("]")
        return {case for case in STORE_CASES if case in params}

    assert s3 == {t for t in everything if cases(t) & set(S3_CASES)}
    assert gcs == {t for t in everything if cases(t) & set(GS_CASES)}
    stores, commit, torch_dist = (f"tests/{name}.py::" for name in MARKER_MODULES)
    for case in S3_CASES:
        assert f"{stores}test_s3_bucket_fixture_makes_a_fresh_bucket[{case}]" in s3
        assert f"{commit}test_exclusive_write_on_every_backend[{case}]" in s3
        assert f"{torch_dist}test_four_ranks_tp2_dp2_flattened_s3[{case}]" in s3 & multirank
    for case in GS_CASES:
        assert f"{stores}test_gcs_bucket_fixture_makes_a_fresh_bucket[{case}]" in gcs
    assert f"{commit}test_exclusive_write_on_every_backend[local]" not in s3 | gcs
    assert not s3 & gcs
    # multirank: the tests that use the rank pool, whatever their store
    assert f"{torch_dist}test_four_ranks_tp2_dp2_flattened_local" in multirank
    assert f"{commit}test_a_failure_before_the_first_collective_reaches_every_rank" in multirank
    assert not {t for t in multirank if t.startswith(stores)}
