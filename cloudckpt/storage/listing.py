"""Listings of a checkpoint's objects: objects only, on every store (no "directory"
entries, which s3fs reports for prefixes and SeaweedFS keeps after their objects are
deleted; no directory-marker keys; not the root itself), sorted, with sizes.

The requests are the transport's (:meth:`Transport.list_objects
<cloudckpt.storage.transport.Transport.list_objects>` and the rest): on S3 each is one
of cloudckpt's own, under its retries and deadlines (:mod:`.s3_listing`)."""

from __future__ import annotations

import posixpath

from cloudckpt.errors import BucketNotFoundError
from cloudckpt.storage.edge import io_errors, translate
from cloudckpt.storage.location import StoreKind
from cloudckpt.storage.transport import Listed, Transport


def list_sizes(transport: Transport, base: str) -> dict[str, int]:
    """``{path relative to the root: size}`` of every object below ``base`` (a path of
    the filesystem at or below the root), sorted, from one recursive listing."""
    location = transport.location
    try:
        found = transport.list_objects(base)
    except FileNotFoundError:
        found = []
    except io_errors() as exc:
        raise translate(exc, f"failed to list {location.uri}: {exc}") from exc
    root = _root(transport)
    prefix_len = len(root) + 1 if root else 0
    sizes: dict[str, int] = {}
    for entry in sorted(found, key=lambda entry: entry.name):
        if entry.directory or entry.name.rstrip("/") == root:
            continue
        sizes[entry.name[prefix_len:]] = entry.size
    if not sizes:
        require_bucket(transport)
    return sizes


def list_children(transport: Transport) -> list[str]:
    """Names of the immediate sub-prefixes ("directories") of the root, sorted."""
    location = transport.location
    try:
        entries: list[Listed] = transport.list_level(location.root)
    except FileNotFoundError:
        entries = []
    except io_errors() as exc:
        raise translate(exc, f"failed to list {location.uri}: {exc}") from exc
    root = _root(transport)
    names = set()
    for entry in entries:
        path = entry.name.rstrip("/")
        if entry.directory and path != root:
            names.add(posixpath.basename(path))
    if not names:
        require_bucket(transport)
    return sorted(names)


def require_bucket(transport: Transport) -> None:
    """After a listing found nothing on S3 or GCS: raise if the URI's bucket does not
    exist (one request), so that a mistyped bucket is not an empty prefix (``latest``
    would answer None and a job would start from scratch).

    Raises:
        BucketNotFoundError: naming the bucket and the URI.
    """
    location = transport.location
    if location.kind not in (StoreKind.S3, StoreKind.GCS):
        return
    bucket = _root(transport).split("/", 1)[0]
    if not bucket:
        return
    try:
        exists = transport.bucket_exists()
    except io_errors() as exc:
        raise translate(exc, f"failed to look up the bucket of {location.uri}: {exc}") from exc
    if not exists:
        raise _bucket_not_found(bucket, location.uri)


def _root(transport: Transport) -> str:
    location = transport.location
    return str(location.fs._strip_protocol(location.root)).rstrip("/")


def _bucket_not_found(bucket: str, uri: str) -> BucketNotFoundError:
    """``bucket 'B' of URI does not exist``."""
    return BucketNotFoundError(
        f"bucket {bucket!r} of {uri!r} does not exist (or these credentials cannot see "
        "it): check the URI's bucket name",
        bucket,
    )
