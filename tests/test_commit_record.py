"""The commit record (one rank's write results and tensor entries in columns) and the
coordinator's merge of them: the same manifest, bytes and errors as the merge of plain
write results (kept here as the reference), on random inputs and across real ranks."""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import zlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import pytest

from cloudckpt import commit as commit_mod
from cloudckpt import commit_state
from cloudckpt.commit import build_manifest, tensor_piece
from cloudckpt.core import CheckpointingConfig
from cloudckpt.errors import CheckpointingException
from cloudckpt.manifest import (
    CommitRecord,
    Manifest,
    ManifestEntry,
    ManifestError,
    TensorEntry,
    merge_entries,
    merge_records,
)
from cloudckpt.storage import CheckpointStorage
from cloudckpt.storage.blocks import BlockCrcs

BACKENDS = CheckpointingConfig("zarr")
OldRecord = tuple[list[ManifestEntry], list[TensorEntry], list[str]]


def reference_manifest(gathered: Sequence[OldRecord], created: str) -> Manifest:
    """The merge before commit records: every rank's write results and tensor entries."""
    tensors = {t.key: t for _, rank_tensors, _ in gathered for t in rank_tensors}
    return Manifest(
        objects=tuple(merge_entries(entries for entries, _, _ in gathered)),
        tensors=tuple(tensors.values()),
        common_keys=tuple(sorted({k for _, _, keys in gathered for k in keys})),
        world_size=len(gathered),
        created=created,
        backends=asdict(BACKENDS),
    )


def reference_json(manifest: Manifest) -> bytes:
    """``Manifest.to_json`` as it was: one ``json.dumps`` of the whole document."""
    tensors = []
    for t in manifest.tensors:
        doc: dict[str, Any] = {"key": t.key, "shape": list(t.global_shape), "dtype": t.dtype}
        if t.chunks is not None:
            doc["chunks"] = list(t.chunks)
        tensors.append(doc)
    objects = []
    for e in manifest.objects:
        entry: list[Any] = [e.path, e.size, e.crc32c]
        if e.blocks is not None and manifest.version >= 2:
            entry += [e.blocks.block_size, e.blocks.to_base64()]
        objects.append(entry)
    doc = {
        "format": "cloudckpt-manifest",
        "version": manifest.version,
        "created": manifest.created,
        "world_size": manifest.world_size,
        "backends": dict(manifest.backends),
        "common_keys": list(manifest.common_keys),
        "tensors": tensors,
        "objects": objects,
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def records_of(gathered: Sequence[OldRecord]) -> list[CommitRecord]:
    """What the coordinator gathers: each rank's record with its piece of the tensor
    text, through pickle (as the gather sends them)."""
    local = [CommitRecord.of(*rank_record) for rank_record in gathered]
    digests = [r.digest for r in local]
    sent = [r.piece(*tensor_piece(digests, i)) for i, r in enumerate(local)]
    return [pickle.loads(pickle.dumps(r)) for r in sent]


_ODD = ["", "é", "\\", '"', "\n", "\x00", "☃", "/", " ", "\U0001f600", "\ud800"]


def _path(rng: random.Random) -> str:
    return f"t{rng.randrange(40)}{rng.choice(_ODD)}/{rng.randrange(6)}.{rng.randrange(3)}"


def _entry(rng: random.Random, path: str) -> ManifestEntry:
    size = rng.choice([0, 7, 1 << 20, (1 << 20) + 5, 3 << 20, 1 << 40])
    blocks = None
    if size > 1 << 20 and rng.random() < 0.7:
        block_size = 1 << 20 if size < 1 << 30 else 1 << 38  # a few blocks at most
        count = -(-size // block_size)
        blocks = BlockCrcs.of(block_size, (rng.getrandbits(32) for _ in range(count)))
    return ManifestEntry(path, size, rng.getrandbits(32), blocks)


def _tensor(rng: random.Random, key: str) -> TensorEntry:
    shape = tuple(rng.randrange(1, 9) for _ in range(rng.randrange(0, 3)))
    chunks = None if rng.random() < 0.4 else tuple(max(1, n // 2) for n in shape)
    return TensorEntry(key, shape, rng.choice(["float32", "bfloat16", "int64"]), chunks)


def random_world(rng: random.Random) -> list[OldRecord]:
    """1-9 ranks: objects written once (some reported twice, identically), tensor lists
    shared by groups of ranks (replicas) and some keys whose entries differ by rank."""
    ranks = rng.randrange(1, 10)
    objects: dict[str, ManifestEntry] = {}
    for _ in range(rng.randrange(0, 60)):
        path = _path(rng)
        objects[path] = _entry(rng, path)
    results: list[list[ManifestEntry]] = [[] for _ in range(ranks)]
    for entry in objects.values():
        results[rng.randrange(ranks)].append(entry)
        if rng.random() < 0.1:  # reported by a second rank, the same result
            results[rng.randrange(ranks)].append(entry)
    for rank_results in results:
        rng.shuffle(rank_results)
    groups = [
        [_tensor(rng, f"k{rng.randrange(30)}{rng.choice(_ODD)}") for _ in range(rng.randrange(5))]
        for _ in range(rng.randrange(1, 4))
    ]
    tensors = [list(rng.choice(groups)) for _ in range(ranks)]
    for rank_tensors in tensors:
        if rng.random() < 0.2:  # a key whose entry differs on this rank: the last rank's wins
            rank_tensors.append(_tensor(rng, "k0"))
    keys = [[f"c{rng.randrange(9)}" for _ in range(rng.randrange(3))] for _ in range(ranks)]
    return list(zip(results, tensors, keys, strict=True))


@pytest.mark.parametrize("seed", range(40))
def test_merge_of_records_equals_the_merge_of_write_results(seed: int) -> None:
    gathered = random_world(random.Random(seed))
    records = records_of(gathered)
    built = build_manifest(records, BACKENDS)
    expected = reference_manifest(gathered, built.created)
    assert built == expected
    assert built.tensors == expected.tensors  # values too (the highest rank's entry)
    assert built.to_json() == reference_json(expected) == reference_json(built)
    assert Manifest.from_json(built.to_json()) == built
    for (results, _, _), record in zip(gathered, records, strict=True):
        assert record.write_results() == results


def test_replicas_send_their_tensor_entries_once_in_pieces() -> None:
    same = [TensorEntry("w", (4, 2), "float32", (2, 2)), TensorEntry("b", (3,), "bfloat16")]
    other = [TensorEntry("v", (8,), "float32")]
    gathered: list[OldRecord] = [
        ([ManifestEntry(f"o{r}", 1, r)], list(tensors), [])
        for r, tensors in enumerate([same, same, other, same, other])
    ]
    local = [CommitRecord.of(*rank_record) for rank_record in gathered]
    digests = [r.digest for r in local]
    assert len(set(digests)) == 2
    assert [tensor_piece(digests, r) for r in range(5)] == [(0, 3), (1, 3), (0, 2), (2, 3), (1, 2)]
    records = records_of(gathered)
    full = {r.digest: r.tensors for r in local}
    for digest, text in full.items():  # each rank a piece, together the whole text once
        assert "".join(r.tensors for r in records if r.digest == digest) == text
    assert max(len(r.tensors) for r in records) <= max(map(len, full.values())) // 2 + 1
    manifest = build_manifest(records, BACKENDS)
    assert [t.key for t in manifest.tensors] == ["b", "v", "w"]
    assert manifest.tensors[2] == TensorEntry("w", (4, 2), "float32", (2, 2))
    assert [e.path for e in manifest.objects] == ["o0", "o1", "o2", "o3", "o4"]
    assert manifest.world_size == 5


def test_empty_and_one_rank_records() -> None:
    assert merge_records([]) == ([], [], [])
    record = CommitRecord.of([], [], ["a.b"])
    assert record.write_results() == [] and record.tensors == "[]"
    assert merge_records([record]) == ([], [], ["a.b"])


@pytest.mark.parametrize("seed", range(10))
def test_conflicting_results_raise_the_same_error_as_before(seed: int) -> None:
    rng = random.Random(seed)
    gathered = random_world(rng)
    entry = _entry(rng, "clash/0")
    different = dataclasses.replace(entry, crc32c=entry.crc32c ^ 1)
    if rng.random() < 0.5:
        different = dataclasses.replace(entry, blocks=BlockCrcs.of(1 << 20, [1, 2]))
    first, second = sorted(rng.sample(range(len(gathered) + 1), 2))
    gathered.append(([], [], []))
    gathered[first][0].insert(rng.randrange(len(gathered[first][0]) + 1), entry)
    gathered[second][0].insert(rng.randrange(len(gathered[second][0]) + 1), different)
    with pytest.raises(ManifestError) as old:
        reference_manifest(gathered, "")
    with pytest.raises(ManifestError) as new:
        build_manifest(records_of(gathered), BACKENDS)
    assert str(new.value) == str(old.value)
    assert f"(rank {second} among them)" in str(new.value)


def test_malformed_columns_are_refused() -> None:
    record = CommitRecord.of([ManifestEntry("a/0", 1, 2), ManifestEntry("b", 3, 4)])
    assert record.unpacked() == (["a/0", "b"], [1, 3], [2, 4])
    for bad in (
        dataclasses.replace(record, count=3),
        dataclasses.replace(record, columns=record.columns[:-2]),
        dataclasses.replace(record, columns=zlib.compress(b"\x00" * 48 + b"a/0")),
    ):
        with pytest.raises(CheckpointingException, match="commit record's columns"):
            merge_records([bad])


def test_records_of_one_rank_with_one_path_twice() -> None:
    record = CommitRecord.of([ManifestEntry("x", 1, 1), ManifestEntry("x", 1, 1)])
    assert merge_records([record])[0] == [ManifestEntry("x", 1, 1)]
    clash = CommitRecord.of([ManifestEntry("x", 1, 1), ManifestEntry("x", 2, 1)])
    with pytest.raises(ManifestError, match=r"'x' was written twice .*\(rank 0 among them\)"):
        merge_records([clash])


def test_pieces_that_do_not_make_up_their_digest_are_refused() -> None:
    record = CommitRecord.of([], [TensorEntry("w", (1,), "float32")])
    with pytest.raises(CheckpointingException, match="do not match their digest"):
        merge_records([record.piece(0, 2)])  # the other piece's rank is missing
    with pytest.raises(CheckpointingException, match=r"2 ranks .* do not match"):
        merge_records([record, record])  # the whole text from each: not pieces
    assert merge_records([record.piece(0, 2), record.piece(1, 2)])[1] == [
        TensorEntry("w", (1,), "float32")
    ]


def test_manifest_json_is_the_encoder_s_bytes_for_odd_strings() -> None:
    rng = random.Random(7)
    objects = {p: _entry(rng, p) for p in (_path(rng) for _ in range(200))}
    manifest = Manifest(
        objects=tuple(objects.values()),
        tensors=tuple(_tensor(rng, f"k{i}{rng.choice(_ODD)}") for i in range(30)),
        common_keys=("ü.x", 'a"b', "c\\d"),
        world_size=3,
        created="2026-11-27T00:00:00Z",
        backends={"sharded_backend": "zarr", "é": [1, {"b": 2, "a": None}]},
    )
    assert manifest.to_json() == reference_json(manifest)
    v1 = dataclasses.replace(manifest, version=1)
    assert v1.to_json() == reference_json(v1)
    assert b"block" not in v1.to_json() and Manifest.from_json(v1.to_json()).version == 1


# -- across real ranks ------------------------------------------------------------------------


def _commit_scenario(rank: int, world: int, uri: str, clash: bool) -> list[str] | str:
    storage = CheckpointStorage(uri)
    tp = rank % 2  # two "stages" of tensors, replicated over the other ranks
    tensors = [TensorEntry(f"stage{tp}.w{i}", (4, i + 1), "float32", (2, 1)) for i in range(3)]
    results = [ManifestEntry(f"r{rank}/{i}", 10 + i, rank * 10 + i) for i in range(2)]
    results.append(ManifestEntry("shared", 5, 99 if clash and rank == 3 else 1))
    try:
        manifest = commit_mod.commit(storage, results, BACKENDS, tensors, ["it"] if rank else [])
    except CheckpointingException as exc:
        return str(exc)
    if manifest is None:
        return []
    return [t.key for t in manifest.tensors] + [e.path for e in manifest.objects]


def test_commit_across_ranks_sends_replicated_entries_once(rank_pool, tmp_path) -> None:
    uri = str(tmp_path / "ckpt")
    out = rank_pool.run(_commit_scenario, uri, False)
    stages = [f"stage{s}.w{i}" for s in (0, 1) for i in range(3)]
    paths = [f"r{r}/{i}" for r in range(4) for i in range(2)] + ["shared"]
    assert out == [stages + paths, [], [], []]
    manifest = commit_state.read_manifest(CheckpointStorage(uri))
    assert manifest is not None and manifest.common_keys == ("it",)
    assert manifest.world_size == 4


def test_commit_across_ranks_refuses_two_results_for_one_path(rank_pool, tmp_path) -> None:
    uri = str(tmp_path / "ckpt")
    out = rank_pool.run(_commit_scenario, uri, True)
    assert all(isinstance(o, str) and "'shared' was written twice" in o for o in out), out
    assert all("(rank 3 among them)" in o for o in out)
    assert commit_state.read_manifest(CheckpointStorage(uri)) is None
