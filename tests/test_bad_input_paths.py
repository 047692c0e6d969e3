"""Keys whose object paths the store cannot hold: refused before the claim
with an InvalidKeyError listing them with their ranks, nothing stored, and the
corrected retry to the same URI commits. zarr derives paths from keys
(``<key>/.zarray``, ``<key>/<chunk>``, ``<key>/shard_<o>_<s>.pt``), torch_dist does not
(keys are DCP item names inside ``__<r>_<i>.distcp``), so there any length saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor
from cloudckpt.errors import InvalidKeyError
from cloudckpt.keys import KeyLayout, key_set, longest_chunk_name, validate_key_set
from cloudckpt.storage import open_checkpoint
from cloudckpt.storage.limits import PathLimits, path_limits
from cloudckpt.storage.location import Location, StoreKind
from tests.fixtures_object_stores import bucket_location

ZARR, TORCH_DIST = ("zarr", 1), ("torch_dist", 1)


def _tensor(key: str, n: int = 4) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, torch.arange(float(n)))


def _stored(uri: str, options: dict[str, Any]) -> list[str]:
    return open_checkpoint(uri, storage_options=options).list()


def _refused_then_retried(
    uri: str, options: dict[str, Any], bad: dict[str, Any], good: dict[str, Any]
) -> str:
    """``bad`` is refused with nothing stored; ``good`` then commits at the same URI and
    loads back. -> the refusal's message."""
    with pytest.raises(InvalidKeyError) as info:
        cloudckpt.save(bad, uri, sharded_strategy=ZARR, storage_options=options)
    assert _stored(uri, options) == []  # no claim: the retry is no CommitConflictError
    cloudckpt.save(good, uri, sharded_strategy=ZARR, storage_options=options)
    request = {k: _tensor(v.key) if isinstance(v, ShardedTensor) else v for k, v in good.items()}
    loaded = cloudckpt.load(request, uri, storage_options=options)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    message = str(info.value)
    assert "rank 0" in message and uri.rsplit("://", maxsplit=1)[-1] in message, message
    return message


# -- local disk -------------------------------------------------------------------------------


def test_zarr_tensor_key_over_the_segment_limit(tmp_path: Path) -> None:
    uri, key = str(tmp_path / "ckpt"), "k" * 2000  # the probe: ENAMETOOLONG
    message = _refused_then_retried(uri, {}, {"w": _tensor(key)}, {"w": _tensor("k" * 200)})
    assert "tensor 'kkkk" in message and "(2000 characters) (rank 0)" in message, message
    assert "path segment of 2000 bytes; this filesystem holds at most 255" in message


def test_zarr_object_file_over_the_segment_limit(tmp_path: Path) -> None:
    # the key fits; the file the object derives from it, 'o/shard_0.0...0_1.1...1.pt'
    # (its offsets and shape, 64 dimensions), has a segment of 264 bytes
    uri, ndim = str(tmp_path / "ckpt"), 64
    bad = {"w": _tensor("w"), "o": ShardedObject("o", {"x": 1}, (1,) * ndim, (0,) * ndim)}
    good = {"w": _tensor("w"), "o": ShardedObject("o", {"x": 1}, (1,), (0,))}
    message = _refused_then_retried(uri, {}, bad, good)
    assert "object shard 'o/shard_0.0.0" in message and "invalid key(s) (1)" in message
    assert "path segment of 264 bytes; this filesystem holds at most 255" in message, message


def test_zarr_key_over_the_path_limit(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    key = "/".join(["s" * 200] * 21)  # every segment fits; 4,220 bytes do not
    message = _refused_then_retried(uri, {}, {"w": _tensor(key)}, {"w": _tensor("w")})
    assert "with the checkpoint's prefix; this filesystem holds at most 4095 bytes" in message


def test_bytes_are_counted_not_characters(tmp_path: Path) -> None:
    uri, key = str(tmp_path / "ckpt"), "é" * 130  # 130 characters, 260 bytes in UTF-8
    message = _refused_then_retried(uri, {}, {"w": _tensor(key)}, {"w": _tensor("é" * 127)})
    assert "path segment of 260 bytes" in message, message


def test_every_overlong_key_is_listed_once_with_its_ranks(tmp_path: Path) -> None:
    state = {f"t{i}": _tensor(f"{i}" + "x" * 300) for i in range(3)}
    state["bad"] = _tensor("../escape")
    with pytest.raises(InvalidKeyError) as info:
        cloudckpt.save(state, str(tmp_path / "ckpt"), sharded_strategy=ZARR)
    message = str(info.value)
    assert "invalid key(s) (4)" in message and "'../escape'" in message, message
    assert message.count("holds at most 255 bytes per segment") == 3


@pytest.mark.parametrize("what", ["tensor", "object"])
def test_torch_dist_derives_no_path_from_a_key(tmp_path: Path, what: str) -> None:
    uri, key = str(tmp_path / "ckpt"), "k" * 2000
    state: dict[str, Any] = {"w": _tensor("w")}
    state["x"] = _tensor(key) if what == "tensor" else ShardedObject(key, {"v": 7}, (1,), (0,))
    cloudckpt.save(state, uri, sharded_strategy=TORCH_DIST)
    assert max(len(p) for p in _stored(uri, {})) < 40  # '__0_0.distcp', '.metadata', ...
    request: dict[str, Any] = {"w": _tensor("w")}
    request["x"] = _tensor(key) if what == "tensor" else ShardedObject(key, None, (1,), (0,))
    loaded = cloudckpt.load(request, uri)
    if what == "tensor":
        assert torch.equal(loaded["x"], torch.arange(4.0))
    else:
        assert loaded["x"] == {"v": 7}


def test_convert_refuses_keys_the_target_store_cannot_hold(tmp_path: Path) -> None:
    from cloudckpt.convert import convert  # noqa: PLC0415

    source, target = str(tmp_path / "dcp"), str(tmp_path / "zarr")
    cloudckpt.save({"w": _tensor("k" * 300)}, source, sharded_strategy=TORCH_DIST)
    with pytest.raises(InvalidKeyError) as info:
        convert(source, target, "zarr")
    assert "holds at most 255 bytes per segment" in str(info.value) and target in str(info.value)
    assert _stored(target, {}) == []


# -- S3 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["s3-seaweedfs"])
def test_s3_key_over_1024_bytes(request: pytest.FixtureRequest, case: str) -> None:
    bucket, options = bucket_location(request, case)
    uri = f"{bucket}/run/iter_0000001"
    message = _refused_then_retried(
        uri, options, {"w": _tensor("k" * 1100)}, {"w": _tensor("k" * 900)}
    )
    assert "(1100 characters) (rank 0)" in message, message
    assert "1125 bytes long with the checkpoint's prefix; S3 holds at most 1024 bytes" in message
    # torch_dist: the same key is a DCP item, no object path: it saves
    dcp = f"{bucket}/run/iter_0000002"
    cloudckpt.save({"w": _tensor("k" * 1100)}, dcp, TORCH_DIST, storage_options=options)
    loaded = cloudckpt.load({"w": _tensor("k" * 1100)}, dcp, storage_options=options)
    assert torch.equal(loaded["w"], torch.arange(4.0))


# -- the rules, without a store -----------------------------------------------------------------


def test_zarr_chunk_names_count_by_the_global_shape() -> None:
    s3 = PathLimits("S3", 0, 1024)
    layout = KeyLayout(tensor_dirs=True, object_files=True, limits=s3)
    key = "k" * 1016  # '<key>/.zarray' is 1,024 bytes: it fits
    keys = key_set({key: (0, 1)}, {})
    assert longest_chunk_name(()) == "0" and longest_chunk_name((10, 10**5)) == "9.99999"
    validate_key_set(keys, layout, "s3://b/c", 0, {key: (1000, 1000)})  # '999.999': fits
    with pytest.raises(InvalidKeyError) as info:  # '99999.99999' may be a chunk's name
        validate_key_set(keys, layout, "s3://b/c", 0, {key: (10**5, 10**5)})
    assert "(ranks 0, 1)" in str(info.value) and "1028 bytes" in str(info.value)
    torch_dist = KeyLayout(tensor_dirs=False, object_files=False, limits=s3)
    validate_key_set(keys, torch_dist, "s3://b/c", 0, {key: (10**5, 10**5)})


def test_path_limits_of_each_store(tmp_path: Path) -> None:
    def limits(kind: StoreKind, root: str) -> PathLimits:
        return path_limits(Location(fs=None, root=root, uri="x", kind=kind))  # type: ignore[arg-type]

    assert limits(StoreKind.S3, "bucket/run/iter_1") == PathLimits("S3", len("run/iter_1/"), 1024)
    assert limits(StoreKind.S3, "bucket") == PathLimits("S3", 0, 1024)
    assert limits(StoreKind.GCS, "b/r") == PathLimits("GCS", 2, 1024)
    assert not limits(StoreKind.MEMORY, "/r").bounded
    local = limits(StoreKind.LOCAL, str(tmp_path / "not" / "yet"))
    assert local.prefix_bytes == len(str(tmp_path / "not" / "yet")) + 1
    assert local.max_segment_bytes == 255 and local.max_path_bytes == 4095
