"""Block CRCs: every byte a load returns is checked against a CRC-32C
the writer measured, ranged (resharded) loads included, at about the bytes read before.

* The CRC arithmetic and the manifest format (version 2, and version 1 still loading).
* The block CRCs a save records match an independent computation (the ``crc32c``
  library over the stored bytes, fetched with plain fsspec) on local disk, memory://,
  moto and SeaweedFS, multipart uploads included.
* A byte flipped on disk, or in transit by the fault proxy in front of SeaweedFS: a
  whole load and a resharded (partial) load raise ``CorruptObjectError`` naming the
  object, the byte range and the rank, for zarr and torch_dist; blocks a read does not
  need are never fetched, so a load of other rows still succeeds.
* Four ranks: TP2 saved, TP4 loaded through the proxy, clean and corrupted.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import crc32c as crc32c_lib
import fsspec
import pytest
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import CheckpointConfig
from cloudckpt.errors import CheckpointingException, CorruptObjectError, DistributedCheckpointError
from cloudckpt.manifest import MANIFEST_FNAME, Manifest, ManifestEntry, ManifestError
from cloudckpt.storage import CheckpointStorage, ReadRequest
from cloudckpt.storage.blocks import (
    BLOCK_SIZE,
    BlockCrcs,
    block_runs,
    block_size_for,
    combine,
    covering,
    inner,
    object_checksum,
)
from tests.faultproxy import FaultProxy
from tests.fixtures_object_stores import (
    S3_CASES,
    S3Endpoint,
    bucket_location,
    server_for,
)

MiB = 2**20
PART = 5 * MiB  # S3's smallest part: objects above it go up in parts
ROWS, COLS = 1600, 1000  # float32: 6.4 MB, a multipart upload of a 5 MiB and a 1.2 MB part
REAL_S3 = S3_CASES[-1]  # SeaweedFS (or the external endpoint)
BACKENDS = ["zarr", "torch_dist"]
DATA_OBJECT = {"zarr": "/w/0", "torch_dist": ".distcp"}  # what the proxy corrupts


FAST = {"max_attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.05}


def _weight() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4))


def _bias() -> torch.Tensor:
    return torch.arange(ROWS, dtype=torch.float32)


def _rows(first: int, count: int) -> dict[str, Any]:
    """A request for rows ``[first, first + count)`` of ``w`` (a resharded load)."""
    assert first % count == 0 and ROWS % count == 0
    local = torch.empty(count, COLS)
    return {"w": ShardedTensor.from_rank_offsets("w", local, (0, first // count, ROWS // count))}


def _save(uri: str, backend: str, options: dict[str, Any] | None = None) -> torch.Tensor:
    """``w`` (6.4 MB: a multipart upload on S3) and ``b``; torch_dist puts both in
    one object, so a load of ``w`` reads a range of it."""
    weight = _weight()
    state = {
        "w": ShardedTensor.from_rank_offsets("w", weight),
        "b": ShardedTensor.from_rank_offsets("b", _bias()),
        "step": 3,
    }
    cloudckpt.save(state, uri, sharded_strategy=(backend, 1), storage_options=options,
                   config=CheckpointConfig(part_size=PART))  # fmt: skip
    return weight


def _load_rows(
    uri: str, first: int, count: int, options: dict[str, Any] | None = None, **config: Any
) -> Any:
    loaded = cloudckpt.load(
        _rows(first, count),
        uri,
        validate_access_integrity=False,
        storage_options=options,
        config=CheckpointConfig(**config),
    )
    return loaded["w"]


# rows [first, first + count): whole; aligned and unaligned ranges with whole blocks
# inside; ranges within two partly needed blocks only; the object's end
CASES = [(0, ROWS), (800, 400), (400, 400), (640, 320), (1000, 200), (1200, 400)]


# -- the arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 1, 3, 4096, MiB - 1, MiB, 3 * MiB + 17])
def test_combine_matches_the_crc_of_the_concatenation(length: int) -> None:
    head, tail = os.urandom(1234), os.urandom(length)
    combined = combine(crc32c_lib.crc32c(head), crc32c_lib.crc32c(tail), length)
    assert combined == crc32c_lib.crc32c(head + tail)


def test_object_checksum_is_one_pass_over_blocks() -> None:
    data = os.urandom(3 * BLOCK_SIZE + 5)
    whole, blocks = object_checksum(data)
    assert whole == crc32c_lib.crc32c(data)
    assert blocks is not None and len(blocks) == 4 and blocks.block_size == BLOCK_SIZE
    for i in range(4):
        assert blocks.crc(i) == crc32c_lib.crc32c(data[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
    small = os.urandom(BLOCK_SIZE)
    assert object_checksum(small) == (crc32c_lib.crc32c(small), None)  # one block: no list
    assert BlockCrcs.from_base64(BLOCK_SIZE, blocks.to_base64()) == blocks


def test_block_geometry() -> None:
    assert block_size_for(PART) == MiB and block_size_for(64 * MiB) == MiB
    assert block_size_for(5 * 10**6) == 5 * 10**6  # gcd 64 bytes: whole parts instead
    assert covering(10, 20, 100, 8) == (8, 24) and covering(90, 100, 100, 8) == (88, 100)
    assert inner(10, 40, 100, 8) == (16, 40) and inner(10, 12, 100, 8) == (16, 8)
    assert inner(90, 100, 100, 8) == (96, 100)  # the object's last block is whole
    # overlapping spans merge; touching ones too; runs are cut at whole blocks of the limit
    assert block_runs([(0, 8), (8, 16), (40, 48), (4, 8)], 8, 12) == [(0, 8), (8, 16), (40, 48)]
    assert block_runs([(0, 32)], 8, 20) == [(0, 16), (16, 32)]


# -- the manifest ------------------------------------------------------------------------


def test_manifest_version_2_round_trips_and_version_1_still_parses() -> None:
    data = os.urandom(2 * MiB + 3)
    crc, blocks = object_checksum(data)
    manifest = Manifest(objects=(ManifestEntry("big", len(data), crc, blocks),
                                 ManifestEntry("small", 3, 7)))  # fmt: skip
    doc = json.loads(manifest.to_json())
    assert doc["version"] == 2
    assert doc["objects"] == [["big", len(data), crc, MiB, blocks.to_base64()], ["small", 3, 7]]
    assert Manifest.from_json(manifest.to_json()) == manifest
    v1 = dataclasses.replace(manifest, version=1)
    assert json.loads(v1.to_json())["objects"] == [["big", len(data), crc], ["small", 3, 7]]
    parsed = Manifest.from_json(v1.to_json())
    assert parsed.version == 1 and parsed.by_path()["big"].blocks is None


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        (["x", 10, 1, MiB], "4 fields"),
        (["x", 3 * MiB, 1, MiB, "AAAAAA=="], "do not cover"),  # 1 block CRC for 3 blocks
        (["x", 10, 1, MiB, "not base64!"], "malformed"),
        (["x", 10, 2**32], "out of range"),
    ],
)
def test_malformed_block_entries_are_rejected(entry: list[Any], error: str) -> None:
    doc = json.loads(Manifest(objects=()).to_json())
    doc["objects"] = [entry]
    with pytest.raises(ManifestError, match=error):
        Manifest.from_json(json.dumps(doc))
    doc["version"] = 1
    doc["objects"] = [["x", 3 * MiB, 1, MiB, "AAAAAA=="]]  # block CRCs are version 2
    with pytest.raises(ManifestError, match="5 fields"):
        Manifest.from_json(json.dumps(doc))


# -- what a save records: checked against an independent computation -------------------


@pytest.fixture(params=["local", "memory", *S3_CASES])
def location(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, dict]]:
    kind = request.param
    if kind == "local":
        yield str(tmp_path / "ckpt"), {}
    elif kind == "memory":
        yield f"memory://cloudckpt-blocks/{os.urandom(8).hex()}/ckpt", {}
    else:
        bucket_uri, options = bucket_location(request, kind)
        yield f"{bucket_uri}/run/ckpt", options


@pytest.mark.parametrize("backend", BACKENDS)
def test_recorded_block_crcs_match_the_stored_bytes(
    location: tuple[str, dict], backend: str
) -> None:
    uri, options = location
    weight = _save(uri, backend, options)
    storage = CheckpointStorage(uri, storage_options=options)
    manifest = Manifest.from_json(storage.read(MANIFEST_FNAME))
    assert manifest.version == 2
    fs, root = fsspec.core.url_to_fs(uri, **options)
    big = [e for e in manifest.objects if e.size > BLOCK_SIZE]
    assert big, manifest.objects  # the 6.4 MB tensor's object at least
    for entry in manifest.objects:
        raw = fs.cat_file(f"{root}/{entry.path}")  # plain fsspec, not cloudckpt's reads
        assert len(raw) == entry.size and crc32c_lib.crc32c(raw) == entry.crc32c, entry.path
        if entry.size <= BLOCK_SIZE:
            assert entry.blocks is None
            continue
        assert entry.blocks is not None and entry.blocks.block_size == BLOCK_SIZE
        expected = [
            crc32c_lib.crc32c(raw[i : i + BLOCK_SIZE]) for i in range(0, len(raw), BLOCK_SIZE)
        ]
        assert [entry.blocks.crc(i) for i in range(len(entry.blocks))] == expected, entry.path
    for first, count in CASES:
        assert torch.equal(_load_rows(uri, first, count, options), weight[first : first + count])


def test_every_ranged_read_is_checked_against_its_blocks(tmp_path: Any) -> None:
    """The storage layer: ranges inside one block, across blocks, at the end, and
    ``[0, size)``; a flipped byte fails every read that covers its block, only those."""
    data = bytearray(os.urandom(3 * BLOCK_SIZE + 100))
    writer = CheckpointStorage(str(tmp_path / "c"))
    entry = writer.write("obj", bytes(data))
    assert entry.blocks is not None and len(entry.blocks) == 4
    reader = writer.with_expected({"obj": entry})
    ranges = [(5, 10), (BLOCK_SIZE - 3, BLOCK_SIZE + 3), (3 * BLOCK_SIZE, len(data)),
              (0, len(data)), (BLOCK_SIZE, 3 * BLOCK_SIZE)]  # fmt: skip
    for start, end in ranges:
        assert reader.read("obj", start, end) == bytes(data[start:end])
    got = reader.read_many([ReadRequest("obj", a, b) for a, b in ranges])
    assert got == [bytes(data[a:b]) for a, b in ranges]
    buffers = [bytearray(b - a) for a, b in ranges]
    reader.read_into_many(
        [(ReadRequest("obj", a), buf) for (a, _), buf in zip(ranges, buffers, strict=True)]
    )
    assert [bytes(b) for b in buffers] == got
    flip = 2 * BLOCK_SIZE + 7  # in block 2
    data[flip] ^= 0x10
    (tmp_path / "c" / "obj").write_bytes(bytes(data))
    assert reader.read("obj", 5, 10) == bytes(data[5:10])  # block 0 only: fine
    for start, end in [(flip, flip + 1), (2 * BLOCK_SIZE - 1, 2 * BLOCK_SIZE + 1),
                       (0, len(data)), (BLOCK_SIZE, 3 * BLOCK_SIZE)]:  # fmt: skip
        with pytest.raises(CorruptObjectError) as info:
            reader.read("obj", start, end)
        message = str(info.value)
        for part in ("c/obj", f"bytes {2 * BLOCK_SIZE}-{3 * BLOCK_SIZE}", "block 2 of 4", "rank 0"):
            assert part in message or start == 0, (part, message)
        with pytest.raises(CorruptObjectError):
            reader.read_into_many([(ReadRequest("obj", start), bytearray(end - start))])
        with pytest.raises(CorruptObjectError):
            reader.read_many([ReadRequest("obj", start, end)])


# -- a byte flipped on disk: whole and partial loads ---------------------------------------


def _flip_in_object(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_byte_flipped_on_disk_fails_whole_and_partial_loads(tmp_path: Any, backend: str) -> None:
    uri = str(tmp_path / "ckpt")
    weight = _save(uri, backend)
    manifest = Manifest.from_json(CheckpointStorage(uri).read(MANIFEST_FNAME))
    data = max(manifest.objects, key=lambda e: e.size)  # the tensor's object
    row_bytes = COLS * 4
    # a byte of row 1300, in the object's block 4 or 5 (torch_dist has a header)
    _flip_in_object(str(tmp_path / "ckpt" / data.path), data.size - 300 * row_bytes)
    # rows 0-399 do not touch that block: they load, and are right (torch_dist reads
    # only their bytes of the stored item of ``w``, a range of the .distcp object)
    assert torch.equal(_load_rows(uri, 0, 400), weight[:400])
    for first, count in [(1200, 400), (800, 800), (0, ROWS)]:
        with pytest.raises(CorruptObjectError, match=rf"{data.path}.*(CRC-32C|rank 0)"):
            _load_rows(uri, first, count)


def test_a_version_1_manifest_still_loads(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    weight = _save(uri, "zarr")
    storage = CheckpointStorage(uri)
    manifest = Manifest.from_json(storage.read(MANIFEST_FNAME))
    v1 = dataclasses.replace(manifest, version=1).to_json()
    assert b'"version":1' in v1 and all(len(o) == 3 for o in json.loads(v1)["objects"])
    storage.write(MANIFEST_FNAME, v1)
    assert torch.equal(_load_rows(uri, 0, ROWS), weight)  # whole: the object CRC
    assert torch.equal(_load_rows(uri, 800, 400), weight[800:1200])  # ranged: sizes
    assert cloudckpt.load_common_state_dict(uri) == {"step": 3}


# -- a byte flipped in transit: the fault proxy in front of SeaweedFS ---------------------


@pytest.fixture(params=[REAL_S3])
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[FaultProxy, str, dict]]:
    server = server_for(request, request.param)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, request.param)
    with FaultProxy(server.endpoint_url, seed=4) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
        yield proxy, bucket_uri, options


def test_corrupt_rule_flips_the_byte_at_an_offset(proxied: tuple[FaultProxy, str, dict]) -> None:
    proxy, bucket_uri, options = proxied
    storage = CheckpointStorage(f"{bucket_uri}/raw", storage_options=options)
    payload = bytes(range(256)) * 16
    storage.write("k", payload)
    for offset, flipped in [(0, 0), (100, 100), (None, 2048), (10**9, 4095)]:
        proxy.corrupt(1.0, offset=offset)
        got = storage.read("k", 0, len(payload))  # a range of an unlisted object: unchecked
        assert [i for i in range(len(payload)) if got[i] != payload[i]] == [flipped]
    proxy.clear()


def test_the_stores_crc32c_is_compared_only_when_it_is_a_crc_of_the_bytes() -> None:
    from cloudckpt.storage.s3 import check_store_crc32c  # noqa: PLC0415 - needs s3fs
    from cloudckpt.storage.transport import StoreChecksumError  # noqa: PLC0415

    data = os.urandom(100)
    good = base64.b64encode(crc32c_lib.crc32c(data).to_bytes(4, "big")).decode()
    check_store_crc32c(good, data)
    check_store_crc32c(None, data)  # the store returned none
    check_store_crc32c("AAAAAA==-3", data)  # composite: a checksum of part checksums
    with pytest.raises(StoreChecksumError, match="damaged in transit"):
        check_store_crc32c(good, data[:-1] + bytes([data[-1] ^ 1]))


@pytest.mark.parametrize("case", [REAL_S3])
def test_whole_unlisted_objects_are_checked_against_the_stores_crc32c(
    request: pytest.FixtureRequest, case: str
) -> None:
    """manifest.json itself (or any object no manifest lists) read whole on S3: the
    CRC-32C S3 returns with ``ChecksumMode=ENABLED`` is compared with the bytes.
    (SeaweedFS returns it; moto 5 returns none, so there is nothing to compare.)"""
    server = server_for(request, case)
    assert isinstance(server, S3Endpoint)
    bucket_uri, _ = bucket_location(request, case)
    with FaultProxy(server.endpoint_url, seed=5) as proxy:
        options = {**server.storage_options(), "endpoint_url": proxy.endpoint_url}
        storage = CheckpointStorage(f"{bucket_uri}/raw", storage_options=options)
        payload = os.urandom(3000)
        storage.write("k", payload)
        assert storage.read("k") == payload
        proxy.corrupt(1.0)
        with pytest.raises(CorruptObjectError, match=r"raw/k \(read on rank 0\).*CRC-32C"):
            storage.read("k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_byte_flipped_in_transit_fails_whole_and_partial_loads(
    proxied: tuple[FaultProxy, str, dict], backend: str
) -> None:
    proxy, bucket_uri, options = proxied
    uri = f"{bucket_uri}/{backend}"
    weight = _save(uri, backend, options)
    for first, count in CASES:  # through the proxy, untouched: right
        assert torch.equal(_load_rows(uri, first, count, options), weight[first : first + count])
    for offset in (None, 0, 10**9):  # the middle, first and last byte of every GET's body
        proxy.corrupt(1.0, offset=offset, path_contains=DATA_OBJECT[backend])
        for first, count in CASES:
            before = proxy.stats().faults.get("corrupt", 0)
            with pytest.raises(CorruptObjectError, match=r"rank 0|CRC-32C") as info:
                _load_rows(uri, first, count, options)
            assert proxy.stats().faults["corrupt"] > before, (offset, first, count)
            assert "corrupt" in str(info.value)
    # a body cut short once is retried: right tensors; every time: an error
    proxy.truncate(1.0, ranged_only=True, path_contains=DATA_OBJECT[backend], limit=1)
    assert torch.equal(_load_rows(uri, 800, 400, options), weight[800:1200])
    assert proxy.stats().faults["truncate"] == 1
    proxy.truncate(1.0, ranged_only=True, path_contains=DATA_OBJECT[backend])
    with pytest.raises(CheckpointingException):
        _load_rows(uri, 800, 400, options, retry=FAST)
    proxy.clear()
    assert torch.equal(_load_rows(uri, 800, 400, options), weight[800:1200])


# -- four ranks: TP2 saved, TP4 loaded --------------------------------------------------------

TP_SHAPE = (1600, 1000)  # TP2 shards of 3.2 MB (4 blocks); TP4 ranks read 1.6 MB halves


def _tp_weight() -> torch.Tensor:
    return torch.randn(*TP_SHAPE, generator=torch.Generator().manual_seed(7))


def _tp_state(rank: int, tp: int, empty: bool = False) -> dict[str, Any]:
    state = {}
    for key, full in [("w", _tp_weight()), ("b", _bias())]:
        local = full.chunk(tp)[rank % tp].clone()
        if empty:
            local = torch.empty_like(local)
        state[key] = ShardedTensor.from_rank_offsets(
            key, local, (0, rank % tp, tp), replica_id=rank // tp
        )
    return state


def _tp2_save(rank: int, world: int, uri: str, options: dict, backend: str) -> int:
    config = CheckpointConfig(part_size=PART)
    cloudckpt.save(_tp_state(rank, 2), uri, storage_options=options,
                   sharded_strategy=(backend, 1), config=config)  # fmt: skip
    return rank


def _tp4_load(rank: int, world: int, uri: str, options: dict) -> dict[str, Any]:
    try:
        loaded = cloudckpt.load(_tp_state(rank, world, empty=True), uri, storage_options=options)
    except CheckpointingException as exc:
        corrupt = isinstance(exc, CorruptObjectError) or (
            isinstance(exc, DistributedCheckpointError) and "CorruptObjectError" in str(exc)
        )
        return {"raised": type(exc).__name__, "corrupt": corrupt, "message": str(exc)}
    equal = torch.equal(loaded["w"], _tp_weight().chunk(world)[rank]) and torch.equal(
        loaded["b"], _bias().chunk(world)[rank]
    )
    return {"equal": equal}


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp2_saved_tp4_loaded_through_a_corrupting_proxy(
    rank_pool: Any, proxied: tuple[FaultProxy, str, dict], backend: str
) -> None:
    proxy, bucket_uri, options = proxied
    uri = f"{bucket_uri}/tp/{backend}"
    rank_pool.run(_tp2_save, uri, options, backend)
    assert rank_pool.run(_tp4_load, uri, options) == [{"equal": True}] * 4
    proxy.corrupt(1.0, path_contains=DATA_OBJECT[backend])
    results = rank_pool.run(_tp4_load, uri, options)
    assert all("raised" in r for r in results), results  # no rank got tensors
    assert all(r["corrupt"] for r in results), results
    assert any("rank " in r["message"] and "bytes " in r["message"] for r in results), results
    proxy.clear()


# -- verify --deep, and an odd part size ------------------------------------------------


def test_verify_deep_checks_the_recorded_block_crcs(tmp_path: Any) -> None:
    uri = str(tmp_path / "ckpt")
    _save(uri, "zarr")
    assert cloudckpt.verify(uri, deep=True).ok
    storage = CheckpointStorage(uri)
    manifest = Manifest.from_json(storage.read(MANIFEST_FNAME))
    big = next(e for e in manifest.objects if e.blocks is not None)
    assert big.blocks is not None
    packed = bytearray(big.blocks.packed)
    packed[4 * 2] ^= 0xFF  # block 2's CRC recorded wrongly; the object CRC still right
    wrong = dataclasses.replace(big, blocks=BlockCrcs(big.blocks.block_size, bytes(packed)))
    objects = tuple(wrong if e.path == big.path else e for e in manifest.objects)
    storage.write(MANIFEST_FNAME, dataclasses.replace(manifest, objects=objects).to_json())
    report = cloudckpt.verify(uri, deep=True)
    assert [(p.kind, p.path) for p in report.problems] == [("checksum-mismatch", big.path)]
    assert "blocks [2]" in report.problems[0].detail


@pytest.mark.parametrize("case", S3_CASES)
def test_an_odd_part_size_makes_each_part_one_block(
    request: pytest.FixtureRequest, case: str
) -> None:
    """gcd(part size, 1 MiB) = 8 bytes: blocks are whole parts instead, and ranged
    reads are still checked against them."""
    bucket_uri, options = bucket_location(request, case)
    part = 5 * MiB + 1000
    storage = CheckpointStorage(
        f"{bucket_uri}/odd", storage_options=options, config=CheckpointConfig(part_size=part)
    )
    data = os.urandom(2 * part + 12345)
    entry = storage.write("obj", data)  # a multipart upload of three parts
    assert entry.crc32c == crc32c_lib.crc32c(data)
    assert entry.blocks is not None and entry.blocks.block_size == part
    expected = [crc32c_lib.crc32c(data[i : i + part]) for i in range(0, len(data), part)]
    assert [entry.blocks.crc(i) for i in range(3)] == expected
    reader = storage.with_expected({"obj": entry})
    assert reader.read("obj", part - 10, part + 10) == data[part - 10 : part + 10]
