"""Listings of a checkpoint's objects: objects only, on every store (no "directory"
entries, which s3fs reports for prefixes and SeaweedFS keeps after their objects are
deleted; no directory-marker keys; not the root itself)."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import BucketNotFoundError
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.location import Location, StoreKind


def list_sizes(location: Location, base: str) -> dict[str, int]:
    """``{path relative to the root: size}`` of every object below ``base`` (a path of
    the filesystem at or below the root), sorted, from one recursive listing."""
    fs = location.fs
    try:
        found = fs.find(base, withdirs=False, detail=True) if fs.exists(base) else {}
    except FileNotFoundError:
        found = {}
    except io_errors() as exc:
        raise translate(exc, f"failed to list {location.uri}: {exc}") from exc
    root = fs._strip_protocol(location.root).rstrip("/")
    prefix_len = len(root) + 1 if root else 0
    sizes: dict[str, int] = {}
    for path, info in sorted(found.items()):
        name = fs._strip_protocol(path)
        if is_directory_entry(name, info) or name.rstrip("/") == root:
            continue
        sizes[name[prefix_len:]] = int(info.get("size") or 0)
    if not sizes:
        require_bucket(location)
    return sizes


def list_children(location: Location) -> list[str]:
    """Names of the immediate sub-prefixes ("directories") of the root, sorted."""
    fs = location.fs
    try:
        entries = fs.ls(location.root, detail=True) if fs.exists(location.root) else []
    except FileNotFoundError:
        entries = []
    except io_errors() as exc:
        raise translate(exc, f"failed to list {location.uri}: {exc}") from exc
    root = fs._strip_protocol(location.root).rstrip("/")
    names = set()
    for entry in entries:
        path = fs._strip_protocol(entry["name"]).rstrip("/")
        if entry.get("type") == "directory" and path != root:
            names.add(posixpath.basename(path))
    if not names:
        require_bucket(location)
    return sorted(names)


def require_bucket(location: Location) -> None:
    """After a listing found nothing on S3 or GCS: raise if the URI's bucket does not
    exist (one request), so that a mistyped bucket is not an empty prefix (``latest``
    would answer None and a job would start from scratch).

    Raises:
        BucketNotFoundError: naming the bucket and the URI.
    """
    if location.kind not in (StoreKind.S3, StoreKind.GCS):
        return
    fs = location.fs
    bucket = fs._strip_protocol(location.root).split("/", 1)[0]
    if not bucket:
        return
    try:
        exists = _s3_bucket_exists(location) if location.kind is StoreKind.S3 else fs.exists(bucket)
    except io_errors() as exc:
        raise translate(exc, f"failed to look up the bucket of {location.uri}: {exc}") from exc
    if not exists:
        raise _bucket_not_found(bucket, location.uri)


def _s3_bucket_exists(location: Location) -> bool:
    """One listing of at most one key under the root: it needs only the permission the
    listing itself had (a HEAD of the bucket may be refused to credentials allowed one
    prefix), and fails with NoSuchBucket (s3fs: FileNotFoundError) only without a bucket."""
    bucket, key, _ = location.fs.split_path(location.root)
    try:
        location.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except FileNotFoundError:
        return False
    return True


def _bucket_not_found(bucket: str, uri: str) -> BucketNotFoundError:
    """``bucket 'B' of URI does not exist``."""
    return BucketNotFoundError(
        f"bucket {bucket!r} of {uri!r} does not exist (or these credentials cannot see "
        "it): check the URI's bucket name",
        bucket,
    )


def is_directory_entry(name: str, info: Mapping[str, Any]) -> bool:
    """A listing entry that is a "directory", not an object: typed so by the filesystem,
    or a zero-size key ending in ``/`` (a directory marker object)."""
    if info.get("type") == "directory":
        return True
    key = str(info.get("Key") or info.get("name") or name)
    return (key.endswith("/") or name.endswith("/")) and not int(info.get("size") or 0)
