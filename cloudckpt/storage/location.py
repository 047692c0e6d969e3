"""Where a checkpoint lives: a URI resolved once into an fsspec filesystem, a root
path and the kind of store (which picks the transport), plus the check that a key
from a state dict is usable as an object path below that root."""

from __future__ import annotations

import copy
import os
import posixpath
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import PurePath
from typing import Any, Union

import fsspec
from fsspec.implementations.local import LocalFileSystem

from cloudckpt.config import CheckpointConfig, resolve_storage_options
from cloudckpt.errors import CheckpointingException, InvalidKeyError, InvalidURIError, StorageError
from cloudckpt.logfilter import install as install_log_filter
from cloudckpt.redact import redact_text, redact_uri, remember_secrets
from cloudckpt.retry_policy import RetryPolicy
from cloudckpt.storage.edge import io_errors, translate

CheckpointDir = Union[str, "os.PathLike[str]"]
"""A checkpoint location: a URI or local path string, or a local ``os.PathLike``."""

_BROKEN_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/[^/]")


def checkpoint_uri(checkpoint_dir: CheckpointDir) -> str:
    """Return ``checkpoint_dir`` as a ``str`` URI or path.

    Args:
        checkpoint_dir: a URI or path string, or an ``os.PathLike`` local path.

    Raises:
        CheckpointingException: the value is not a string or path, or it is a
            ``pathlib`` path that swallowed a URI's ``//`` (``Path("s3://b/k")``).
    """
    try:
        uri = os.fspath(checkpoint_dir)
    except TypeError as exc:
        raise CheckpointingException(
            f"checkpoint location must be a str URI or os.PathLike, got {checkpoint_dir!r}"
        ) from exc
    if not isinstance(uri, str):
        raise CheckpointingException(f"checkpoint location must be text, got {uri!r}")
    if isinstance(checkpoint_dir, PurePath) and _BROKEN_URI.match(uri):
        raise CheckpointingException(
            f"checkpoint location {uri!r} is a pathlib path made from a URI, which lost "
            "its '//'; pass the URI as a str"
        )
    return uri


S3_PROTOCOLS = ("s3", "s3a")
GCS_PROTOCOLS = ("gs", "gcs")
DATA_CONNECT_TIMEOUT_S = 10.0  # botocore's default is 60 s


class StoreKind(Enum):
    """The kind of store behind a filesystem: it chooses the transport, once."""

    LOCAL = "local"
    MEMORY = "memory"
    S3 = "s3"
    GCS = "gcs"
    OTHER = "other"


class MissingDependencyError(StorageError):
    """The URI's store needs a package that is not installed (e.g. s3fs for ``s3://``).

    ``extra`` is the cloudckpt extra that installs it (``"s3"``, ``"gcs"``), or ``""``.
    """

    def __init__(self, message: str, extra: str = "") -> None:
        super().__init__(message)
        self.extra = extra


# protocol -> (the package its fsspec filesystem lives in, the cloudckpt extra installing it)
_STORE_EXTRAS = {
    **dict.fromkeys(S3_PROTOCOLS, ("s3fs", "s3")),
    **dict.fromkeys(GCS_PROTOCOLS, ("gcsfs", "gcs")),
}


@dataclass(frozen=True)
class Location:
    """A checkpoint's filesystem, root path (no trailing ``/``), redacted URI and kind."""

    fs: fsspec.AbstractFileSystem
    root: str
    uri: str
    kind: StoreKind

    def __repr__(self) -> str:  # the root may hold credentials (s3fs: "KEY:SECRET@bucket/...")
        return f"Location(uri={self.uri!r}, root={redact_text(self.root)!r}, kind={self.kind})"

    def full_path(self, relpath: str) -> str:
        """Filesystem path of ``relpath`` (validated) below the root."""
        validate_relpath(relpath, self.uri)
        return posixpath.join(self.root, relpath) if self.root else relpath

    def child_uri(self, relpath: str) -> str:
        """A human-readable URI of ``relpath`` for messages."""
        return self.uri.rstrip("/") + "/" + relpath


def resolve(
    raw_uri: str,
    fs: fsspec.AbstractFileSystem | None,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig,
    max_in_flight: int,
) -> Location:
    """Resolve ``raw_uri`` (or take ``fs``, the URI's path being the root).

    Raises:
        InvalidURIError: a malformed URI or an unknown protocol (:func:`check_uri`).
        MissingDependencyError: the URI's store is not installed (names the extra).
        StorageError: fsspec cannot make sense of the URI or the options.
    """
    install_log_filter()  # no secret in the logs of cloudckpt and the clients it calls
    uri = redact_uri(raw_uri)
    if fs is None:
        check_uri(raw_uri, uri)
        fs, root = _filesystem(raw_uri, uri, storage_options, config, max_in_flight)
    else:
        remember_secrets(getattr(fs, "storage_options", None), raw_uri)
        root = fs._strip_protocol(raw_uri)
    root = root.rstrip("/") if root not in ("/", "") else root
    return Location(fs, root, uri, store_kind(fs))


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
# a scheme of two letters or more and a colon not followed by "//" ("C:" is a drive)
_BROKEN_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(?!//)")
_BUCKET_PROTOCOLS = (*S3_PROTOCOLS, *GCS_PROTOCOLS)


def check_uri(raw_uri: str, shown: str) -> None:
    """Refuse a URI that is malformed or names an unknown protocol, instead of taking it
    for a local path (``s3:/bucket/x`` would otherwise be a folder ``s3:`` here).

    Accepted: local paths, ``<protocol>://...`` for a protocol fsspec knows (installed or
    not: a missing package is a :class:`MissingDependencyError` later), with a bucket
    for ``s3://`` and ``gs://``, and fsspec's chained URLs (``simplecache::s3://...``).

    Raises:
        InvalidURIError: naming the URI (``shown``, redacted) and what is wrong.
    """
    if "::" in raw_uri:  # chained: fsspec parses and checks each link
        return
    protocol, sep, rest = raw_uri.partition("://")
    if sep:
        if not _SCHEME.fullmatch(protocol):
            raise InvalidURIError(
                f"{shown!r} is not a valid URI: {protocol!r} is not a protocol name"
            )
        if protocol not in fsspec.available_protocols():
            raise InvalidURIError(
                f"{shown!r} names an unknown protocol {protocol!r}; known: s3://, gs://, "
                "file:// or a local path, memory://, and the other fsspec protocols"
            )
        if protocol in _BUCKET_PROTOCOLS and (not rest or rest.startswith("/")):
            raise InvalidURIError(f"{shown!r} names no bucket: expected {protocol}://BUCKET/PREFIX")
        return
    broken = _BROKEN_SCHEME.match(raw_uri)
    if broken is None:
        return
    scheme, after = broken.group(1), raw_uri[broken.end() :]
    if after.startswith("/") or scheme in fsspec.available_protocols():
        meant = f"{scheme}://{'/' if scheme == 'file' else ''}{after.lstrip('/')}"
        raise InvalidURIError(
            f"{shown!r} is a malformed URI ({scheme!r} followed by ':' without '//'), not "
            f"a local path: did you mean {meant}?"
        )


def store_kind(fs: fsspec.AbstractFileSystem) -> StoreKind:
    """The kind of store ``fs`` talks to."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    if isinstance(fs, LocalFileSystem):
        return StoreKind.LOCAL
    if "memory" in protocols:
        return StoreKind.MEMORY
    if any(p in S3_PROTOCOLS for p in protocols):
        return StoreKind.S3
    if any(p in GCS_PROTOCOLS for p in protocols):
        return StoreKind.GCS
    return StoreKind.OTHER


def _filesystem(
    raw_uri: str,
    uri: str,
    storage_options: dict[str, Any] | None,
    config: CheckpointConfig,
    max_in_flight: int,
) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol, _ = fsspec.core.split_protocol(raw_uri)
    protocol = protocol or "file"
    options = resolve_storage_options(protocol, storage_options, config)
    if protocol in S3_PROTOCOLS:
        options = _s3_client_defaults(options, max_in_flight, config.retry)
    elif protocol in GCS_PROTOCOLS:
        options = {"use_listings_cache": False, **options}
    remember_secrets(options, raw_uri)
    try:
        fs, root = fsspec.core.url_to_fs(raw_uri, **options)
    except ImportError as exc:
        raise _missing_dependency(protocol, uri, exc) from exc
    except (ValueError, TypeError) as exc:
        raise translate(exc, f"cannot open {uri}: {exc}") from exc
    except io_errors() as exc:  # gcsfs checks a raw token online (tokeninfo?access_token=)
        raise translate(exc, f"cannot open {uri}: {exc}") from exc
    return fs, str(root)


def _missing_dependency(protocol: str, uri: str, exc: ImportError) -> MissingDependencyError:
    if protocol not in _STORE_EXTRAS:
        return MissingDependencyError(f"cannot open {uri}: {exc}")
    package, extra = _STORE_EXTRAS[protocol]
    return MissingDependencyError(
        f"cannot open {uri}: {protocol}:// URIs need {package}, which is not installed "
        f"(or failed to import: {exc}); install it with: pip install 'cloudckpt[{extra}]' "
        "(or 'cloudckpt[all]' for every object store)",
        extra,
    )


def _s3_client_defaults(
    options: dict[str, Any], max_in_flight: int, retry: RetryPolicy
) -> dict[str, Any]:
    """s3fs options with a connection pool for ``max_in_flight`` requests, the policy's
    timeout per attempt, and botocore's standard retry mode for any call s3fs would make
    itself (the mode rewinds request bodies; cloudckpt makes none through s3fs). The
    requests cloudckpt sends - data, listings, HEADs, deletes - make one botocore attempt
    each and are retried by :mod:`cloudckpt.storage.retry` instead (see
    :mod:`cloudckpt.storage.s3`), so retries never multiply. Explicit ``config_kwargs``
    win."""
    # copies all the way down: botocore rewrites the ``retries`` dict it is given
    config_kwargs = copy.deepcopy(dict(options.get("config_kwargs") or {}))
    config_kwargs.setdefault("max_pool_connections", max(10, max_in_flight))
    config_kwargs.setdefault("connect_timeout", DATA_CONNECT_TIMEOUT_S)
    config_kwargs.setdefault("read_timeout", retry.attempt_timeout_s)
    retries = config_kwargs.setdefault("retries", {})
    retries.setdefault("mode", "standard")
    retries.setdefault("max_attempts", 5)
    client_kwargs = copy.deepcopy(dict(options.get("client_kwargs") or {}))
    return {
        # other jobs write the same bucket: listings must not come from a cache
        "use_listings_cache": False,
        **options,
        "config_kwargs": config_kwargs,
        "client_kwargs": client_kwargs,
    }


# ``?`` starts s3fs's version id (``w?versionId=1`` and ``w?versionId=2`` are one object),
# ``*``, ``?`` and ``[`` are fsspec's glob characters (a delete of ``w*`` would remove
# ``w1`` too), ``#`` starts a URL fragment, a backslash is a separator on some stores and
# tools, and control characters are mangled by listings and XML responses.
FORBIDDEN_KEY_CHARACTERS = frozenset("?#*[]\\") | frozenset(map(chr, [*range(32), 127]))


def relpath_problem(key: object) -> str | None:
    """Why ``key`` cannot be an object path below a checkpoint root, or None when it can.

    A path must be a non-empty string, valid UTF-8, relative (no leading ``/``), with
    no empty, ``.`` or ``..`` segments (nothing escapes the checkpoint prefix or aliases
    another path) and none of :data:`FORBIDDEN_KEY_CHARACTERS` (characters the stores or
    fsspec give a meaning: ``?``, ``#``, ``*``, ``[``, ``]``, backslash, control
    characters). The rules are the same for every store.
    """
    if not isinstance(key, str) or not key:
        return "keys must be non-empty strings"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "keys must be valid UTF-8"
    if key.startswith("/"):
        return "keys must be relative paths (no leading '/')"
    bad = sorted({c for c in key if c in FORBIDDEN_KEY_CHARACTERS})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return (
            f"{shown} cannot be used in keys (object stores and fsspec give "
            f"{'it' if len(bad) == 1 else 'them'} a meaning: version ids, URL fragments, "
            "globs, separators, control characters)"
        )
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        return "empty, '.' or '..' path segments are not allowed"
    return None


def validate_relpath(key: str, uri: str = "") -> str:
    """Check that ``key`` is usable as an object path below a checkpoint root (see
    :func:`relpath_problem`), so that no key can escape the checkpoint prefix or alias
    another key.

    Raises:
        InvalidKeyError: naming the key and the checkpoint URI.
    """
    problem = relpath_problem(key)
    if problem is not None:
        where = f" in checkpoint {uri!r}" if uri else ""
        raise InvalidKeyError(f"invalid key {key!r}{where}: {problem}")
    return key


def enforces_exclusive_writes(location: Location) -> bool | None:
    """Whether create-only writes are known to be enforced by the store.

    True for local disks, ``memory://``, S3 (AWS, MinIO, SeaweedFS; moto) and Google
    Cloud Storage itself. None (unknown) for a GCS endpoint other than Google's and
    for other protocols: GCS emulators differ (fake-gcs-server enforces
    ``ifGenerationMatch=0`` on simple uploads, gcp-storage-emulator ignores it), and
    no name tells them apart.
    """
    if location.kind in (StoreKind.LOCAL, StoreKind.MEMORY, StoreKind.S3):
        return True
    if location.kind is StoreKind.GCS:
        endpoint = str(
            getattr(location.fs, "_endpoint", None) or os.environ.get("STORAGE_EMULATOR_HOST", "")
        )
        return True if not endpoint or "googleapis.com" in endpoint else None
    return None
