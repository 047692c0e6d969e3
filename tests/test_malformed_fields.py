"""Malformed fields of a checkpoint's own files: every field read from
``metadata.json``, ``manifest.json`` and a DCP ``.metadata`` is checked for its type
before use, so a wrong one is a MalformedCheckpointError naming the file and the field
(never a raw TypeError), and no load returns a wrong tensor. The files are damaged as
a buggy or hostile writer would: valid JSON or a valid pickle of DCP's classes, the
manifest's CRC-32C of ``.metadata`` recomputed so the damage is not caught in transit."""

from __future__ import annotations

import copy
import json
import pickle
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import CheckpointingException, MalformedCheckpointError
from cloudckpt.manifest import ManifestError
from cloudckpt.storage import crc32c

JUNK: list[Any] = [None, [], [1, 2], {}, {"a": 1}, -1, 0, 2**70, 1.5, "x", "", True, [[0]]]
FUZZ_MUTATIONS = 200


def _state() -> dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(2, 3)),
        "o": ShardedObject("o", {"x": 1}, (1,), (0,)),
        "step": 3,
    }


def _load(uri: str) -> dict[str, Any]:
    return cloudckpt.load(_state(), uri, validate_access_integrity=False)


def _intact(loaded: dict[str, Any]) -> bool:
    return torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3)) and loaded["o"] == {"x": 1}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The commit files of a small torch_dist checkpoint (world of 1)."""
    root = tmp_path_factory.mktemp("pristine") / "ckpt"
    cloudckpt.save(_state(), str(root), sharded_strategy=("torch_dist", 1))
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path: Path, pristine: dict[str, bytes]) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    for name, raw in pristine.items():
        (root / name).write_bytes(raw)
    return root


def _write_metadata(root: Path, metadata: Metadata) -> None:
    """Replace ``.metadata``; the manifest is amended to match (size and CRC-32C)."""
    raw = pickle.dumps(metadata)
    (root / ".metadata").write_bytes(raw)
    doc = json.loads((root / "manifest.json").read_text())
    doc["objects"] = [
        [e[0], len(raw), crc32c(raw)] if e[0] == ".metadata" else e for e in doc["objects"]
    ]
    (root / "manifest.json").write_text(json.dumps(doc))


def _edit_json(root: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((root / name).read_text())
    edit(doc)
    (root / name).write_text(json.dumps(doc))


def _refused(root: Path, kind: type, *named: str) -> str:
    with pytest.raises(kind) as info:
        _load(str(root))
    message = str(info.value)
    assert all(n in message for n in named), message
    return message


# -- metadata.json --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sharded_backend_version", [1]),  # the unhashable 'list'
        ("sharded_backend_version", {"v": 1}),  # ... and 'dict'
        ("common_backend", ["torch"]),
        ("common_backend", {"b": "torch"}),
        ("sharded_backend", 1),
        ("common_backend_version", "1"),
        ("sharded_backend_version", True),
    ],
)
def test_metadata_json_field_of_the_wrong_type(checkpoint: Path, field: str, value: Any) -> None:
    _edit_json(checkpoint, "metadata.json", lambda doc: doc.__setitem__(field, value))
    _refused(checkpoint, MalformedCheckpointError, f"{checkpoint}/metadata.json", repr(field))


# -- manifest.json --------------------------------------------------------------------------


def _set_entry(doc: dict[str, Any], position: int, value: Any) -> None:
    doc["objects"][0][position] = value


@pytest.mark.parametrize(
    ("field", "edit"),
    [
        ("world_size", lambda doc: doc.__setitem__("world_size", "1")),
        ("created", lambda doc: doc.__setitem__("created", 17)),
        ("backends", lambda doc: doc.__setitem__("backends", [["a", 1]])),
        ("common_keys", lambda doc: doc.__setitem__("common_keys", [1])),
        ("objects", lambda doc: doc.__setitem__("objects", {"a": 1})),
        ("object entry", lambda doc: _set_entry(doc, 1, "12")),
        ("object entry", lambda doc: _set_entry(doc, 0, ["w"])),
        ("object entry", lambda doc: _set_entry(doc, 2, 1.5)),
        ("tensor entry", lambda doc: doc["tensors"][0].__setitem__("shape", ["2", 3])),
        ("key", lambda doc: doc["tensors"][0].__setitem__("key", None)),
    ],
)
def test_manifest_field_of_the_wrong_type(
    checkpoint: Path, field: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    _edit_json(checkpoint, "manifest.json", edit)
    _refused(checkpoint, ManifestError, f"{checkpoint}/manifest.json", field)


# -- .metadata ------------------------------------------------------------------------------


def _w(md: Metadata) -> Any:
    return md.state_dict_metadata["w"]


def _info(md: Metadata, fqn: str) -> Any:
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


DCP_CASES: dict[str, tuple[Callable[[Metadata], None], str]] = {
    # the 'NoneType' object is not iterable
    "state_dict_metadata-none": (
        lambda md: setattr(md, "state_dict_metadata", None),
        "field state_dict_metadata is None",
    ),
    "entry-a-list": (
        lambda md: md.state_dict_metadata.__setitem__("w", [1]),
        "state_dict_metadata['w']",
    ),
    "storage_data-a-list": (lambda md: setattr(md, "storage_data", []), "field storage_data"),
    "dtype-none": (
        lambda md: setattr(_w(md).properties, "dtype", None),
        "state_dict_metadata['w'].properties.dtype",
    ),
    "chunk-not-a-chunk": (
        lambda md: _w(md).chunks.__setitem__(0, True),
        "state_dict_metadata['w'].chunks[0]",
    ),
    "chunk-offsets-a-dict": (
        lambda md: setattr(_w(md).chunks[0], "offsets", {"a": 1}),
        "state_dict_metadata['w'].chunks[0].offsets",
    ),
    "chunk-outside-the-tensor": (
        lambda md: setattr(_w(md).chunks[0], "sizes", torch.Size([3, 3])),
        "lies outside the tensor's size (2, 3)",
    ),
    "no-chunk-at-all": (  # a load would have returned zeros
        lambda md: setattr(_w(md), "chunks", []),
        "the stored chunks of tensor 'w' hold 0 of the 6 elements",
    ),
    "relative_path-a-list": (
        lambda md: setattr(_info(md, "w"), "relative_path", ["__0_0.distcp"]),
        "storage_data['w'].relative_path",
    ),
    "length-negative": (
        lambda md: setattr(_info(md, "o/shard_0_1"), "length", -1),
        "storage_data['o/shard_0_1'].length",
    ),
    "object-range-elsewhere": (  # torch.load of the wrong bytes: EOFError, RuntimeError
        lambda md: setattr(_info(md, "o/shard_0_1"), "length", 7),
        "__0_0.distcp (item 'o/shard_0_1'): cannot decode the sharded object",
    ),
    "mcore_data-a-list": (lambda md: setattr(md, "mcore_data", [1]), "field mcore_data"),
    "orig-shape-a-str": (
        lambda md: setattr(md, "mcore_data", {"w": {"nd_reformulated_orig_global_shape": "2"}}),
        "mcore_data['w']'s original shape",
    ),
}


@pytest.mark.parametrize("case", list(DCP_CASES))
def test_dcp_metadata_field_of_the_wrong_type(
    checkpoint: Path, pristine: dict[str, bytes], case: str
) -> None:
    edit, named = DCP_CASES[case]
    metadata = pickle.loads(pristine[".metadata"])
    assert isinstance(metadata.storage_data[MetadataIndex("w", (0, 0))].length, int)
    edit(metadata)
    _write_metadata(checkpoint, metadata)
    where = "__0_0.distcp" if named.startswith("__0_0.distcp") else ".metadata"
    _refused(checkpoint, MalformedCheckpointError, f"{checkpoint}/{where}", named)


# -- fuzz -----------------------------------------------------------------------------------


def _json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    items = (
        doc.items()
        if isinstance(doc, dict)
        else enumerate(doc[:4])
        if isinstance(doc, list)
        else ()
    )
    for key, value in items:
        out += _json_paths(value, (*prefix, key))
    return out


def _mutated_json(raw: bytes, rng: random.Random) -> bytes:
    doc = json.loads(raw)
    path = rng.choice(_json_paths(doc)[1:])
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and rng.random() < 0.15:
        del parent[path[-1]]
    else:
        parent[path[-1]] = copy.deepcopy(rng.choice(JUNK))
    return json.dumps(doc).encode()


def _object_fields(obj: Any, depth: int = 0) -> list[tuple[Any, str | int | Any]]:
    """(container, attribute name / key / index) of the fields below ``obj``."""
    if depth > 5:
        return []
    out: list[tuple[Any, Any]] = []
    if hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            out.append((obj, name))
            out += _object_fields(getattr(obj, name), depth + 1)
    elif isinstance(obj, dict):
        for key, value in list(obj.items())[:4]:
            out.append((obj, key))
            out += _object_fields(value, depth + 1)
    elif isinstance(obj, list):
        out += [(obj, i) for i in range(min(len(obj), 3))]
    return out


def _mutated_metadata(raw: bytes, rng: random.Random) -> Metadata | None:
    metadata = pickle.loads(raw)
    container, field = rng.choice(_object_fields(metadata))
    value = copy.deepcopy(rng.choice(JUNK))
    if isinstance(container, dict | list):
        container[field] = value
    else:
        object.__setattr__(container, field, value)
    try:
        pickle.dumps(metadata)
    except (RuntimeError, TypeError, pickle.PicklingError):  # DCP refuses to pickle it
        return None
    return metadata


def test_seeded_fuzz_of_the_commit_files(checkpoint: Path, pristine: dict[str, bytes]) -> None:
    rng = random.Random(30)
    outcomes: Counter[str] = Counter()
    while sum(outcomes.values()) < FUZZ_MUTATIONS:
        for name, raw in pristine.items():
            (checkpoint / name).write_bytes(raw)
        name = rng.choice(["manifest.json", "metadata.json", ".metadata"])
        if name == ".metadata":
            metadata = _mutated_metadata(pristine[name], rng)
            if metadata is None:
                continue
            _write_metadata(checkpoint, metadata)
        else:
            (checkpoint / name).write_bytes(_mutated_json(pristine[name], rng))
        try:
            loaded = _load(str(checkpoint))
        except CheckpointingException as exc:
            outcomes[type(exc).__name__] += 1
        else:  # a field the load does not depend on (a created time, an mcore_data entry)
            assert _intact(loaded), name
            outcomes["loaded intact"] += 1
    # every mutation either refused with cloudckpt's errors (an escape fails the test
    # above with its own type) or without effect on what was loaded
    assert outcomes["MalformedCheckpointError"] > 50 and outcomes["ManifestError"] > 20, outcomes
    assert outcomes["loaded intact"] > 20, outcomes
