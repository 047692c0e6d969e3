"""Tests for the zarr v2 format and reader (formats.zarr.layout, _zarr_reader)."""

from __future__ import annotations

import itertools
import json
import pathlib
from typing import Any

import numcodecs
import numpy as np
import pytest
import torch
import zarr

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.errors import (
    CheckpointingException,
    CheckpointKeyNotFoundError,
    IncompatibleCheckpointError,
)
from cloudckpt.formats.tensor_bytes import bytes_to_tensor, tensor_bytes
from cloudckpt.formats.zarr.layout import (
    ArrayMeta,
    decode_chunk,
    decode_dtype,
    encode_dtype,
    overlapping_chunks,
    row_byte_range,
)
from cloudckpt.formats.zarr.reader import TensorReader
from cloudckpt.storage import CheckpointStorage

ZARRAY_KEYS = {
    "chunks",
    "compressor",
    "dimension_separator",
    "dtype",
    "fill_value",
    "filters",
    "order",
    "shape",
    "zarr_format",
}
DTYPE_SPELLINGS = {
    torch.bfloat16: "bfloat16",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.uint8: "|u1",
    torch.bool: "|b1",
}
MEGATRON_CONFIG = {
    "sharded_backend": "zarr",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _doc(**overrides: object) -> bytes:
    doc: dict[str, object] = {
        "chunks": [2, 2],
        "compressor": None,
        "dtype": "<f4",
        "fill_value": None,
        "filters": None,
        "order": "C",
        "shape": [4, 4],
        "zarr_format": 2,
    }
    doc.update(overrides)
    return json.dumps(doc).encode()


# --- ArrayMeta and dtypes ----------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [
        ArrayMeta((10, 7), (4, 3), torch.float32),
        ArrayMeta((), (), torch.bfloat16),
        ArrayMeta(
            (8,),
            (8,),
            torch.int64,
            compressor={"id": "zlib", "level": 1},
            filters=({"id": "shuffle", "elementsize": 8},),
            order="F",
            dimension_separator="/",
        ),
    ],
    ids=["2d", "0d-bf16", "compressed-F"],
)
def test_array_meta_json_round_trip(meta: ArrayMeta) -> None:
    raw = meta.to_json()
    doc = json.loads(raw)
    assert set(doc) == ZARRAY_KEYS
    assert doc["zarr_format"] == 2 and doc["shape"] == list(meta.shape)
    assert ArrayMeta.from_json(raw) == meta


@pytest.mark.parametrize("dtype", list(DTYPE_SPELLINGS), ids=str)
def test_dtype_encode_decode(dtype: torch.dtype) -> None:
    assert encode_dtype(dtype) == DTYPE_SPELLINGS[dtype]
    assert decode_dtype(encode_dtype(dtype)) is dtype
    meta = ArrayMeta((3,), (3,), dtype)
    assert meta.itemsize == torch.empty((), dtype=dtype).element_size()
    assert json.loads(meta.to_json())["dtype"] == DTYPE_SPELLINGS[dtype]


@pytest.mark.parametrize(
    ("spec", "dtype"), [("<i1", torch.int8), ("<u1", torch.uint8), ("<b1", torch.bool)]
)
def test_decode_dtype_accepts_alternative_spellings(spec: str, dtype: torch.dtype) -> None:
    assert decode_dtype(spec) is dtype


def test_unsupported_dtype_raises_naming_key() -> None:
    with pytest.raises(IncompatibleCheckpointError, match=r"'layer\.w'.*complex64"):
        encode_dtype(torch.complex64, "layer.w")
    with pytest.raises(IncompatibleCheckpointError, match=r"w/\.zarray.*'<c8'"):
        decode_dtype("<c8", "w/.zarray")
    with pytest.raises(IncompatibleCheckpointError):
        decode_dtype([["a", "<f4"]], "structured")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (_doc(zarr_format=3), "zarr_format 3"),
        (b"{not json", "not a valid .zarray"),
        (_doc(dtype="<c16"), "unsupported zarr dtype"),
        (_doc(order="X"), "chunk order 'X'"),
        (_doc(zarr_format=None), "zarr_format None"),
    ],
    ids=["v3", "bad-json", "dtype", "order", "no-format"],
)
def test_from_json_errors_name_location(raw: bytes, match: str) -> None:
    with pytest.raises(IncompatibleCheckpointError, match=match) as info:
        ArrayMeta.from_json(raw, "s3://b/ck/w/.zarray")
    assert "s3://b/ck/w/.zarray" in str(info.value)


@pytest.mark.parametrize(
    "raw",
    [b'{"zarr_format": 2}', b"[]", b"2", _doc(shape=None)],
    ids=["no-shape", "list", "number", "null-shape"],
)
def test_from_json_malformed_documents_raise_incompatible(raw: bytes) -> None:
    with pytest.raises(IncompatibleCheckpointError, match=r"ck/w/\.zarray"):
        ArrayMeta.from_json(raw, "ck/w/.zarray")


def test_from_json_defaults_missing_optional_fields() -> None:
    doc = json.loads(_doc())
    del doc["order"], doc["filters"], doc["compressor"]
    meta = ArrayMeta.from_json(json.dumps(doc).encode())
    assert (meta.order, meta.filters, meta.compressor, meta.dimension_separator) == (
        "C",
        None,
        None,
        ".",
    )
    assert meta.is_raw


def test_chunk_key_and_grid() -> None:
    assert ArrayMeta((4, 4), (2, 2), torch.float32).chunk_key((1, 0)) == "1.0"
    assert (
        ArrayMeta((4, 4, 4), (2, 2, 2), torch.float32, dimension_separator="/").chunk_key((1, 0, 1))
        == "1/0/1"
    )
    assert ArrayMeta((), (), torch.float32).chunk_key(()) == "0"
    assert ArrayMeta((10, 7), (4, 3), torch.float32).grid == (3, 3)
    assert ArrayMeta((8, 6), (4, 3), torch.float32).grid == (2, 2)
    assert ArrayMeta((), (), torch.float32).grid == ()
    meta = ArrayMeta((10, 7), (4, 3), torch.float16)
    assert meta.chunk_nbytes == 4 * 3 * 2
    assert not ArrayMeta((4,), (2,), torch.int8, compressor={"id": "zlib"}).is_raw


# --- overlapping_chunks and row_byte_range ------------------------------------------------


def _chunks_of(full: np.ndarray, meta: ArrayMeta) -> dict[tuple[int, ...], np.ndarray]:
    """Every chunk at its full stored shape (edge chunks zero-padded), as zarr stores it."""
    out = {}
    for index in itertools.product(*(range(n) for n in meta.grid)):
        chunk = np.zeros(meta.chunks, dtype=full.dtype)
        sel = tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, meta.chunks, strict=True))
        part = full[sel]
        chunk[tuple(slice(0, s) for s in part.shape)] = part
        out[index] = chunk
    return out


@pytest.mark.parametrize(
    ("offset", "shape"),
    [
        ((1, 1), (2, 1)),
        ((0, 0), (4, 3)),
        ((3, 2), (3, 3)),
        ((6, 4), (6, 6)),
        ((2, 0), (8, 7)),
        ((5, 3), (0, 2)),
        ((10, 0), (3, 3)),
        ((0, 0), (10, 7)),
    ],
    ids=[
        "inside-one",
        "exactly-one",
        "spans-4",
        "clipped-edge",
        "clipped-wide",
        "empty",
        "outside",
        "whole",
    ],
)
def test_overlapping_chunks_match_brute_force(
    offset: tuple[int, int], shape: tuple[int, int]
) -> None:
    meta = ArrayMeta((10, 7), (4, 3), torch.float32)
    full = np.arange(1, 71, dtype=np.float32).reshape(10, 7)
    chunks = _chunks_of(full, meta)
    overlaps = list(overlapping_chunks(meta, offset, shape))
    box = np.zeros(shape, dtype=np.float32)
    for ov in overlaps:
        box[ov.in_box] = chunks[ov.index][ov.in_chunk]
    expected = np.zeros(shape, dtype=np.float32)
    inside = full[offset[0] : offset[0] + shape[0], offset[1] : offset[1] + shape[1]]
    expected[: inside.shape[0], : inside.shape[1]] = inside
    np.testing.assert_array_equal(box, expected)
    touched = {
        idx
        for idx in chunks
        if all(
            max(o, i * c) < min(o + s, (i + 1) * c, d)
            for i, c, o, s, d in zip(idx, meta.chunks, offset, shape, meta.shape, strict=True)
        )
    }
    assert [ov.index for ov in overlaps] == sorted(touched)


def test_overlapping_chunks_of_0d_array() -> None:
    overlaps = list(overlapping_chunks(ArrayMeta((), (), torch.float32), (), ()))
    assert [(o.index, o.in_chunk, o.in_box) for o in overlaps] == [((), (), ())]


def test_row_byte_range() -> None:
    meta = ArrayMeta((6, 5), (3, 5), torch.float32)
    assert row_byte_range(meta, (slice(1, 3), slice(0, 2))) == (20, 60)
    assert row_byte_range(meta, (slice(0, 3), slice(0, 5))) == (0, 60)
    assert row_byte_range(ArrayMeta((9,), (4,), torch.int16), (slice(1, 3),)) == (2, 6)
    assert row_byte_range(ArrayMeta((), (), torch.float64), ()) == (0, 8)


# --- decode_chunk -----------------------------------------------------------------------


def test_decode_raw_c_and_f_order_chunks() -> None:
    values = np.arange(12, dtype=np.int32).reshape(3, 4)
    c_meta = ArrayMeta((3, 4), (3, 4), torch.int32)
    assert torch.equal(decode_chunk(c_meta, values.tobytes()), torch.from_numpy(values))
    f_meta = ArrayMeta((3, 4), (3, 4), torch.int32, order="F")
    assert torch.equal(decode_chunk(f_meta, values.tobytes(order="F")), torch.from_numpy(values))


def test_decode_bfloat16_chunk() -> None:
    values = torch.tensor([[1.5, -2.0], [3.25, 1e20]], dtype=torch.bfloat16)
    meta = ArrayMeta((2, 2), (2, 2), torch.bfloat16)
    assert torch.equal(decode_chunk(meta, bytes(tensor_bytes(values))), values)


@pytest.mark.parametrize(
    ("codec", "filters"),
    [
        (numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE), None),
        (numcodecs.Zlib(level=6), None),
        (numcodecs.Zlib(level=1), (numcodecs.Shuffle(elementsize=8),)),
    ],
    ids=["blosc", "zlib", "zlib+shuffle-filter"],
)
def test_decode_compressed_chunk(codec: Any, filters: tuple[Any, ...] | None) -> None:
    values = np.linspace(-1, 1, 24).reshape(2, 3, 4)
    data = values.tobytes()
    for f in filters or ():
        data = f.encode(data)
    meta = ArrayMeta(
        (2, 3, 4),
        (2, 3, 4),
        torch.float64,
        compressor=codec.get_config(),
        filters=tuple(f.get_config() for f in filters) if filters else None,
    )
    assert torch.equal(decode_chunk(meta, codec.encode(data)), torch.from_numpy(values))


def test_wrong_length_chunk_raises_naming_location() -> None:
    meta = ArrayMeta((4, 4), (2, 2), torch.float32)
    with pytest.raises(IncompatibleCheckpointError, match=r"memory://ck/w/1\.0.*12 bytes"):
        decode_chunk(meta, b"\0" * 12, "memory://ck/w/1.0")
    z = ArrayMeta((4, 4), (2, 2), torch.float32, compressor=numcodecs.Zlib().get_config())
    with pytest.raises(IncompatibleCheckpointError, match=r"w/0\.0"):
        decode_chunk(z, numcodecs.Zlib().encode(b"\0" * 20), "w/0.0")


def test_tensor_bytes_and_bytes_to_tensor() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()
    raw = tensor_bytes(t)
    assert bytes(raw) == t.contiguous().numpy().tobytes()
    assert torch.equal(bytes_to_tensor(bytes(raw), torch.int16).reshape(3, 2), t)
    assert bytes_to_tensor(b"", torch.float32).shape == (0,)


# --- interop with zarr-python -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=str)
def test_cloudckpt_arrays_open_in_zarr_python(tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    full = (torch.arange(48).reshape(6, 8) % 7).to(dtype)
    parts = [
        ShardedTensor.from_rank_offsets("layer.w", full[2 * i : 2 * i + 2], (0, i, 3))
        for i in range(3)
    ]
    scalar = torch.tensor(5, dtype=dtype)
    cloudckpt.save(
        {"w": parts, "s": ShardedTensor.from_rank_offsets("s", scalar)},
        str(tmp_path / "ck"),
        sharded_strategy=("zarr", 1),
    )
    array = zarr.open_array(str(tmp_path / "ck" / "layer.w"), mode="r")
    assert array.shape == (6, 8) and array.chunks == (2, 8)
    np.testing.assert_array_equal(array[:], full.numpy())
    np.testing.assert_array_equal(
        zarr.open_array(str(tmp_path / "ck" / "s"), mode="r")[()], scalar.numpy()
    )


def _load(sharded: dict[str, Any], uri: str) -> dict[str, Any]:
    """cloudckpt.load of part of a checkpoint in one process (no full-coverage check)."""
    result = cloudckpt.load(sharded, uri, validate_access_integrity=False)
    assert isinstance(result, dict)
    return result


def _megatron_like_checkpoint(root: pathlib.Path) -> dict[str, np.ndarray]:
    """Arrays written by zarr-python with compressors, plus Megatron's metadata and common."""
    root.mkdir()
    blosc = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
    w = np.random.default_rng(0).standard_normal((10, 7)).astype(np.float32)
    zarr.create_array(
        store=str(root / "w"),
        shape=w.shape,
        chunks=(4, 3),
        dtype="float32",
        zarr_format=2,
        compressors=blosc,
    )[:] = w
    s = np.arange(1, 31, dtype=np.int64).reshape(5, 6)
    zarr.create_array(
        store=str(root / "s"),
        shape=s.shape,
        chunks=(2, 4),
        dtype="int64",
        zarr_format=2,
        compressors=numcodecs.Zstd(level=3),
        order="F",
        chunk_key_encoding={"name": "v2", "separator": "/"},
    )[:] = s
    (root / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))
    torch.save({}, root / "common.pt")
    return {"w": w, "s": s}


def test_compressed_zarr_python_checkpoint_loads_with_resharding(tmp_path: pathlib.Path) -> None:
    arrays = _megatron_like_checkpoint(tmp_path / "ck")
    zarray = json.loads((tmp_path / "ck" / "w" / ".zarray").read_text())
    assert zarray["compressor"]["id"] == "blosc"
    uri = str(tmp_path / "ck")
    whole = {
        k: ShardedTensor.from_rank_offsets(k, torch.from_numpy(np.zeros_like(v)))
        for k, v in arrays.items()
    }
    loaded = _load(whole, uri)
    for key, value in arrays.items():
        assert torch.equal(loaded[key], torch.from_numpy(value))
    for r in range(2):  # rows of w halved, columns of s in thirds: boxes span chunks
        sd = {
            "w": ShardedTensor.from_rank_offsets("w", torch.empty(5, 7), (0, r, 2)),
            "s": ShardedTensor.from_rank_offsets(
                "s", torch.empty(5, 2, dtype=torch.int64), (1, r + 1, 3)
            ),
        }
        part = _load(sd, uri)
        assert torch.equal(part["w"], torch.from_numpy(arrays["w"][5 * r : 5 * r + 5]))
        cols = slice(2 * r + 2, 2 * r + 4)
        assert torch.equal(part["s"], torch.from_numpy(np.ascontiguousarray(arrays["s"][:, cols])))


def test_zarr_python_array_with_omitted_fill_value_chunk_loads(tmp_path: pathlib.Path) -> None:
    """zarr v2 spec: a missing chunk object reads as fill_value (zarr-python 3 omits chunks
    equal to it by default, e.g. a zero-initialised bias)."""
    root = tmp_path / "ck"
    _megatron_like_checkpoint(root)
    b = np.zeros((4, 4), dtype=np.float32)
    b[2:] = 1.5
    zarr.create_array(
        store=str(root / "b"),
        shape=b.shape,
        chunks=(2, 4),
        dtype="float32",
        zarr_format=2,
        fill_value=0,
    )[:] = b
    assert not (root / "b" / "0.0").exists() and (root / "b" / "1.0").exists()
    loaded = _load({"b": ShardedTensor.from_rank_offsets("b", torch.empty(4, 4))}, str(root))
    assert torch.equal(loaded["b"], torch.from_numpy(b))


# --- TensorReader ------------------------------------------------------------------------


class _CountingStorage(CheckpointStorage):
    """Real storage that counts read_many calls (one per batch)."""

    batches = 0

    def read_many(self, requests):  # type: ignore[no-untyped-def]
        self.batches += 1
        return super().read_many(requests)


def _saved(tmp_path: pathlib.Path) -> tuple[str, torch.Tensor, torch.Tensor]:
    a = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    b = torch.arange(30, dtype=torch.int16).reshape(6, 5)
    uri = str(tmp_path / "ck")
    cloudckpt.save(
        {
            "a": [
                ShardedTensor.from_rank_offsets("a", a[4 * i : 4 * i + 4], (0, i, 2))
                for i in range(2)
            ],
            "b": ShardedTensor.from_rank_offsets("b", b),
        },
        uri,
        sharded_strategy=("zarr", 1),
    )
    return uri, a, b


def test_tensor_reader_small_batches_stay_exact(tmp_path: pathlib.Path) -> None:
    uri, a, b = _saved(tmp_path)
    wanted = [ShardedTensor.from_rank_offsets("a", torch.empty(2, 8), (0, i, 4)) for i in range(4)]
    wanted += [
        ShardedTensor.from_rank_offsets("b", torch.empty(3, 5, dtype=torch.int16), (0, i, 2))
        for i in range(2)
    ]
    results = {}
    for batch_bytes, expect_batches in [(1 << 30, 1), (64, 5)]:  # 64: a0|a1|a2|a3|b0+b1
        storage = _CountingStorage(uri)
        reader = TensorReader(storage, batch_bytes=batch_bytes)
        results[batch_bytes] = reader.load_all(wanted)
        assert storage.batches == expect_batches + 1  # + one read of the .zarray files
        assert sorted(reader.array_keys()) == ["a", "b"]
    for i, sh in enumerate(wanted):
        expected = a[2 * i : 2 * i + 2] if i < 4 else b[3 * (i - 4) : 3 * (i - 4) + 3]
        assert torch.equal(results[64][id(sh)], expected)
        assert torch.equal(results[1 << 30][id(sh)], expected)


def test_tensor_reader_truncated_raw_chunk_raises(tmp_path: pathlib.Path) -> None:
    uri, _, _ = _saved(tmp_path)
    chunk = tmp_path / "ck" / "a" / "1.0"
    chunk.write_bytes(chunk.read_bytes()[:50])
    reader = TensorReader(CheckpointStorage(uri))
    request = [ShardedTensor.from_rank_offsets("a", torch.empty(4, 8), (0, 1, 2))]
    with pytest.raises(CheckpointingException, match=r"a/1\.0.*truncated"):
        reader.load_all(request)


def test_tensor_reader_truncated_compressed_chunk_raises(tmp_path: pathlib.Path) -> None:
    _megatron_like_checkpoint(tmp_path / "ck")
    chunk = tmp_path / "ck" / "s" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    reader = TensorReader(CheckpointStorage(str(tmp_path / "ck")))
    wanted = [ShardedTensor.from_rank_offsets("s", torch.empty(5, 6, dtype=torch.int64))]
    with pytest.raises(CheckpointingException, match=r"s/0/0"):  # names the broken chunk
        reader.load_all(wanted)


def test_tensor_reader_rejects_dtype_and_shape_mismatch(tmp_path: pathlib.Path) -> None:
    uri, _, _ = _saved(tmp_path)
    reader = TensorReader(CheckpointStorage(uri))
    with pytest.raises(CheckpointingException, match=r"'a'.*stored dtype torch.float32"):
        reader.load_all(
            [ShardedTensor.from_rank_offsets("a", torch.empty(8, 8, dtype=torch.float64))]
        )
    with pytest.raises(CheckpointingException, match="allow_shape_mismatch"):
        reader.load_all([ShardedTensor.from_rank_offsets("a", torch.empty(8, 9))])
    with pytest.raises(CheckpointKeyNotFoundError, match="nope"):
        reader.load_all([ShardedTensor.from_rank_offsets("nope", torch.empty(1))])
