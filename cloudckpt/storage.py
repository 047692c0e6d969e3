"""The storage layer: the only module of cloudckpt that talks to fsspec.

A checkpoint lives under one URI prefix (``/data/run/iter_10``, ``file:///...``,
``memory://run/iter_10``, ``s3://bucket/run/iter_10``, ``gs://...``: any fsspec
protocol). :class:`CheckpointStorage` binds such a URI to a filesystem and a root
path and offers the handful of operations the strategies need, on paths *relative*
to the checkpoint root:

* :meth:`~CheckpointStorage.write` / :meth:`~CheckpointStorage.write_many` return a
  :class:`WriteResult` (path, size, crc32c of the bytes that went out),
* :meth:`~CheckpointStorage.read`, :meth:`~CheckpointStorage.read_many` (byte ranges)
  and :meth:`~CheckpointStorage.read_into_many` (straight into tensor memory),
* :meth:`~CheckpointStorage.exists`, :meth:`~CheckpointStorage.list`,
  :meth:`~CheckpointStorage.delete`.

**One knob for concurrency.** Every request (a whole-object PUT, one part of a
multipart upload, one ranged GET) is one task in a pool of ``max_in_flight`` threads;
nothing nests, so at most ``max_in_flight`` requests are in flight per call.

**Streaming uploads.** Buffers are never copied by this layer. On S3 an object larger
than ``part_size`` goes up as a multipart upload whose parts are sent concurrently,
each straight from a slice of the tensor's memory, with its CRC-32C for the server to
verify; a failed upload is aborted. GCS objects go up as gcsfs resumable uploads in
``part_size`` chunks (sequential within one object: GCS's JSON API has no parallel
parts), so large shards are split into several objects upstream (zarr ``chunk_size``).

**Ranged downloads.** Reads into a buffer larger than ``part_size`` are cut into
concurrent ranged GETs.

Storage options come from, in increasing precedence, the environment, a
:class:`~cloudckpt.config.CheckpointConfig` and the explicit ``storage_options``
argument (see :mod:`cloudckpt.config`); messages and logs never show secrets.
"""

from __future__ import annotations

import builtins
import copy
import logging
import os
import posixpath
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fsspec
import fsspec.asyn
from fsspec.implementations.local import LocalFileSystem

from cloudckpt.config import (
    CheckpointConfig,
    redact_uri,
    resolve_storage_options,
)
from cloudckpt.errors import (
    CheckpointNotFoundError,
    CorruptObjectError,
    InvalidKeyError,
    ObjectExistsError,
    StorageAccessDeniedError,
    StorageError,
    StorageUnreachableError,
)
from cloudckpt.transfer import (
    Buffer,
    BufferReader,
    Progress,
    as_bytes_view,
    crc32c,
    crc32c_base64,
    plan_parts,
)

__all__ = [
    "CheckpointStorage",
    "FileSystem",
    "MissingDependencyError",
    "OpenUpload",
    "ReadRequest",
    "WriteResult",
    "crc32c",
    "open_checkpoint",
    "validate_relpath",
]

logger = logging.getLogger(__name__)

FileSystem = fsspec.AbstractFileSystem
"""The filesystem type strategies accept (``fs=``); other modules never import fsspec."""
T = TypeVar("T")
R = TypeVar("R")

S3_PROTOCOLS = ("s3", "s3a")
GCS_PROTOCOLS = ("gs", "gcs")
GCS_CHUNK_MULTIPLE = 256 * 1024  # GCS resumable uploads take chunks in multiples of this
PRECONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict")


@dataclass(frozen=True, slots=True)
class WriteResult:
    """What one object write produced.

    Attributes:
        path: object path relative to the checkpoint root (``"layer.w/0.0"``).
        size: bytes written.
        crc32c: CRC-32C (Castagnoli) of the bytes written, as an unsigned int.
    """

    path: str
    size: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class OpenUpload:
    """A multipart upload started and neither completed nor aborted (S3 only).

    Attributes:
        path: object path relative to the checkpoint root.
        upload_id: the store's id of the upload.
        initiated: when it started, ISO 8601 ("" when the store does not say).
    """

    path: str
    upload_id: str
    initiated: str = ""


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """A byte range of one object; ``end=None`` reads to the end of the object."""

    path: str
    start: int = 0
    end: int | None = None


def validate_relpath(key: str, uri: str = "") -> str:
    """Check that ``key`` is usable as an object path below a checkpoint root.

    Keys come from user state dicts. They must be relative, with no empty, ``.`` or
    ``..`` segments and no backslashes, so that no key can escape the checkpoint
    prefix or alias another key.

    Raises:
        InvalidKeyError: naming the key and the checkpoint URI.
    """
    where = f" in checkpoint {uri!r}" if uri else ""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {key!r}{where}: keys must be non-empty strings")
    if key.startswith("/") or "\\" in key:
        raise InvalidKeyError(
            f"invalid key {key!r}{where}: keys must be relative paths without backslashes"
        )
    bad = [seg for seg in key.split("/") if seg in ("", ".", "..")]
    if bad:
        raise InvalidKeyError(
            f"invalid key {key!r}{where}: empty, '.' or '..' path segments are not allowed"
        )
    return key


class _Cancelled(Exception):
    """A queued request skipped because another request of the same call failed."""


@dataclass
class _PendingWrite:
    """One object of a :meth:`CheckpointStorage.write_many` call, while in flight."""

    relpath: str
    view: memoryview
    futures: list[Future[Any]]
    upload_id: str | None = None  # S3 multipart uploads only
    crc: int | None = None
    errors: list[BaseException] = field(default_factory=list)


def _error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _uri_protocol(uri: str) -> str:
    protocol, _ = fsspec.core.split_protocol(uri)
    return protocol or "file"


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


def _s3_client_defaults(options: dict[str, Any], max_in_flight: int) -> dict[str, Any]:
    """s3fs options with a connection pool for ``max_in_flight`` requests and botocore's
    standard retry mode (which rewinds request bodies between attempts); explicit
    ``config_kwargs`` win."""
    # copies all the way down: botocore rewrites the ``retries`` dict it is given
    config_kwargs = copy.deepcopy(dict(options.get("config_kwargs") or {}))
    config_kwargs.setdefault("max_pool_connections", max(10, max_in_flight))
    config_kwargs.setdefault("connect_timeout", DATA_CONNECT_TIMEOUT_S)
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


# -- the first request: fail fast, naming the setting to fix ----------------------------

DATA_CONNECT_TIMEOUT_S = 10.0  # botocore's default is 60 s, times 5 attempts
PROBE_CONNECT_TIMEOUT_S = 2.0
PROBE_READ_TIMEOUT_S = 5.0
AUTH_ERROR_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "403",
)
ENDPOINT_SETTINGS = (
    "the environment (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL), --storage-option "
    "endpoint_url=URL on the command line, or storage_options {endpoint_url: URL} in the "
    "config or the storage_options= argument"
)
CREDENTIAL_SETTINGS = (
    "the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, or "
    "AWS_PROFILE), --storage-option key=... --storage-option secret=... on the command "
    "line, or storage_options {key, secret, token} in the config or the storage_options= "
    "argument; check the endpoint too"
)
_checked: weakref.WeakSet[fsspec.AbstractFileSystem] = weakref.WeakSet()


def _check_s3_access(fs: fsspec.AbstractFileSystem, root: str, uri: str) -> None:
    """List one key under ``root`` through a client of ``fs``'s settings that makes one
    attempt with short timeouts, once per filesystem instance: an unreachable endpoint or
    refused credentials fail within seconds, not after botocore's retries with backoff
    (data requests keep them).

    Raises:
        StorageUnreachableError / StorageAccessDeniedError: naming the settings to fix.
    """
    bucket, key, _ = fs.split_path(root)
    if not bucket or fs in _checked:
        return
    probe = type(fs)(**_probe_options(dict(fs.storage_options)))
    probe.retries = 1  # s3fs's own retry loop, around botocore's
    try:
        probe.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except Exception as exc:  # anything else is left to the real request
        error = _access_error(exc, uri, _endpoint_of(probe))
        if error is not None:
            raise error from exc
        logger.debug("%s: first request failed: %s", uri, exc)
    _checked.add(fs)


def _probe_options(options: dict[str, Any]) -> dict[str, Any]:
    config_kwargs = copy.deepcopy(dict(options.get("config_kwargs") or {}))
    config_kwargs.update(
        connect_timeout=PROBE_CONNECT_TIMEOUT_S,
        read_timeout=PROBE_READ_TIMEOUT_S,
        retries={"mode": "standard", "max_attempts": 1},
    )
    return {**options, "config_kwargs": config_kwargs, "skip_instance_cache": True}


def _endpoint_of(fs: Any) -> str:
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return redact_uri(str(url)) if url else "the default AWS endpoint"


def _access_error(exc: BaseException, uri: str, endpoint: str) -> StorageError | None:
    """The error to raise for a failed first request, or None when it is neither a
    connection failure nor refused credentials."""
    # installed with s3fs (the "s3" extra), which the caller's filesystem comes from
    import botocore.exceptions as boto  # type: ignore[import-untyped]  # noqa: PLC0415

    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(exc, boto.ConnectionError | boto.ConnectTimeoutError) or isinstance(
        cause, boto.ConnectionError
    ):
        return StorageUnreachableError(
            f"cannot reach the S3 endpoint {endpoint} for {uri}: {exc}. The endpoint comes "
            f"from {ENDPOINT_SETTINGS}"
        )
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return StorageAccessDeniedError(
            f"no S3 credentials for {uri} (endpoint {endpoint}): {exc}. Set them in "
            f"{CREDENTIAL_SETTINGS}"
        )
    code = _error_code(cause)
    if code in AUTH_ERROR_CODES or (not code and isinstance(exc, PermissionError)):
        return StorageAccessDeniedError(
            f"the S3 endpoint {endpoint} refused the credentials for {uri} "
            f"({code or type(exc).__name__}: {exc}). The credentials come from "
            f"{CREDENTIAL_SETTINGS}"
        )
    return None


async def _s3_send_once(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 API call with a request body, retried only by botocore.

    s3fs's own retry loop (``call_s3``) would send the same body object again without
    rewinding it; botocore's retries rewind it. s3fs's ``s3_additional_kwargs`` (for
    example server-side encryption settings) still apply.
    """
    await fs.set_session()
    client = await fs.get_s3(kwargs.get("Bucket"))
    call = getattr(client, method)
    return await call(**fs._get_s3_method_kwargs(call, **kwargs))


class CheckpointStorage:
    """One checkpoint location: an fsspec filesystem plus a root path.

    Args:
        uri: checkpoint URI or local path. Messages show it with secrets redacted.
        fs: an fsspec filesystem to use instead of resolving one from the URI (the
            URI's path part is still used as the root).
        storage_options: options for the filesystem resolved from the URI (ignored
            when ``fs`` is given); they override ``config.storage_options`` and the
            environment.
        max_in_flight: the most requests one call keeps in flight (default: the
            config's).
        config: part size, in-flight requests and storage options of a training config.
        expected: what a manifest recorded, by relative path: every object read whole
            is checked against its size and CRC-32C, every ranged read against its size.
        verify_checksums: also check the CRC-32C of objects only partly needed (they
            are then read whole).
    """

    def __init__(
        self,
        uri: str | os.PathLike[str],
        fs: fsspec.AbstractFileSystem | None = None,
        storage_options: dict[str, Any] | None = None,
        max_in_flight: int | None = None,
        *,
        config: CheckpointConfig | None = None,
        expected: Mapping[str, WriteResult] | None = None,
        verify_checksums: bool = False,
    ) -> None:
        raw_uri = os.fspath(uri)
        self.expected: Mapping[str, WriteResult] = expected or {}
        self.verify_checksums = verify_checksums
        self.uri = redact_uri(raw_uri)
        self.config = config or CheckpointConfig()
        self.max_in_flight = self.config.max_in_flight if max_in_flight is None else max_in_flight
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        self.part_size = self.config.part_size
        # every request holds one slot: the single knob bounding requests in flight
        self._slots = threading.BoundedSemaphore(self.max_in_flight)
        if fs is None:
            fs, root = self._resolve(raw_uri, storage_options)
        else:
            root = fs._strip_protocol(raw_uri)
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") if root not in ("/", "") else root
        protocols = _protocols(fs)
        self._is_local = isinstance(fs, LocalFileSystem)
        self._is_s3 = any(p in S3_PROTOCOLS for p in protocols)
        self._is_gcs = any(p in GCS_PROTOCOLS for p in protocols)
        if self._is_s3:
            _check_s3_access(fs, self.root, self.uri)

    def _resolve(
        self, raw_uri: str, storage_options: dict[str, Any] | None
    ) -> tuple[fsspec.AbstractFileSystem, str]:
        protocol = _uri_protocol(raw_uri)
        options = resolve_storage_options(protocol, storage_options, self.config)
        if protocol in S3_PROTOCOLS:
            options = _s3_client_defaults(options, self.max_in_flight)
        elif protocol in GCS_PROTOCOLS:
            options = {"use_listings_cache": False, **options}
        try:
            fs, root = fsspec.core.url_to_fs(raw_uri, **options)
        except ImportError as exc:
            raise _missing_dependency(protocol, self.uri, exc) from exc
        except (ValueError, TypeError) as exc:
            raise StorageError(f"cannot open {self.uri}: {exc}") from exc
        return fs, root

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.uri!r})"

    # -- paths -----------------------------------------------------------------

    def full_path(self, relpath: str) -> str:
        """Filesystem path of ``relpath`` (validated) below the root."""
        validate_relpath(relpath, self.uri)
        return posixpath.join(self.root, relpath) if self.root else relpath

    def child_uri(self, relpath: str) -> str:
        """A human-readable URI of ``relpath`` for messages."""
        return self.uri.rstrip("/") + "/" + relpath

    # -- writes ------------------------------------------------------------------

    def write(self, relpath: str, data: Buffer, *, exclusive: bool = False) -> WriteResult:
        """Write one whole object, replacing any previous one (unless ``exclusive``).

        ``data`` is any buffer (``bytes``, a ``memoryview`` of a tensor's memory); it is
        not copied by this layer. Returns the size and CRC-32C of what was written.

        With ``exclusive``, the write is create-only, as one request: S3
        ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, a local ``O_EXCL`` open. See
        :attr:`enforces_exclusive_writes` for stores that ignore it.

        Raises:
            ObjectExistsError: ``exclusive`` and the object exists.
            StorageError: any other failure.
        """
        if not exclusive:
            return self.write_many([(relpath, data)])[0]
        view = as_bytes_view(data)
        checksum = crc32c(view)
        self._create(relpath, self.full_path(relpath), view, checksum)
        return WriteResult(relpath, view.nbytes, checksum)

    def _create(self, relpath: str, path: str, view: memoryview, checksum: int) -> None:
        try:
            if self._is_s3:
                self._s3_put(path, view, checksum, IfNoneMatch="*")
            elif self._is_local:
                # a real O_EXCL open: fsspec's pipe_file(mode="create") checks, then opens
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                with self._slots, self.fs.open(path, "xb") as f:
                    f.write(view)
            else:
                with self._slots:
                    self.fs.pipe_file(path, view, mode="create", **self._create_options(view))
        except FileExistsError as exc:
            raise ObjectExistsError(f"{self.child_uri(relpath)} already exists") from exc
        except Exception as exc:
            if _error_code(exc) not in PRECONDITION_FAILED:
                raise StorageError(f"failed to create {self.child_uri(relpath)}: {exc}") from exc
            if not self._is_our_object(relpath, view.nbytes, checksum):
                raise ObjectExistsError(f"{self.child_uri(relpath)} already exists") from exc

    def _create_options(self, view: memoryview) -> dict[str, Any]:
        """GCS: create-only writes go up as one simple (multipart/related) upload whatever
        their size. gcsfs switches to a resumable upload from ``chunksize`` (50 MiB by
        default) on, and a server may apply ``ifGenerationMatch=0`` to simple uploads
        only (fake-gcs-server does): the claim and the manifest must never take that
        path."""
        return {"chunksize": view.nbytes + 1} if self._is_gcs else {}

    def _is_our_object(self, relpath: str, size: int, checksum: int) -> bool:
        """After a 412: did an earlier attempt of this very request (retried by botocore
        when its response was lost) create the object? Same size and CRC-32C: yes."""
        try:
            stored = self._read(relpath)
        except StorageError:
            return False
        ours = len(stored) == size and crc32c(stored) == checksum
        if ours:
            logger.info("%s: a retried create found its own first attempt", self.child_uri(relpath))
        return ours

    def with_expected(
        self, expected: Mapping[str, WriteResult] | None, verify_checksums: bool = False
    ) -> CheckpointStorage:
        """This storage (same filesystem, same request slots) with its reads checked
        against ``expected`` (a manifest's path -> size and CRC-32C)."""
        bound = copy.copy(self)
        bound.expected = dict(expected or {})
        bound.verify_checksums = verify_checksums
        return bound

    @property
    def process_local(self) -> bool:
        """True for a store only this process sees (fsspec's ``memory://``): ranks in
        other processes cannot read what this one writes."""
        return "memory" in _protocols(self.fs)

    @property
    def enforces_exclusive_writes(self) -> bool | None:
        """Whether create-only writes are known to be enforced by this store.

        True for local disks, ``memory://``, S3 (AWS, MinIO, SeaweedFS; moto) and Google
        Cloud Storage itself. None (unknown) for a GCS endpoint other than Google's and
        for other protocols: GCS emulators differ (fake-gcs-server enforces
        ``ifGenerationMatch=0`` on simple uploads, gcp-storage-emulator ignores it), and
        no name tells them apart.
        """
        if self._is_local or "memory" in _protocols(self.fs) or self._is_s3:
            return True
        if self._is_gcs:
            endpoint = str(getattr(self.fs, "_endpoint", None) or os.environ.get(
                "STORAGE_EMULATOR_HOST", ""
            ))
            return True if not endpoint or "googleapis.com" in endpoint else None
        return None

    def write_many(self, items: Iterable[tuple[str, Buffer]]) -> builtins.list[WriteResult]:
        """Write several objects, at most ``max_in_flight`` requests at once.

        Objects larger than ``part_size`` on S3 go up as multipart uploads with
        concurrent parts. Returns results in the order of ``items``. On failure,
        requests not yet started are skipped, unfinished multipart uploads are
        aborted, and the first error is raised.

        Raises:
            StorageError: naming the object URI (and part, for multipart uploads).
        """
        jobs = [(relpath, as_bytes_view(data)) for relpath, data in items]
        paths = [self.full_path(relpath) for relpath, _ in jobs]
        progress = Progress("wrote", self.uri, sum(v.nbytes for _, v in jobs), len(jobs))
        cancel = threading.Event()
        pending: builtins.list[_PendingWrite] = []
        with self._pool(sum(self._request_count(view) for _, view in jobs)) as pool:
            try:
                for (relpath, view), path in zip(jobs, paths, strict=True):
                    pending.append(self._submit_write(pool, relpath, path, view, progress, cancel))
                for item in pending:  # overlaps the uploads; crc32c releases the GIL
                    if item.upload_id is not None:
                        item.crc = crc32c(item.view)
            except BaseException:
                cancel.set()
                raise
            finally:
                self._settle(pending, cancel)
        failed = [item for item in pending if item.errors]
        if failed:
            raise _first_error(failed)
        progress.finish()
        return [WriteResult(p.relpath, p.view.nbytes, p.crc or 0) for p in pending]

    def _uses_multipart(self, view: memoryview) -> bool:
        return self._is_s3 and view.nbytes > self.part_size

    def _request_count(self, view: memoryview) -> int:
        return len(plan_parts(view.nbytes, self.part_size)) if self._uses_multipart(view) else 1

    def _pool(self, tasks: int) -> ThreadPoolExecutor:
        workers = max(1, min(self.max_in_flight, tasks))
        return ThreadPoolExecutor(workers, thread_name_prefix="cloudckpt-io")

    def _submit_write(
        self,
        pool: ThreadPoolExecutor,
        relpath: str,
        path: str,
        view: memoryview,
        progress: Progress,
        cancel: threading.Event,
    ) -> _PendingWrite:
        if self._uses_multipart(view):
            return self._start_multipart(pool, relpath, path, view, progress, cancel)
        item = _PendingWrite(relpath, view, [])
        item.futures.append(pool.submit(_guarded, cancel, self._put, item, path, progress))
        return item

    def _put(self, item: _PendingWrite, path: str, progress: Progress) -> None:
        view = item.view
        item.crc = crc32c(view)
        try:
            if self._is_s3:
                self._s3_put(path, view, item.crc)
            else:
                if self._is_local:
                    self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                options = {"chunksize": self._gcs_chunk_size()} if self._is_gcs else {}
                with self._slots:
                    self.fs.pipe_file(path, view, **options)
        except Exception as exc:
            raise StorageError(f"failed to write {self.child_uri(item.relpath)}: {exc}") from exc
        progress.add(view.nbytes)

    def _gcs_chunk_size(self) -> int:
        return max(GCS_CHUNK_MULTIPLE, self.part_size - self.part_size % GCS_CHUNK_MULTIPLE)

    def _s3_put(self, path: str, view: memoryview, checksum: int, **extra: Any) -> None:
        bucket, key, _ = self.fs.split_path(path)
        self._s3_send(
            "put_object",
            Bucket=bucket,
            Key=key,
            Body=BufferReader(view),
            ChecksumCRC32C=crc32c_base64(checksum),
            **extra,
        )
        self.fs.invalidate_cache(path)

    # -- S3 multipart uploads ------------------------------------------------------

    def _s3_send(self, method: str, **kwargs: Any) -> Any:
        """An S3 call with a request body (botocore retries only), in a request slot."""
        with self._slots:
            return fsspec.asyn.sync(self.fs.loop, _s3_send_once, self.fs, method, **kwargs)

    def _s3_call(self, method: str, **kwargs: Any) -> Any:
        """An S3 call without a body (s3fs retries too), in a request slot."""
        with self._slots:
            return self.fs.call_s3(method, **kwargs)

    def _start_multipart(
        self,
        pool: ThreadPoolExecutor,
        relpath: str,
        path: str,
        view: memoryview,
        progress: Progress,
        cancel: threading.Event,
    ) -> _PendingWrite:
        bucket, key, _ = self.fs.split_path(path)
        try:
            upload = self._s3_call(
                "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C"
            )
        except Exception as exc:
            raise StorageError(
                f"failed to start a multipart upload of {self.child_uri(relpath)}: {exc}"
            ) from exc
        item = _PendingWrite(relpath, view, [], upload_id=upload["UploadId"])
        logger.debug("multipart upload %s of %s started", item.upload_id, self.child_uri(relpath))
        for number, (start, end) in enumerate(plan_parts(view.nbytes, self.part_size), 1):
            item.futures.append(
                pool.submit(
                    _guarded, cancel, self._upload_part, item, path, number, start, end, progress
                )
            )
        return item

    def _upload_part(
        self, item: _PendingWrite, path: str, number: int, start: int, end: int, progress: Progress
    ) -> dict[str, Any]:
        bucket, key, _ = self.fs.split_path(path)
        part = item.view[start:end]
        checksum = crc32c_base64(crc32c(part))
        try:
            response = self._s3_send(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=item.upload_id,
                PartNumber=number,
                Body=BufferReader(part),
                ChecksumCRC32C=checksum,
            )
        except Exception as exc:
            raise StorageError(
                f"failed to upload part {number} (bytes {start}-{end}) of "
                f"{self.child_uri(item.relpath)}: {exc}"
            ) from exc
        progress.add(part.nbytes)
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}

    def _complete_multipart(self, item: _PendingWrite, path: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        parts = [future.result() for future in item.futures]
        try:
            self._s3_call(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=item.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except Exception as exc:
            raise StorageError(
                f"failed to complete the multipart upload of {self.child_uri(item.relpath)}: {exc}"
            ) from exc
        self.fs.invalidate_cache(path)

    def _abort_multipart(self, item: _PendingWrite, path: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        try:
            self._s3_call(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=item.upload_id
            )
            logger.info("aborted multipart upload of %s", self.child_uri(item.relpath))
        except Exception as exc:  # noqa: BLE001 - keep the original error; say what is left
            logger.warning(
                "could not abort multipart upload %s of %s (a bucket lifecycle rule will "
                "remove it): %s",
                item.upload_id,
                self.child_uri(item.relpath),
                exc,
            )

    def _settle(self, pending: builtins.list[_PendingWrite], cancel: threading.Event) -> None:
        """Wait for every request; complete multipart uploads or abort the failed ones."""
        wait([future for item in pending for future in item.futures])
        for item in pending:
            item.errors.extend(
                exc
                for future in item.futures
                if (exc := future.exception()) is not None and not isinstance(exc, _Cancelled)
            )
            if item.upload_id is None:
                continue
            path = self.full_path(item.relpath)
            if item.errors or cancel.is_set():
                self._abort_multipart(item, path)
                continue
            try:
                self._complete_multipart(item, path)
            except StorageError as exc:
                item.errors.append(exc)
                self._abort_multipart(item, path)

    # -- reads -------------------------------------------------------------------

    def read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        """Read a whole object or the byte range ``[start, end)`` of it.

        Objects listed in :attr:`expected` are checked (see the class docstring).

        Raises:
            CheckpointNotFoundError: the object does not exist.
            CorruptObjectError: size or CRC-32C differ from the manifest's.
            StorageError: any other failure.
        """
        entry = self.expected.get(relpath)
        if entry is None:
            return self._read(relpath, start, end)
        if start == 0 and end is None:
            data = self._read(relpath)
            self._check_whole(relpath, memoryview(data))
            return data
        self._check_range(relpath, start, entry.size if end is None else end)
        if self.verify_checksums:
            return self.read(relpath)[start:end]
        return self._read(relpath, start, end)

    def _check_whole(self, relpath: str, data: memoryview) -> None:
        entry = self.expected.get(relpath)
        if entry is None:
            return
        if data.nbytes != entry.size:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)} has {data.nbytes} bytes; the manifest recorded "
                f"{entry.size}"
            )
        actual = crc32c(data)
        if actual != entry.crc32c:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: CRC-32C {actual:#010x} differs from the "
                f"manifest's {entry.crc32c:#010x}; the object is corrupt"
            )

    def _check_range(self, relpath: str, start: int, end: int) -> None:
        entry = self.expected[relpath]
        if end > entry.size:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: bytes {start}-{end} requested, but the manifest "
                f"recorded {entry.size} bytes for this object"
            )

    def _read(self, relpath: str, start: int = 0, end: int | None = None) -> bytes:
        path = self.full_path(relpath)
        if end is not None and end <= start:
            # an empty range; some filesystems (s3fs) read the whole object for it
            return b"" if self.exists(relpath) else self._missing(relpath)
        try:
            with self._slots:
                return bytes(self.fs.cat_file(path, start=start or None, end=end))
        except FileNotFoundError as exc:
            raise self._not_found(relpath) from exc
        except Exception as exc:
            if start and end is None and 0 <= self._size(path) <= start:
                return b""  # reading from the end: S3 answers 416 where files give b""
            raise StorageError(f"failed to read {self.child_uri(relpath)}: {exc}") from exc

    def _size(self, path: str) -> int:
        try:
            return int(self.fs.size(path))
        except Exception:  # noqa: BLE001 - only a hint for the caller's error path
            return -1

    def _missing(self, relpath: str) -> bytes:
        raise self._not_found(relpath)

    def _not_found(self, relpath: str) -> StorageError | CheckpointNotFoundError:
        """A missing object: damage when the manifest lists it (a ``CorruptObjectError``,
        deliberately not a ``FileNotFoundError``: a training loop's ``except
        FileNotFoundError: start fresh`` must not restart on a damaged checkpoint)."""
        if relpath in self.expected:
            return CorruptObjectError(
                f"{self.child_uri(relpath)} is listed in the manifest but does not exist; "
                "the checkpoint is damaged (`cloudckpt verify` shows what is missing)"
            )
        return CheckpointNotFoundError(f"{self.child_uri(relpath)} does not exist")

    def read_into(self, relpath: str, out: memoryview, start: int = 0) -> None:
        """Fill ``out`` with the bytes of ``relpath`` starting at ``start``.

        Local files are read straight into ``out`` (no intermediate copy); other
        filesystems fetch the range and copy it once. Buffers larger than
        ``part_size`` are fetched as concurrent ranged GETs.

        Raises:
            CheckpointNotFoundError: the object does not exist.
            StorageError: the object is shorter than requested, or any other failure.
        """
        self.read_into_many([(ReadRequest(relpath, start), out)])

    def read_into_many(self, items: Sequence[tuple[ReadRequest, memoryview]]) -> None:
        """:meth:`read_into` for many (request, buffer) pairs, concurrently.

        Objects listed in :attr:`expected` are checked: a buffer covering the whole
        object against size and CRC-32C, a partial one against the size (and, with
        :attr:`verify_checksums`, against the CRC-32C of the whole object, read in full).
        """
        views = [(request, as_bytes_view(buffer)) for request, buffer in items]
        checked = [(r, v) for r, v in views if self._needs_whole_read(r, v)]
        direct = [(r, v) for r, v in views if not self._needs_whole_read(r, v)]
        for request, view in direct:
            if request.path in self.expected:
                self._check_range(request.path, request.start, request.start + view.nbytes)
        ranges = [
            (request.path, request.start + a, view[a:b])
            for request, view in direct
            for a, b in self._read_ranges(view.nbytes)
        ]
        progress = Progress("read", self.uri, sum(v.nbytes for _, _, v in ranges), len(items))
        self.map(lambda r: self._read_range_into(r[0], r[2], r[1], progress), ranges)
        self.map(lambda rv: self._check_whole_buffer(*rv), direct)
        by_object: dict[str, builtins.list[tuple[ReadRequest, memoryview]]] = {}
        for request, view in checked:
            by_object.setdefault(request.path, []).append((request, view))
        self.map(lambda path: self._read_whole_into(by_object[path]), builtins.list(by_object))
        progress.finish()

    def _needs_whole_read(self, request: ReadRequest, view: memoryview) -> bool:
        entry = self.expected.get(request.path)
        whole = entry is not None and request.start == 0 and view.nbytes == entry.size
        return entry is not None and self.verify_checksums and not whole

    def _check_whole_buffer(self, request: ReadRequest, view: memoryview) -> None:
        entry = self.expected.get(request.path)
        if entry is not None and request.start == 0 and view.nbytes == entry.size:
            self._check_whole(request.path, view)

    def _read_whole_into(self, requests: builtins.list[tuple[ReadRequest, memoryview]]) -> None:
        """Read one object whole (checked against the manifest) once and fill every
        buffer that needs a part of it."""
        for request, view in requests:
            self._check_range(request.path, request.start, request.start + view.nbytes)
        data = memoryview(self.read(requests[0][0].path))
        for request, view in requests:
            view[:] = data[request.start : request.start + view.nbytes]

    def _read_ranges(self, nbytes: int) -> builtins.list[tuple[int, int]]:
        if self._is_local or nbytes <= self.part_size:
            return [(0, nbytes)]
        return plan_parts(nbytes, self.part_size)

    def _read_range_into(
        self, relpath: str, out: memoryview, start: int, progress: Progress
    ) -> None:
        path = self.full_path(relpath)
        if out.nbytes == 0:  # no GET: servers refuse empty ranges (416)
            self.read(relpath, start, start)
            return
        try:
            with self._slots:
                got = self._fetch_into(path, out, start)
        except FileNotFoundError as exc:
            raise self._not_found(relpath) from exc
        except Exception as exc:
            raise StorageError(f"failed to read {self.child_uri(relpath)}: {exc}") from exc
        if got != out.nbytes:
            raise CorruptObjectError(
                f"{self.child_uri(relpath)}: read {got} bytes at offset {start}, expected "
                f"{out.nbytes}; the object is truncated"
            )
        progress.add(got)

    def _fetch_into(self, path: str, out: memoryview, start: int) -> int:
        if self._is_local:
            with self.fs.open(path, "rb") as f:
                f.seek(start)
                return int(f.readinto(out))
        data = self.fs.cat_file(path, start=start, end=start + out.nbytes)
        out[: len(data)] = data
        return len(data)

    def read_many(self, requests: Sequence[ReadRequest]) -> builtins.list[bytes]:
        """Read several objects or ranges concurrently; results follow ``requests``."""
        progress = Progress("read", self.uri, 0, len(requests))

        def read(request: ReadRequest) -> bytes:
            data = self.read(request.path, request.start, request.end)
            progress.add(len(data))
            return data

        results: builtins.list[bytes] = self.map(read, requests)
        progress.finish()
        return results

    # -- metadata ----------------------------------------------------------------

    def exists(self, relpath: str) -> bool:
        """True when the object ``relpath`` exists (a prefix or directory is not one)."""
        path = self.full_path(relpath)
        try:
            return bool(self.fs.isfile(path))
        except Exception as exc:
            raise StorageError(f"failed to stat {self.child_uri(relpath)}: {exc}") from exc

    def list(self, prefix: str = "") -> builtins.list[str]:
        """All object paths below the root (or below ``prefix``), relative, sorted.

        Objects only, on every store: see :meth:`list_sizes`."""
        return builtins.list(self.list_sizes(prefix))

    def list_children(self) -> builtins.list[str]:
        """Names of the immediate sub-prefixes (directories) of the root, sorted.

        On a store that keeps empty "directories" (SeaweedFS) a prefix whose objects
        were all deleted may still be listed here; it holds no object (:meth:`list`)."""
        try:
            entries = self.fs.ls(self.root, detail=True) if self.fs.exists(self.root) else []
        except FileNotFoundError:
            entries = []
        except Exception as exc:
            raise StorageError(f"failed to list {self.uri}: {exc}") from exc
        root = self.fs._strip_protocol(self.root).rstrip("/")
        names = set()
        for entry in entries:
            path = self.fs._strip_protocol(entry["name"]).rstrip("/")
            if entry.get("type") == "directory" and path != root:
                names.add(posixpath.basename(path))
        return sorted(names)

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``{relative path: size}`` of every object below the root (or ``prefix``),
        sorted, from one recursive listing (no object is opened).

        Objects only, on every store: entries of type ``directory`` (s3fs lists the
        prefix itself, and SeaweedFS keeps empty "directories" after their objects were
        deleted), zero-size keys ending in ``/`` (directory markers some tools create)
        and the root itself are left out.
        """
        base = self.full_path(prefix) if prefix else self.root
        try:
            found = self.fs.find(base, withdirs=False, detail=True) if self.fs.exists(base) else {}
        except FileNotFoundError:
            found = {}
        except Exception as exc:
            raise StorageError(f"failed to list {self.uri}: {exc}") from exc
        root = self.fs._strip_protocol(self.root).rstrip("/")
        prefix_len = len(root) + 1 if root else 0
        sizes: dict[str, int] = {}
        for path, info in sorted(found.items()):
            name = self.fs._strip_protocol(path)
            if _is_directory_entry(name, info) or name.rstrip("/") == root:
                continue
            sizes[name[prefix_len:]] = int(info.get("size") or 0)
        return sizes

    def checksum(self, relpath: str, size: int) -> WriteResult:
        """Size and CRC-32C of an object of ``size`` bytes, read in ``part_size`` ranges
        (so memory stays at one part per call however large the object)."""
        crc, done = 0, 0
        for start, end in plan_parts(size, self.part_size):
            if end > start:
                data = self._read(relpath, start, end)
                crc = crc32c(data, crc)
                done += len(data)
        return WriteResult(relpath, done, crc)

    def open_uploads(self) -> builtins.list[OpenUpload]:
        """Multipart uploads open below the root (S3 only; other stores have none)."""
        if not self._is_s3:
            return []
        bucket, key, _ = self.fs.split_path(self.root)
        prefix = key.rstrip("/") + "/" if key else ""
        uploads: builtins.list[OpenUpload] = []
        markers: dict[str, str] = {}
        while True:
            page = self._s3_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            uploads += [
                OpenUpload(u["Key"][len(prefix) :], u["UploadId"], _iso(u.get("Initiated")))
                for u in page.get("Uploads", [])
            ]
            if not page.get("IsTruncated"):
                return uploads
            markers = {
                "KeyMarker": page["NextKeyMarker"],
                "UploadIdMarker": page["NextUploadIdMarker"],
            }

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort an open multipart upload (its parts are deleted by the store)."""
        bucket, key, _ = self.fs.split_path(self.full_path(upload.path))
        try:
            self._s3_call(
                "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id
            )
        except Exception as exc:
            raise StorageError(
                f"failed to abort multipart upload {upload.upload_id} of "
                f"{self.child_uri(upload.path)}: {exc}"
            ) from exc

    def is_empty(self) -> bool:
        """True when no object exists below the root."""
        return not self.list()

    def delete(self, relpath: str, recursive: bool = False) -> None:
        """Delete one object, or everything below ``relpath`` with ``recursive``."""
        path = self.full_path(relpath)
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise StorageError(f"failed to delete {self.child_uri(relpath)}: {exc}") from exc

    # -- concurrency -------------------------------------------------------------

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> builtins.list[R]:
        """Apply ``fn`` to ``items`` with at most ``max_in_flight`` running at once.

        After the first failure, calls not yet started are skipped; the first error
        is raised once the running ones have finished.
        """
        if len(items) <= 1 or self.max_in_flight == 1:
            return [fn(item) for item in items]
        cancel = threading.Event()
        with self._pool(len(items)) as pool:
            futures = [pool.submit(_guarded, cancel, fn, item) for item in items]
            wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None and not isinstance(error, _Cancelled):
                raise error
        return [f.result() for f in futures]


def _is_directory_entry(name: str, info: Mapping[str, Any]) -> bool:
    """A listing entry that is a "directory", not an object: typed so by the filesystem,
    or a zero-size key ending in ``/`` (a directory marker object)."""
    if info.get("type") == "directory":
        return True
    key = str(info.get("Key") or info.get("name") or name)
    return (key.endswith("/") or name.endswith("/")) and not int(info.get("size") or 0)


def _guarded(cancel: threading.Event, fn: Callable[..., R], *args: Any) -> R:
    """Run ``fn`` unless ``cancel`` is set; set it when ``fn`` fails."""
    if cancel.is_set():
        raise _Cancelled
    try:
        return fn(*args)
    except BaseException:
        cancel.set()
        raise


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value or "")


def _first_error(failed: builtins.list[_PendingWrite]) -> BaseException:
    for item in failed[1:]:
        logger.error("also failed: %s", item.errors[0])
    return failed[0].errors[0]


def open_checkpoint(
    uri: str | os.PathLike[str],
    fs: fsspec.AbstractFileSystem | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    config: CheckpointConfig | None = None,
    expected: Mapping[str, WriteResult] | None = None,
    verify_checksums: bool = False,
) -> CheckpointStorage:
    """Resolve a checkpoint URI (or use ``fs``) into a :class:`CheckpointStorage`."""
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri:
        raise CheckpointNotFoundError(f"checkpoint location must be a non-empty URI, got {uri!r}")
    return CheckpointStorage(
        uri,
        fs=fs,
        storage_options=storage_options,
        config=config,
        expected=expected,
        verify_checksums=verify_checksums,
    )
