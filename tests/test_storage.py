"""Tests for cloudckpt.storage over a local directory (path and file:// URI) and memory://."""

from __future__ import annotations

import pathlib
import threading
import uuid
from collections.abc import Callable, Iterator

import crc32c as crc32c_lib
import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from cloudckpt.errors import (
    CheckpointingException,
    CheckpointNotFoundError,
    InvalidKeyError,
    StorageError,
)
from cloudckpt.storage import (
    CheckpointStorage,
    ReadRequest,
    WriteResult,
    crc32c,
    open_checkpoint,
    validate_relpath,
)
from cloudckpt.zarr_format import tensor_bytes


@pytest.fixture(params=["path", "file-uri", "memory"])
def uri(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[str]:
    """A fresh checkpoint location; memory:// ones are removed afterwards."""
    if request.param == "path":
        yield str(tmp_path / "ckpt")
    elif request.param == "file-uri":
        yield (tmp_path / "ckpt").as_uri()
    else:
        prefix = f"memory://cloudckpt-test-storage/{uuid.uuid4().hex}"
        yield f"{prefix}/ckpt"
        fs = fsspec.filesystem("memory")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
        assert not fs.exists(prefix)


@pytest.fixture
def storage(uri: str) -> CheckpointStorage:
    return CheckpointStorage(uri)


def _payloads() -> list[tuple[str, bytes | bytearray | memoryview, bytes]]:
    """(id, buffer, the bytes it holds)."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = tensor_bytes(tensor)
    return [
        ("bytes", b"hello world", b"hello world"),
        ("bytearray", bytearray(b"\x00\x01\x02" * 100), bytes(b"\x00\x01\x02" * 100)),
        ("tensor-memoryview", view, tensor.numpy().tobytes()),
        ("empty", b"", b""),
    ]


# --- writes and reads -----------------------------------------------------------------


@pytest.mark.parametrize("case", _payloads(), ids=lambda c: c[0])
def test_write_read_round_trip_with_size_and_crc32c(
    storage: CheckpointStorage, case: tuple[str, bytes | bytearray | memoryview, bytes]
) -> None:
    _, data, expected = case
    result = storage.write("dir/obj", data)
    assert result == WriteResult("dir/obj", len(expected), crc32c_lib.crc32c(expected))
    assert storage.read("dir/obj") == expected
    assert storage.exists("dir/obj")


def test_write_of_non_contiguous_multi_dim_buffer(storage: CheckpointStorage) -> None:
    tensor = torch.arange(24, dtype=torch.int16).reshape(4, 6).t()  # not contiguous
    raw = tensor.contiguous().numpy().tobytes()
    result = storage.write("t", tensor_bytes(tensor))
    assert (result.size, result.crc32c) == (48, crc32c_lib.crc32c(raw))
    assert storage.read("t") == raw


def test_written_object_does_not_alias_the_tensor(storage: CheckpointStorage) -> None:
    tensor = torch.zeros(4, dtype=torch.float32)
    storage.write("t", tensor_bytes(tensor))
    tensor += 1
    assert storage.read("t") == bytes(16)


def test_crc32c_helper_extends_a_running_checksum() -> None:
    data = b"abcdefgh" * 1000
    assert crc32c(data) == crc32c_lib.crc32c(data)
    assert crc32c(data[4000:], crc32c(data[:4000])) == crc32c(data)


def test_write_replaces_previous_object(storage: CheckpointStorage) -> None:
    storage.write("x", b"first version, long")
    storage.write("x", b"second")
    assert storage.read("x") == b"second"


@pytest.mark.parametrize("max_in_flight", [1, 8])
def test_write_many_read_many_keep_order(uri: str, max_in_flight: int) -> None:
    storage = CheckpointStorage(uri, max_in_flight=max_in_flight)
    items = [(f"k{i:02d}/chunk", bytes([i]) * (i * 37 + 1)) for i in range(20)][::-1]
    results = storage.write_many(items)
    assert [r.path for r in results] == [p for p, _ in items]
    assert [(r.size, r.crc32c) for r in results] == [
        (len(d), crc32c_lib.crc32c(d)) for _, d in items
    ]
    requests = [ReadRequest(p) for p, _ in items] + [ReadRequest(items[3][0], 2, 9)]
    assert storage.read_many(requests) == [d for _, d in items] + [items[3][1][2:9]]


def test_map_bounds_concurrency_and_keeps_order(uri: str) -> None:
    storage = CheckpointStorage(uri, max_in_flight=3)
    lock, active, peak = threading.Lock(), [0], [0]
    barrier = threading.Barrier(3, timeout=10)

    def work(i: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        if i < 3:
            barrier.wait()  # the first three really run at once
        with lock:
            active[0] -= 1
        return i * i

    assert storage.map(work, list(range(12))) == [i * i for i in range(12)]
    assert peak[0] == 3


def test_max_in_flight_must_be_positive(uri: str) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        CheckpointStorage(uri, max_in_flight=0)


def test_write_many_and_read_many_accept_empty_input(storage: CheckpointStorage) -> None:
    assert storage.write_many([]) == []
    assert storage.read_many([]) == []


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [(0, None, b"0123456789"), (3, None, b"3456789"), (0, 4, b"0123"), (2, 7, b"23456"),
     (9, 10, b"9")],
)
def test_ranged_reads(storage: CheckpointStorage, start: int, end: int | None,
                      expected: bytes) -> None:
    storage.write("r", b"0123456789")
    assert storage.read("r", start, end) == expected
    assert storage.read_many([ReadRequest("r", start, end)]) == [expected]


def test_reading_missing_object_raises_not_found_naming_uri(storage: CheckpointStorage) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        storage.read("no/such/object")
    assert storage.uri.rstrip("/") + "/no/such/object" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, CheckpointingException)
    with pytest.raises(FileNotFoundError):
        storage.read_many([ReadRequest("missing", 0, 4)])


# --- metadata: exists, list, is_empty, delete -----------------------------------------


def test_exists_list_and_is_empty(storage: CheckpointStorage) -> None:
    assert storage.is_empty() and storage.list() == []
    assert not storage.exists("a/b/c")
    for path in ["z", "a/b/c", "a/b/d", "a/x", "m.n/0.0"]:
        storage.write(path, path.encode())
    assert storage.list() == ["a/b/c", "a/b/d", "a/x", "m.n/0.0", "z"]
    assert storage.list("a") == ["a/b/c", "a/b/d", "a/x"]
    assert storage.list("a/b") == ["a/b/c", "a/b/d"]
    assert storage.list("nothing/here") == []
    assert storage.exists("a/b/c") and storage.exists("z")
    assert not storage.is_empty()


def test_list_does_not_leak_sibling_prefixes(uri: str) -> None:
    """Objects of ``<uri>-other`` are not below ``<uri>``."""
    CheckpointStorage(uri + "-other").write("x", b"1")
    storage = CheckpointStorage(uri)
    storage.write("y", b"2")
    assert storage.list() == ["y"]
    CheckpointStorage(uri + "-other").delete("x")


def test_delete_single_recursive_and_missing(storage: CheckpointStorage) -> None:
    for path in ["a/b/c", "a/b/d", "a/e", "f"]:
        storage.write(path, b"x")
    storage.delete("f")
    assert not storage.exists("f")
    assert storage.list() == ["a/b/c", "a/b/d", "a/e"]
    storage.delete("a/b", recursive=True)
    assert storage.list() == ["a/e"]
    storage.delete("does/not/exist")  # no-op
    storage.delete("does/not/exist", recursive=True)
    storage.delete("a", recursive=True)
    assert storage.is_empty()


# --- keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "./a", "a\\b", "a/", "..", "a/."])
def test_validate_relpath_rejects_bad_keys(key: str) -> None:
    with pytest.raises(InvalidKeyError) as info:
        validate_relpath(key, "s3://bucket/ckpt")
    assert repr(key) in str(info.value) and "s3://bucket/ckpt" in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "key", ["decoder.layers.0.weight", "a/shard_0.1_2.4.pt", "a..b", ".zarray", "w/0.0"]
)
def test_validate_relpath_accepts_good_keys(key: str) -> None:
    assert validate_relpath(key, "s3://b/c") == key


@pytest.mark.parametrize(
    "op",
    [lambda s: s.write("../escape", b"x"), lambda s: s.read("a//b"),
     lambda s: s.exists("/abs"), lambda s: s.delete("./a"), lambda s: s.list("a/../b")],
    ids=["write", "read", "exists", "delete", "list"],
)
def test_storage_operations_raise_invalid_key_error(
    storage: CheckpointStorage, op: Callable[[CheckpointStorage], object]
) -> None:
    with pytest.raises(InvalidKeyError, match="in checkpoint"):
        op(storage)
    assert storage.is_empty()


# --- opening ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", None, 42, b"/tmp/x"])
def test_open_checkpoint_rejects_empty_and_non_str(bad: object) -> None:
    with pytest.raises(CheckpointNotFoundError, match="non-empty URI"):
        open_checkpoint(bad)  # type: ignore[arg-type]


def test_open_checkpoint_with_pathlib_path(tmp_path: pathlib.Path) -> None:
    storage = open_checkpoint(tmp_path / "ckpt")
    assert isinstance(storage.uri, str) and storage.uri == str(tmp_path / "ckpt")
    storage.write("k/0.0", b"abc")
    assert (tmp_path / "ckpt" / "k" / "0.0").read_bytes() == b"abc"
    assert CheckpointStorage(tmp_path / "ckpt").read("k/0.0") == b"abc"


def test_local_path_and_file_uri_address_the_same_objects(tmp_path: pathlib.Path) -> None:
    CheckpointStorage(str(tmp_path / "c")).write("x/y", b"same")
    assert CheckpointStorage((tmp_path / "c").as_uri()).read("x/y") == b"same"
    assert CheckpointStorage((tmp_path / "c").as_uri()).list() == ["x/y"]


def test_explicit_filesystem_is_used(tmp_path: pathlib.Path) -> None:
    fs = LocalFileSystem()
    storage = open_checkpoint(str(tmp_path / "ckpt"), fs=fs)
    assert storage.fs is fs
    storage.write("a/b", b"payload")
    assert (tmp_path / "ckpt" / "a" / "b").read_bytes() == b"payload"
    assert storage.list() == ["a/b"]


def test_explicit_memory_filesystem_with_uri() -> None:
    fs = fsspec.filesystem("memory")
    prefix = f"memory://cloudckpt-test-storage/{uuid.uuid4().hex}"
    storage = CheckpointStorage(prefix + "/ckpt", fs=fs)
    try:
        storage.write("a/b", b"x" * 10)
        assert fs.cat_file(fs._strip_protocol(prefix + "/ckpt/a/b")) == b"x" * 10
        assert storage.list() == ["a/b"] and storage.read("a/b", 8) == b"xx"
    finally:
        fs.rm(prefix, recursive=True)


def test_storage_options_are_passed_to_the_filesystem(tmp_path: pathlib.Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "c"), storage_options={"auto_mkdir": True})
    assert storage.fs.auto_mkdir is True
    storage.write("deep/er/obj", b"1")
    assert storage.read("deep/er/obj") == b"1"


# --- failures --------------------------------------------------------------------------


def test_failed_write_raises_storage_error_naming_uri(tmp_path: pathlib.Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    storage.write("blocker", b"a file")
    with pytest.raises(StorageError) as info:
        storage.write("blocker/child", b"cannot go below a file")
    assert isinstance(info.value, OSError) and isinstance(info.value, CheckpointingException)
    assert str(tmp_path / "ckpt") + "/blocker/child" in str(info.value)
    assert info.value.__cause__ is not None


def test_failed_write_many_raises_storage_error(tmp_path: pathlib.Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"), max_in_flight=4)
    storage.write("blocker", b"a file")
    items = [(f"ok{i}", b"x") for i in range(5)] + [("blocker/child", b"y")]
    with pytest.raises(StorageError, match="blocker/child"):
        storage.write_many(items)


def test_reading_a_directory_is_an_error(tmp_path: pathlib.Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    storage.write("dir/obj", b"x")
    with pytest.raises(OSError, match="dir"):
        storage.read("dir")


def test_repr_and_child_uri(uri: str) -> None:
    storage = CheckpointStorage(uri + "/")
    assert repr(storage) == f"CheckpointStorage({uri + '/'!r})"
    assert storage.child_uri("a/b") == uri + "/a/b"
