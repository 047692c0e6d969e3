"""End to end against real object-store servers: multi-rank save and resharded load on
s3:// and gs://, partial reads, configuration from the environment, the precedence of
storage options, and secrets kept out of errors and logs.

S3 cases run against the S3 API (moto) on a loopback port (MinIO or another endpoint
when ``CLOUDCKPT_TEST_S3_ENDPOINT`` is set); GCS cases against gcp-storage-emulator.
Nothing is mocked in-process: what the client sent is observed through botocore's
event hooks, what the server stored through boto3 or a fresh :class:`CheckpointStorage`.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import traceback
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.config import S3_MIN_PART_SIZE, CheckpointConfig, env_storage_options
from cloudckpt.errors import CheckpointingException
from cloudckpt.launch import RankPool
from cloudckpt.storage import CheckpointStorage
from cloudckpt.strategies.common import TorchCommonLoadStrategy
from cloudckpt.strategies.zarr import ZarrLoadShardedStrategy
from tests.fixtures_object_stores import (
    S3_CASES,
    STORE_CASES,
    GCSEndpoint,
    S3Endpoint,
    StoreLocation,
    bucket_location,
    server_for,
)

MiB = 2**20
CHUNK_SIZE = 3 * MiB
CKPT_PATH = "run/iter_0000100"


ZARR = ("zarr", 1)  # these tests look at the zarr layout (chunk objects)


def _config() -> CheckpointConfig:
    return CheckpointConfig(part_size=S3_MIN_PART_SIZE, max_in_flight=4, chunk_size=CHUNK_SIZE)


def reference(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of tensor ``key``: deterministic, distinct per key, float32."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator)


def _load(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``cloudckpt.load`` with a non-RETURN_* strict mode: the state dict alone."""
    result = cloudckpt.load(*args, **kwargs)
    assert isinstance(result, dict)
    return result


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads and signed zeros included)."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
    )


# --- 1. four ranks, TP=2 x DP=2, saved to s3:// and gs://, loaded in other layouts ----------

# float32 tensors; TP=2 splits each into two shards, replicated over DP=2.
W_COL = ((1536, 2048), 0)  # 12 MiB; shards (768, 2048) = 6 MiB -> chunks (384, 2048) = 3 MiB
W_ROW = ((2048, 1024), 1)  # 8 MiB; shards (2048, 512) = 4 MiB -> chunks (1024, 512) = 2 MiB
EXP_AVG = (1024, 2048)  # 8 MiB; TP shards (512, 2048) = 4 MiB -> chunks (256, 2048) = 2 MiB
SAVE_FLAT_BOUNDS = [0, 123_457, 512 * 2048]  # uneven flat ranges of a TP shard over DP
LOAD_FLAT_BOUNDS = [0, 5, 1_000_003, 1_500_000, 1024 * 2048]  # whole tensor, over 4 ranks
OBJECT_PAYLOAD = 6 * MiB // 4  # float32 elements in rank 1's ShardedObject: > part_size
COMMON = {"iteration": 100, "args": {"lr": 3e-4, "name": "e2e"}, "consumed_samples": 12_800}

EXPECTED_TENSOR_OBJECTS = {
    "w_col": [".zarray", "0.0", "1.0", "2.0", "3.0"],
    "w_row": [".zarray", "0.0", "0.1", "1.0", "1.1"],
    "exp_avg": [".zarray", "0.0", "1.0", "2.0", "3.0"],
}
EXPECTED_CHUNKS = {"w_col": [384, 2048], "w_row": [1024, 512], "exp_avg": [256, 2048]}
EXPECTED_OBJECTS = {
    "metadata.json",
    "common.pt",
    *(f"{key}/{name}" for key, names in EXPECTED_TENSOR_OBJECTS.items() for name in names),
    *(f"rng_state/shard_{r}_4.pt" for r in range(4)),
}
# What a later commit protocol may add next to these (see DESIGN.md).
ALLOWED_EXTRA_OBJECTS = {"manifest.json", ".cloudckpt-claim.json"}


def _rank_object(rank: int) -> dict[str, Any]:
    size = OBJECT_PAYLOAD if rank == 1 else 16
    generator = torch.Generator().manual_seed(1000 + rank)
    return {"rank": rank, "payload": torch.randn(size, generator=generator)}


def _tp(key: str, spec: tuple[tuple[int, ...], int], rank: int, tp: int) -> ShardedTensor:
    """``rank``'s TP shard of ``key``, replicated over DP (only DP rank 0 is main)."""
    shape, axis = spec
    tp_rank, dp_rank = rank % tp, rank // tp
    local = reference(key, shape).chunk(tp, dim=axis)[tp_rank].clone()
    return ShardedTensor.from_rank_offsets(key, local, (axis, tp_rank, tp), replica_id=dp_rank)


def _save_state(rank: int) -> dict[str, Any]:
    """TP=2 x DP=2: rank = dp_rank * 2 + tp_rank."""
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_shard = reference("exp_avg", EXP_AVG).chunk(2, dim=0)[tp_rank]
    flat = slice(SAVE_FLAT_BOUNDS[dp_rank], SAVE_FLAT_BOUNDS[dp_rank + 1])
    return {
        "w_col": _tp("w_col", W_COL, rank, 2),
        "w_row": _tp("w_row", W_ROW, rank, 2),
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets_flat(
                "exp_avg",
                tp_shard.reshape(-1)[flat].clone(),
                tuple(tp_shard.shape),
                (0, tp_rank, 2),
                flattened_range=flat,
            )
        },
        "rng": ShardedObject("rng_state", _rank_object(rank), (4,), (rank,)),
        **COMMON,
    }


def _load_request(rank: int) -> dict[str, Any]:
    """TP=4 along axis 0 for w_col, the whole of w_row on every rank, other flat ranges,
    and the ShardedObject of the next rank."""
    flat = slice(LOAD_FLAT_BOUNDS[rank], LOAD_FLAT_BOUNDS[rank + 1])
    peer = (rank + 1) % 4
    return {
        "w_col": ShardedTensor.from_rank_offsets(
            "w_col", torch.empty(W_COL[0][0] // 4, W_COL[0][1]), (0, rank, 4)
        ),
        "w_row": ShardedTensor.from_rank_offsets("w_row", torch.empty(W_ROW[0]), replica_id=rank),
        "optimizer": {
            "exp_avg": ShardedTensor.from_rank_offsets_flat(
                "exp_avg", torch.empty(flat.stop - flat.start), EXP_AVG, flattened_range=flat
            )
        },
        "rng": ShardedObject("rng_state", None, (4,), (peer,)),
    }


def _object_equal(loaded: Any, expected: dict[str, Any]) -> bool:
    return (
        isinstance(loaded, dict)
        and loaded.keys() == expected.keys()
        and loaded["rank"] == expected["rank"]
        and bit_equal(loaded["payload"], expected["payload"])
    )


def _e2e_scenario(rank: int, world: int, uri: str, options: dict[str, Any]) -> dict[str, bool]:
    assert world == 4
    cloudckpt.save(
        _save_state(rank), uri, storage_options=options, config=_config(), sharded_strategy=ZARR
    )
    loaded = _load(_load_request(rank), uri, storage_options=options, config=_config())
    flat = slice(LOAD_FLAT_BOUNDS[rank], LOAD_FLAT_BOUNDS[rank + 1])
    checks = {
        "w_col tp=4": bit_equal(loaded["w_col"], reference("w_col", W_COL[0]).chunk(4)[rank]),
        "w_row whole": bit_equal(loaded["w_row"], reference("w_row", W_ROW[0])),
        "exp_avg flat": bit_equal(
            loaded["optimizer"]["exp_avg"], reference("exp_avg", EXP_AVG).reshape(-1)[flat]
        ),
        "rng peer": _object_equal(loaded["rng"], _rank_object((rank + 1) % 4)),
        "common": all(loaded.get(k) == v for k, v in COMMON.items()),
    }
    # 2 x 2 tiles of w_col: each tile spans two stored chunks along axis 0 and half of
    # their columns (reads that are not contiguous in the stored bytes).
    row, col = divmod(rank, 2)
    tile = ShardedTensor.from_rank_offsets(
        "w_col", torch.empty(768, 1024), (0, row, 2), (1, col, 2)
    )
    tiles = _load({"tile": tile}, uri, storage_options=options, config=_config())
    expected_tile = reference("w_col", W_COL[0])[
        768 * row : 768 * (row + 1), 1024 * col : 1024 * (col + 1)
    ]
    checks["w_col 2x2 tile"] = bit_equal(tiles["tile"], expected_tile)
    return checks


@pytest.fixture(params=STORE_CASES)
def store(request: pytest.FixtureRequest) -> Iterator[tuple[str, StoreLocation]]:
    """``(case, (checkpoint uri, storage_options))`` in a fresh bucket of every S3 and
    GCS server."""
    bucket_uri, options = bucket_location(request, request.param)
    yield request.param, (f"{bucket_uri}/{CKPT_PATH}", options)


def _s3_objects(s3_server: S3Endpoint, uri: str) -> dict[str, dict[str, Any]]:
    """``{relative path: list_objects_v2 entry}`` of every object below ``uri``."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = s3_server.boto3_client()
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for entry in page.get("Contents", []):
            objects[entry["Key"].removeprefix(prefix + "/")] = entry
    client.close()
    return objects


def test_four_ranks_save_to_object_store_and_load_resharded_bit_exact(
    rank_pool: RankPool, store: tuple[str, StoreLocation], request: pytest.FixtureRequest
) -> None:
    """4 ranks (TP=2 x DP=2) save to the S3 API (moto) or the GCS emulator with 5 MiB
    parts and 3 MiB chunks; they load back as TP=4, whole tensors, other flat ranges,
    2-D tiles and a peer's ShardedObject, bit for bit."""
    case, (uri, options) = store
    results = rank_pool.run(_e2e_scenario, uri, options)
    names = ["w_col tp=4", "w_row whole", "exp_avg flat", "rng peer", "common", "w_col 2x2 tile"]
    assert results == [dict.fromkeys(names, True)] * 4

    storage = CheckpointStorage(uri, storage_options=options)
    listed = set(storage.list())
    assert listed >= EXPECTED_OBJECTS, sorted(EXPECTED_OBJECTS - listed)
    assert listed - EXPECTED_OBJECTS <= ALLOWED_EXTRA_OBJECTS, sorted(listed - EXPECTED_OBJECTS)
    for key, names_under_key in EXPECTED_TENSOR_OBJECTS.items():
        assert [p.removeprefix(key + "/") for p in storage.list(key)] == names_under_key
        assert json.loads(storage.read(f"{key}/.zarray"))["chunks"] == EXPECTED_CHUNKS[key]
    assert json.loads(storage.read("metadata.json")) == {
        "sharded_backend": "zarr",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    if case not in S3_CASES:
        return
    server = server_for(request, case)
    assert isinstance(server, S3Endpoint)
    objects = _s3_objects(server, uri)
    assert objects.keys() >= EXPECTED_OBJECTS
    for name in EXPECTED_TENSOR_OBJECTS["w_col"][1:]:  # 6 MiB shards as two 3 MiB chunks
        assert objects[f"w_col/{name}"]["Size"] == 3 * MiB
    assert objects["exp_avg/0.0"]["Size"] == 2 * MiB
    # chunk_size (3 MiB) < part_size (5 MiB): no zarr chunk is a multipart upload; rank 1's
    # ShardedObject (> 6 MiB) is, in two parts.
    big = objects["rng_state/shard_1_4.pt"]
    assert big["Size"] > 6 * MiB and big["ETag"].strip('"').endswith("-2"), big
    assert not objects["w_col/0.0"]["ETag"].strip('"').count("-")


# --- 2. a partial load reads only the bytes it needs -------------------------------------------


def test_partial_load_from_s3_reads_a_fraction_of_the_checkpoint(
    s3_server: S3Endpoint, s3_bucket: StoreLocation
) -> None:
    """S3 API (moto): loading a quarter of one of two 8 MiB tensors fetches ranges only."""
    bucket_uri, options = s3_bucket
    uri = f"{bucket_uri}/{CKPT_PATH}"
    tensors = {key: reference(key, (2048, 1024)) for key in ("emb", "head")}
    cloudckpt.save(
        {key: ShardedTensor.from_rank_offsets(key, t) for key, t in tensors.items()},
        uri,
        storage_options=options,
        sharded_strategy=ZARR,
    )
    total = sum(entry["Size"] for entry in _s3_objects(s3_server, uri).values())
    assert total > 16 * MiB

    fs = CheckpointStorage(uri, storage_options=options).fs
    fs.connect()
    received = {"bytes": 0, "gets": 0}
    lock = threading.Lock()

    def after_call(parsed: Any, model: Any, **_: Any) -> None:
        if model.name == "GetObject":
            with lock:
                received["bytes"] += int(parsed.get("ContentLength", 0))
                received["gets"] += 1

    fs.s3.meta.events.register("after-call.s3", after_call)
    quarter = ShardedTensor.from_rank_offsets("head", torch.empty(512, 1024), (0, 2, 4))
    loaded = _load(
        {"quarter": quarter},
        uri,
        sharded_strategy=ZarrLoadShardedStrategy(fs=fs),
        common_strategy=TorchCommonLoadStrategy(fs=fs),
        validate_access_integrity=False,  # one rank asks for a quarter, on purpose
    )
    assert bit_equal(loaded["quarter"], tensors["head"][1024:1536])
    slice_bytes = 512 * 1024 * 4
    assert received["gets"] >= 1
    assert slice_bytes <= received["bytes"] < 0.3 * total, (received, total)


# --- 3. configuration from the environment only ------------------------------------------------


def _small_state() -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", reference("w", (64, 32))),
        "obj": ShardedObject("obj", {"seed": 7}, (1,), (0,)),
        "iteration": 1,
    }


def _small_request() -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(32, 32), (0, 1, 2)),
        "obj": ShardedObject("obj", None, (1,), (0,)),
    }


def _check_small(loaded: dict[str, Any]) -> None:
    assert bit_equal(loaded["w"], reference("w", (64, 32))[32:])
    assert loaded["obj"] == {"seed": 7}
    assert loaded["iteration"] == 1


def test_s3_from_environment_only(
    s3_server: S3Endpoint, s3_bucket: StoreLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 API (moto) found through AWS_ENDPOINT_URL_S3 and botocore's credential chain."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    uri = f"{s3_bucket[0]}/run/iter_1"
    cloudckpt.save(_small_state(), uri, sharded_strategy=ZARR)
    _check_small(_load(_small_request(), uri, validate_access_integrity=False))
    assert cloudckpt.load_common_state_dict(uri) == {"iteration": 1}
    assert "metadata.json" in _s3_objects(s3_server, uri)


def test_gcs_from_environment_only(
    gcs_server: GCSEndpoint, gcs_bucket: StoreLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GCS emulator found through STORAGE_EMULATOR_HOST alone (no project, no token)."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url)
    assert env_storage_options("gs") == {"endpoint_url": gcs_server.endpoint_url, "token": "anon"}
    uri = f"{gcs_bucket[0]}/run/iter_1"
    cloudckpt.save(_small_state(), uri, sharded_strategy=ZARR)
    _check_small(_load(_small_request(), uri, validate_access_integrity=False))
    stored = CheckpointStorage(uri, storage_options=gcs_bucket[1]).list()
    assert {"metadata.json", "common.pt", "w/.zarray", "w/0.0", "obj/shard_0_1.pt"} <= set(stored)


# --- 4. precedence: explicit > config > environment --------------------------------------------


def _dead_endpoint() -> str:
    """An http endpoint on a loopback port nobody listens on (it was free a moment ago)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _fast_fail() -> dict[str, Any]:
    """botocore settings for a quick failure (a fresh dict: botocore rewrites ``retries``
    in place when it builds a client)."""
    return {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}


def test_explicit_options_beat_config_which_beats_environment(
    s3_server: S3Endpoint, s3_bucket: StoreLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 API (moto): whichever source has the highest precedence picks the endpoint."""
    bucket_uri, options = s3_bucket
    dead = _dead_endpoint()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", dead)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    dead_config = CheckpointConfig(storage_options={**options, "endpoint_url": dead})

    # explicit (live) > config (dead) > environment (dead)
    uri = f"{bucket_uri}/explicit"
    cloudckpt.save(
        _small_state(), uri, storage_options=options, config=dead_config, sharded_strategy=ZARR
    )
    _check_small(
        _load(_small_request(), uri, validate_access_integrity=False, storage_options=options)
    )

    # config (live) > environment (dead)
    uri = f"{bucket_uri}/config"
    cloudckpt.save(
        _small_state(),
        uri,
        config=CheckpointConfig(storage_options=options),
        sharded_strategy=ZARR,
    )
    assert {"metadata.json", "w/0.0"} <= _s3_objects(s3_server, uri).keys()

    # the reverse: explicit (dead) > config (live) > environment (live)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    uri = f"{bucket_uri}/reverse"
    with pytest.raises(CheckpointingException) as info:
        cloudckpt.save(
            _small_state(),
            uri,
            storage_options={"endpoint_url": dead, "config_kwargs": _fast_fail()},
            config=CheckpointConfig(storage_options=options),
            sharded_strategy=ZARR,
        )
    assert "127.0.0.1:" + dead.rsplit(":", 1)[1] in str(info.value), str(info.value)
    assert _s3_objects(s3_server, uri) == {}


# --- 5. secrets never reach errors or logs ---------------------------------------------------

PROBE_KEY = "AKIDSECRETPROBE1"
PROBE_SECRET = "very-secret-value-123"


def _exception_texts(exc: BaseException) -> list[str]:
    """str and repr of ``exc`` and of every exception it chains to."""
    texts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current)]
        current = current.__cause__ or current.__context__
    return texts


def test_secrets_never_appear_in_errors_or_logs(
    s3_server: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    """S3 API (moto): a failing save into a missing bucket, logged at DEBUG everywhere."""
    caplog.set_level(logging.DEBUG)
    options = {
        "endpoint_url": s3_server.endpoint_url,
        "key": PROBE_KEY,
        "secret": PROBE_SECRET,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": _fast_fail(),
        "skip_instance_cache": True,
    }
    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}/x"
    with pytest.raises(CheckpointingException) as info:
        cloudckpt.save(_small_state(), uri, storage_options=options, sharded_strategy=ZARR)
    texts = _exception_texts(info.value)
    assert "no-such-bucket" in texts[0]
    for text in texts:
        assert PROBE_SECRET not in text and PROBE_KEY not in text, text
    assert "".join(traceback.format_exception_only(info.value)).count(PROBE_SECRET) == 0

    assert caplog.records, "DEBUG logging captured nothing"
    for record in caplog.records:
        message = record.getMessage()
        assert PROBE_SECRET not in message, (record.name, message)
        # botocore's DEBUG logs print the signed request headers, whose Authorization
        # header names the access key id in its Credential scope (the secret is never
        # sent). The key id is an identifier, not a secret; cloudckpt itself must not
        # log it, but third-party libraries are allowed to.
        if record.name.startswith("cloudckpt"):
            assert PROBE_KEY not in message, (record.name, message)


def test_reprs_redact_secrets() -> None:
    options = {
        "key": PROBE_KEY,
        "secret": PROBE_SECRET,
        "endpoint_url": "http://user:pw123@127.0.0.1:9/path",
        "client_kwargs": {"aws_session_token": "session-token-xyz"},
    }
    config = CheckpointConfig(uri="s3://user:pw123@bucket/run", storage_options=options)
    text = repr(config)
    for secret in (PROBE_KEY, PROBE_SECRET, "pw123", "session-token-xyz"):
        assert secret not in text, text
    assert "user:***@127.0.0.1:9/path" in text and "'***'" in text

    storage = CheckpointStorage("http://user:pw123@example.invalid/path/ckpt")
    assert "pw123" not in repr(storage) and "user:***@example.invalid" in repr(storage)
    s3_storage = CheckpointStorage("s3://bucket/run", storage_options=options)
    assert repr(s3_storage) == "CheckpointStorage('s3://bucket/run')"
    assert PROBE_SECRET not in repr(s3_storage.config)
