"""Tests for cloudckpt.storage on every kind of location.

Most tests run over the ``location`` fixture: a local directory (as a path and as a
``file://`` URI), memory://, the S3 API (moto, or ``CLOUDCKPT_TEST_S3_ENDPOINT``) and the
GCS emulator (see ``tests/fixtures_object_stores.py``). Where backends differ (object
stores have no directories), the tests assert each backend's behaviour.
"""

from __future__ import annotations

import pathlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

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
from cloudckpt.formats.tensor_bytes import tensor_bytes
from cloudckpt.storage import (
    CheckpointStorage,
    ReadRequest,
    WriteResult,
    crc32c,
    open_checkpoint,
    validate_relpath,
)
from cloudckpt.storage.staging import StagingStorage
from tests.fixtures_object_stores import STORE_CASES, bucket_location

StoreLocation = tuple[str, dict[str, Any]]

# The checkpoint_uri cases plus "file-uri": the local directory spelled file:///...
LOCATIONS = ["local", "file-uri", "memory", *STORE_CASES]
LOCAL_KINDS = {"local", "file-uri"}
OBJECT_STORE_KINDS = set(STORE_CASES)


@pytest.fixture(params=LOCATIONS)
def kind(request: pytest.FixtureRequest) -> str:
    """Which kind of location ``location`` is."""
    return str(request.param)


@pytest.fixture
def location(
    kind: str, request: pytest.FixtureRequest, tmp_path: pathlib.Path
) -> Iterator[StoreLocation]:
    """A fresh checkpoint location ``(uri, storage_options)``; memory:// ones are removed
    afterwards, buckets by their fixtures."""
    if kind == "local":
        yield str(tmp_path / "ckpt"), {}
    elif kind == "file-uri":
        yield (tmp_path / "ckpt").as_uri(), {}
    elif kind == "memory":
        prefix = f"memory://cloudckpt-test-storage/{uuid.uuid4().hex}"
        yield f"{prefix}/ckpt", {}
        fs = fsspec.filesystem("memory")
        if fs.exists(prefix):
            fs.rm(prefix, recursive=True)
        assert not fs.exists(prefix)
    else:
        bucket_uri, options = bucket_location(request, kind)
        yield f"{bucket_uri}/run/ckpt", options


def _storage(location: StoreLocation, **kwargs: Any) -> CheckpointStorage:
    uri, options = location
    return CheckpointStorage(uri, storage_options=options, **kwargs)


@pytest.fixture
def storage(location: StoreLocation) -> CheckpointStorage:
    return _storage(location)


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
    location: StoreLocation, case: tuple[str, bytes | bytearray | memoryview, bytes]
) -> None:
    _, data, expected = case
    storage = _storage(location)
    result = storage.write("dir/obj", data)
    assert result == WriteResult("dir/obj", len(expected), crc32c_lib.crc32c(expected))
    assert storage.read("dir/obj") == expected
    assert storage.exists("dir/obj")
    assert _storage(location).read("dir/obj") == expected  # a fresh filesystem instance


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
def test_write_many_read_many_keep_order(location: StoreLocation, max_in_flight: int) -> None:
    storage = _storage(location, max_in_flight=max_in_flight)
    items = [(f"k{i:02d}/chunk", bytes([i]) * (i * 37 + 1)) for i in range(20)][::-1]
    results = storage.write_many(items)
    assert [r.path for r in results] == [p for p, _ in items]
    assert [(r.size, r.crc32c) for r in results] == [
        (len(d), crc32c_lib.crc32c(d)) for _, d in items
    ]
    requests = [ReadRequest(p) for p, _ in items] + [ReadRequest(items[3][0], 2, 9)]
    assert storage.read_many(requests) == [d for _, d in items] + [items[3][1][2:9]]


def test_map_bounds_concurrency_and_keeps_order(location: StoreLocation) -> None:
    storage = _storage(location, max_in_flight=3)
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


def test_max_in_flight_must_be_positive(location: StoreLocation) -> None:
    with pytest.raises(ValueError, match="max_in_flight"):
        _storage(location, max_in_flight=0)


def test_write_many_and_read_many_accept_empty_input(storage: CheckpointStorage) -> None:
    assert storage.write_many([]) == []
    assert storage.read_many([]) == []


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, None, b"0123456789"),
        (3, None, b"3456789"),
        (0, 4, b"0123"),
        (2, 7, b"23456"),
        (9, 10, b"9"),
        (0, 10, b"0123456789"),
    ],
)
def test_ranged_reads(
    storage: CheckpointStorage, start: int, end: int | None, expected: bytes
) -> None:
    storage.write("r", b"0123456789")
    assert storage.read("r", start, end) == expected
    assert storage.read_many([ReadRequest("r", start, end)]) == [expected]


@pytest.mark.parametrize(
    ("start", "end"), [(4, 4), (0, 0), (10, None)], ids=["inside", "at-start", "at-end"]
)
def test_empty_byte_ranges_read_as_empty(
    storage: CheckpointStorage, start: int, end: int | None
) -> None:
    """``read(path, start, end)`` reads the half-open range ``[start, end)``: an empty
    range, or one starting at the end of the object, is ``b""`` (as Python slicing)."""
    storage.write("r", b"0123456789")

    def outcome(call: Callable[[], object]) -> object:
        try:
            return call()
        except StorageError as exc:
            return exc

    read = outcome(lambda: storage.read("r", start, end))
    read_into = outcome(lambda: storage.read_into("r", memoryview(bytearray(0)), start))
    assert (read, read_into) == (b"", None), (
        f"on {storage.uri}, a 10-byte object: read('r', {start}, {end}) should be b'' and "
        f"read_into of 0 bytes at offset {start} return None (the range [{start}, "
        f"{end if end is not None else 10}) is empty); got {read!r} and {read_into!r}"
    )


def test_reading_missing_object_raises_not_found_naming_uri(storage: CheckpointStorage) -> None:
    with pytest.raises(CheckpointNotFoundError) as info:
        storage.read("no/such/object")
    assert storage.uri.rstrip("/") + "/no/such/object" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, CheckpointingException)
    with pytest.raises(FileNotFoundError):
        storage.read_many([ReadRequest("missing", 0, 4)])


# --- metadata: exists, list, is_empty, delete -----------------------------------------


def test_exists_list_and_is_empty(location: StoreLocation) -> None:
    storage = _storage(location)
    assert storage.is_empty() and storage.list() == []
    assert not storage.exists("a/b/c")
    for path in ["z", "a/b/c", "a/b/d", "a/x", "m.n/0.0"]:
        storage.write(path, path.encode())
    for seen in (storage, _storage(location)):  # and through a fresh filesystem instance
        assert seen.list() == ["a/b/c", "a/b/d", "a/x", "m.n/0.0", "z"]
        assert seen.list("a") == ["a/b/c", "a/b/d", "a/x"]
        assert seen.list("a/b") == ["a/b/c", "a/b/d"]
        assert seen.list("nothing/here") == []
        assert seen.exists("a/b/c") and seen.exists("z")
        assert not seen.exists("a/b/e") and not seen.exists("nothing")
        assert not seen.is_empty()


def test_list_does_not_leak_sibling_prefixes(location: StoreLocation) -> None:
    """Objects of ``<uri>-other`` are not below ``<uri>``."""
    uri, options = location
    other = CheckpointStorage(uri + "-other", storage_options=options)
    other.write("x", b"1")
    storage = _storage(location)
    storage.write("y", b"2")
    assert storage.list() == ["y"]
    assert other.list() == ["x"]
    other.delete("x")


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


def test_prefixes_on_each_backend(kind: str, location: StoreLocation) -> None:
    """A prefix with objects below it: a directory locally, nothing of its own elsewhere."""
    storage = _storage(location)
    storage.write("dir/obj", b"x")
    assert storage.list("dir") == ["dir/obj"]
    # exists() is about objects: a prefix with objects below it (a local directory,
    # memory://'s pseudo-directory, an S3/GCS key prefix) is not one.
    assert not storage.exists("dir")
    assert storage.exists("dir/obj")
    if kind in LOCAL_KINDS:
        # A directory: reading it fails, and only a recursive delete removes it.
        with pytest.raises(StorageError, match="dir") as info:
            storage.read("dir")
        assert isinstance(info.value.__cause__, IsADirectoryError)
        with pytest.raises(StorageError, match="dir"):
            storage.delete("dir")
    else:
        # No object named "dir": reading it is "not found", deleting it a no-op.
        with pytest.raises(CheckpointNotFoundError, match="dir"):
            storage.read("dir")
        storage.delete("dir")
    assert storage.list() == ["dir/obj"]


def test_a_key_below_an_existing_object(kind: str, location: StoreLocation) -> None:
    """``blocker`` and ``blocker/child`` can coexist on object stores, not on a filesystem."""
    storage = _storage(location)
    storage.write("blocker", b"a file")
    if kind in OBJECT_STORE_KINDS:
        storage.write("blocker/child", b"below it")
        assert storage.list() == ["blocker", "blocker/child"]
        assert storage.read("blocker") == b"a file"
        assert storage.read("blocker/child") == b"below it"
    else:
        with pytest.raises(StorageError) as info:
            storage.write("blocker/child", b"cannot go below a file")
        assert storage.child_uri("blocker/child") in str(info.value)
        assert isinstance(info.value.__cause__, FileExistsError)
        assert storage.list() == ["blocker"]


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
    [
        lambda s: s.write("../escape", b"x"),
        lambda s: s.read("a//b"),
        lambda s: s.exists("/abs"),
        lambda s: s.delete("./a"),
        lambda s: s.list("a/../b"),
    ],
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
    # Local only: pathlib paths are local paths.
    storage = open_checkpoint(tmp_path / "ckpt")
    assert isinstance(storage.uri, str) and storage.uri == str(tmp_path / "ckpt")
    storage.write("k/0.0", b"abc")
    assert (tmp_path / "ckpt" / "k" / "0.0").read_bytes() == b"abc"
    assert CheckpointStorage(tmp_path / "ckpt").read("k/0.0") == b"abc"


def test_local_path_and_file_uri_address_the_same_objects(tmp_path: pathlib.Path) -> None:
    # Local only: the two spellings of one local directory.
    CheckpointStorage(str(tmp_path / "c")).write("x/y", b"same")
    assert CheckpointStorage((tmp_path / "c").as_uri()).read("x/y") == b"same"
    assert CheckpointStorage((tmp_path / "c").as_uri()).list() == ["x/y"]


def test_open_checkpoint_with_storage_options(location: StoreLocation) -> None:
    uri, options = location
    storage = open_checkpoint(uri, storage_options=options)
    assert storage.uri == uri
    for name, value in options.items():
        if name != "skip_instance_cache":  # consumed by fsspec's instance cache
            assert storage.fs.storage_options[name] == value
    storage.write("a/b", b"payload")
    assert CheckpointStorage(uri, storage_options=options).read("a/b") == b"payload"


def test_explicit_filesystem_is_used(location: StoreLocation) -> None:
    uri, options = location
    fs, root = fsspec.core.url_to_fs(uri, **options)
    storage = open_checkpoint(uri, fs=fs)
    assert storage.fs is fs
    storage.write("a/b", b"x" * 10)
    assert fs.cat_file(f"{root}/a/b") == b"x" * 10
    assert storage.list() == ["a/b"] and storage.read("a/b", 8) == b"xx"


def test_explicit_local_filesystem_with_a_path(tmp_path: pathlib.Path) -> None:
    # Local only: checks the bytes on disk.
    fs = LocalFileSystem()
    storage = open_checkpoint(str(tmp_path / "ckpt"), fs=fs)
    assert storage.fs is fs
    storage.write("a/b", b"payload")
    assert (tmp_path / "ckpt" / "a" / "b").read_bytes() == b"payload"
    assert storage.list() == ["a/b"]


def test_local_storage_options_are_passed_to_the_filesystem(tmp_path: pathlib.Path) -> None:
    # Local only: auto_mkdir is an option of the local filesystem.
    storage = CheckpointStorage(str(tmp_path / "c"), storage_options={"auto_mkdir": True})
    assert storage.fs.auto_mkdir is True
    storage.write("deep/er/obj", b"1")
    assert storage.read("deep/er/obj") == b"1"


# --- failures --------------------------------------------------------------------------


def _failing_write(kind: str, location: StoreLocation) -> tuple[CheckpointStorage, str]:
    """A storage and a key whose write fails: below an existing file on a filesystem,
    into a bucket that does not exist on an object store."""
    if kind in OBJECT_STORE_KINDS:
        uri, options = location
        scheme, _, rest = uri.partition("://")
        _, _, path = rest.partition("/")
        missing = f"{scheme}://cloudckpt-no-such-bucket-{uuid.uuid4().hex[:12]}/{path}"
        return CheckpointStorage(missing, storage_options=options, max_in_flight=4), "obj"
    storage = _storage(location, max_in_flight=4)
    storage.write("blocker", b"a file")
    return storage, "blocker/child"


def test_failed_write_raises_storage_error_naming_uri(kind: str, location: StoreLocation) -> None:
    storage, key = _failing_write(kind, location)
    with pytest.raises(StorageError) as info:
        storage.write(key, b"cannot be written")
    assert isinstance(info.value, OSError) and isinstance(info.value, CheckpointingException)
    assert storage.child_uri(key) in str(info.value)
    assert info.value.__cause__ is not None


def test_failed_write_many_raises_storage_error(kind: str, location: StoreLocation) -> None:
    storage, key = _failing_write(kind, location)
    items = [(f"ok{i}", b"x") for i in range(5)] + [(key, b"y")]
    # The first failure in the order of items: every write fails on a missing bucket.
    first_failure = "ok0" if kind in OBJECT_STORE_KINDS else key
    with pytest.raises(StorageError) as info:
        storage.write_many(items)
    assert storage.child_uri(first_failure) in str(info.value)
    if kind not in OBJECT_STORE_KINDS:
        assert storage.list() == ["blocker"] + [p for p, _ in items[:-1]]


def test_repr_and_child_uri(location: StoreLocation) -> None:
    uri, options = location
    storage = CheckpointStorage(uri + "/", storage_options=options)
    assert repr(storage) == f"CheckpointStorage({uri + '/'!r})"
    assert storage.child_uri("a/b") == uri + "/a/b"


def test_staging_copies_only_buffers_the_caller_may_change(tmp_path: pathlib.Path) -> None:
    """An async save's staging holds the state once: a caller's bytearray is copied (the
    caller may change it after staging); immutable bytes and buffers handed over
    (owned=True) are kept as they are; the upload writes exactly what was staged."""
    storage = CheckpointStorage(str(tmp_path / "ckpt"))
    staging = StagingStorage.over(storage)
    mutable, handed, frozen = bytearray(b"a" * 10), bytearray(b"b" * 10), b"c" * 10
    results = staging.write_many([("m", mutable), ("f", frozen)])
    results += staging.write_many([("h", handed)], owned=True)
    assert [r.size for r in results] == [10, 10, 10] and staging.staged_bytes == 30
    mutable[:] = b"x" * 10  # the training step changes its state after staging
    kept = {path: view for path, view in staging._staged}
    assert kept["m"].obj is not mutable and kept["h"].obj is handed and kept["f"].obj is frozen
    staging.upload()
    assert storage.read("m") == b"a" * 10 and storage.read("h") == b"b" * 10
    assert storage.read("f") == b"c" * 10 and staging.staged_bytes == 0
