"""S3 listings, lookups and deletes, each request one of cloudckpt's own, retried by
the S3 transport's policy (:meth:`S3Transport.call <cloudckpt.storage.s3.S3Transport.call>`:
one botocore attempt per try within ``retry.attempt_timeout_s``, ``retry.request_timeout_s``
per request, ``retry.operation_timeout_s`` per opened checkpoint).

Through s3fs these requests went with botocore's attempts inside s3fs's own retry loop,
outside that policy: with a store that stopped answering (every response held), a save's
first listing took 155 s, ``cloudckpt verify`` 158 s and ``cloudckpt ls`` 150 s at
``request_timeout_s=5``, and ended in a ``StorageError`` rather than a timeout.

What s3fs answered is kept (checked on moto and SeaweedFS): a recursive listing is one
paginated ListObjectsV2 without delimiter (``fs.find``: every key, directory-marker keys
included, which :mod:`.listing` drops); a listing of one level is ListObjectsV2 with
``Delimiter='/'`` (``fs.ls``: a directory entry per common prefix; SeaweedFS keeps
prefixes whose objects were deleted); a missing bucket reads as ``FileNotFoundError``.
Two requests fewer per listing than s3fs, which looked the prefix up (HEAD, then a
listing) before listing it. A lookup is one HEAD; a delete one DeleteObject, or
DeleteObjects batches of up to 1000 keys for a prefix.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import Any, Protocol

from cloudckpt.storage.edge import AUTH_ERROR_CODES, error_code, io_errors
from cloudckpt.storage.location import Location
from cloudckpt.storage.transport import Listed


class S3Caller(Protocol):
    """What these requests need of the S3 transport (:class:`~cloudckpt.storage.s3.
    S3Transport`): its filesystem and location, and its retried :meth:`call`."""

    @property
    def fs(self) -> Any: ...
    @property
    def location(self) -> Location: ...
    def call(self, method: str, **kwargs: Any) -> Any: ...


NOT_FOUND = ("NoSuchKey", "404", "NotFound", "NoSuchBucket")
NO_SUCH_BUCKET = ("NoSuchBucket",)
DELETE_BATCH = 1000  # keys per DeleteObjects request: S3's limit


def list_objects(transport: S3Caller, path: str) -> list[Listed]:
    """Every key below the prefix ``path`` (one paginated ListObjectsV2)."""
    bucket, prefix = _bucket_and_prefix(transport, path)
    return [
        _entry(bucket, found)
        for page in _pages(transport, bucket, prefix)
        for found in page.get("Contents", [])
    ]


def list_level(transport: S3Caller, path: str) -> list[Listed]:
    """The keys and common prefixes directly below the prefix ``path``."""
    bucket, prefix = _bucket_and_prefix(transport, path)
    entries: list[Listed] = []
    for page in _pages(transport, bucket, prefix, Delimiter="/"):
        entries += [
            Listed(f"{bucket}/{common['Prefix'].rstrip('/')}", 0, directory=True)
            for common in page.get("CommonPrefixes", [])
        ]
        entries += [_entry(bucket, found) for found in page.get("Contents", [])]
    return entries


def is_file(transport: S3Caller, path: str) -> bool:
    """Whether the object ``path`` exists (one HEAD; a prefix is not one)."""
    _, key, _ = transport.fs.split_path(path)
    if not key or key.endswith("/"):
        return False
    try:
        _head(transport, path)
    except FileNotFoundError:
        return False
    return True


def size(transport: S3Caller, path: str) -> int:
    """The size of the object ``path`` (one HEAD; ``FileNotFoundError`` without one)."""
    return int(_head(transport, path).get("ContentLength") or 0)


def _head(transport: S3Caller, path: str) -> dict[str, Any]:
    bucket, key, version = transport.fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    try:
        return dict(transport.call("head_object", Bucket=bucket, Key=key, **extra))
    except io_errors() as exc:
        if error_code(exc) in NOT_FOUND:
            raise FileNotFoundError(f"no such object: {path}") from exc
        raise


def delete(transport: S3Caller, path: str, recursive: bool = False) -> None:
    """Delete the object ``path`` (one DeleteObject); with ``recursive`` also every key
    below it, and the "directories" between (SeaweedFS removes an emptied one only when
    its name is deleted): DeleteObjects batches, deepest names last but the prefix's own.

    Raises:
        FileNotFoundError: the bucket does not exist.
        OSError: the store refused to delete some keys (``PermissionError`` for access).
    """
    bucket, key, _ = transport.fs.split_path(path)
    if not recursive:
        try:
            transport.call("delete_object", Bucket=bucket, Key=key)
        except io_errors() as exc:
            if error_code(exc) in NOT_FOUND:
                raise FileNotFoundError(f"cannot delete {path}: {exc}") from exc
            raise
        return
    prefix = key.rstrip("/") + "/" if key else ""
    pages = _pages(transport, bucket, prefix)
    keys = [str(found["Key"]) for page in pages for found in page["Contents"]]
    doomed = keys + _directories_between(prefix, keys) + ([key] if key else [])
    for start in range(0, len(doomed), DELETE_BATCH):
        _delete_batch(transport, bucket, doomed[start : start + DELETE_BATCH])


def bucket_exists(transport: S3Caller) -> bool:
    """Whether the root's bucket exists: one listing of at most one key under the root,
    which needs only the permission the listing itself had (a HEAD of the bucket may be
    refused to credentials allowed one prefix) and fails with NoSuchBucket only
    without a bucket."""
    bucket, key, _ = transport.fs.split_path(transport.location.root)
    try:
        transport.call("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except io_errors() as exc:
        if error_code(exc) in NO_SUCH_BUCKET:
            return False
        raise
    return True


def _bucket_and_prefix(transport: S3Caller, path: str) -> tuple[str, str]:
    bucket, key, _ = transport.fs.split_path(path)
    return bucket, key.rstrip("/") + "/" if key else ""


def _pages(transport: S3Caller, bucket: str, prefix: str, **extra: Any) -> Iterator[dict[str, Any]]:
    """The pages of one ListObjectsV2 listing, each one retried request (every page
    holds ``Contents``, empty or not)."""
    token: dict[str, str] = {}
    while True:
        try:
            page = transport.call("list_objects_v2", Bucket=bucket, Prefix=prefix, **extra, **token)
        except io_errors() as exc:
            if error_code(exc) in NO_SUCH_BUCKET:
                raise FileNotFoundError(f"no such bucket: {bucket}") from exc
            raise
        yield {**page, "Contents": page.get("Contents") or []}
        if not page.get("IsTruncated"):
            return
        token = {"ContinuationToken": page["NextContinuationToken"]}


def _entry(bucket: str, found: dict[str, Any]) -> Listed:
    key, size = str(found["Key"]), int(found.get("Size") or 0)
    return Listed(f"{bucket}/{key}", size, directory=key.endswith("/") and not size)


def _directories_between(prefix: str, keys: list[str]) -> list[str]:
    """The names of the "directories" below ``prefix`` that hold ``keys``, deepest
    first, without those that are keys themselves."""
    present = set(keys)
    found: set[str] = set()
    for key in keys:
        parent = posixpath.dirname(key.rstrip("/"))
        while parent and parent.startswith(prefix) and parent not in found:
            found.add(parent)
            parent = posixpath.dirname(parent)
    return sorted(found - present, key=lambda name: (-name.count("/"), name))


def _delete_batch(transport: S3Caller, bucket: str, keys: list[str]) -> None:
    """One DeleteObjects request (retried: deleting again is harmless)."""
    response = transport.call(
        "delete_objects",
        Bucket=bucket,
        Delete={"Objects": [{"Key": key} for key in keys], "Quiet": True},
    )
    refused = response.get("Errors") or []
    if refused:
        first = refused[0]
        code = str(first.get("Code", ""))
        kind = PermissionError if code in AUTH_ERROR_CODES else OSError
        raise kind(
            f"{len(refused)} of {len(keys)} keys not deleted; {first.get('Key')}: {code} "
            f"{first.get('Message', '')}"
        )
