"""S3 (and S3-compatible stores): uploads straight from tensor memory with a CRC-32C
per request, create-only writes (``If-None-Match: *``), multipart uploads with
concurrent parts that are aborted on failure, ranged GETs into tensor memory, every
request retried by cloudckpt's policy (:mod:`.retry`), listings, lookups and deletes
under that policy too (:mod:`.s3_listing`), listings of open uploads, and a first
request that fails within seconds on an unreachable endpoint or refused credentials,
naming the setting to fix (:mod:`.s3_access`)."""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import aiohttp.payload
import fsspec
import fsspec.asyn
import fsspec.exceptions

from cloudckpt.storage import s3_listing
from cloudckpt.storage.blocks import PartChecksum, part_checksum
from cloudckpt.storage.buffers import (
    BufferReader,
    SegmentsReader,
    crc32c,
    crc32c_base64,
    plan_parts,
)
from cloudckpt.storage.edge import error_code, io_errors, translate
from cloudckpt.storage.location import Location
from cloudckpt.storage.pool import RequestPool, guarded
from cloudckpt.storage.retry import Attempt, Retrier
from cloudckpt.storage.s3_access import check_access
from cloudckpt.storage.s3_listing import NOT_FOUND
from cloudckpt.storage.transport import Listed, StoreChecksumError, Transport
from cloudckpt.storage.types import OpenUpload

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from threading import Event

    from cloudckpt.retry_policy import RetryPolicy
    from cloudckpt.storage.buffers import Progress
    from cloudckpt.storage.pool import PendingWrite

logger = logging.getLogger(__name__)

R = TypeVar("R")

NO_SUCH_UPLOAD = ("NoSuchUpload", "404")


class S3Transport(Transport):
    """Requests through s3fs's botocore client, each retried by cloudckpt's policy
    (:mod:`cloudckpt.storage.retry`): botocore makes one attempt per call (a hook ends
    the call before botocore's retry handler) and s3fs's own retry loop is not used, so
    retries never multiply; listings, lookups and deletes too (:mod:`.s3_listing`). A
    retry sends the same bytes again, straight from memory, with the same CRC-32C."""

    multipart = True
    streams_uploads = True

    def __init__(
        self, location: Location, pool: RequestPool, part_size: int, retry: RetryPolicy
    ) -> None:
        super().__init__(location, pool, part_size, retry)
        self.retrier = Retrier(retry, pool.slots, (self.counters, pool.counters))
        check_access(location, retry)

    def put(
        self, path: str, view: memoryview | Sequence[memoryview], checksum: int, **extra: Any
    ) -> None:
        """One PUT of ``view`` (or of its pieces, in order) with its CRC-32C."""
        bucket, key, _ = self.fs.split_path(path)
        self.send(
            "put_object",
            body=view,
            Bucket=bucket,
            Key=key,
            ChecksumCRC32C=crc32c_base64(checksum),
            **extra,
        )
        self.fs.invalidate_cache(path)

    def create(self, path: str, view: memoryview, checksum: int) -> None:
        self.put(path, view, checksum, IfNoneMatch="*")

    def send(
        self,
        method: str,
        *,
        body: memoryview | Sequence[memoryview] | None = None,
        cleanup: bool = False,
        **kwargs: Any,
    ) -> Any:
        """One S3 call, retried; ``body`` (one buffer, or pieces sent one after another)
        is sent from memory by every attempt."""

        def attempt(attempt: Attempt) -> Any:
            extra = {} if body is None else {"Body": _reader(body)}
            return _once(self.fs, attempt.timeout_s, _call_once, method, **kwargs, **extra)

        return self.retrier.run(attempt, f"{method} {kwargs.get('Key', '')}", cleanup=cleanup)

    def call(self, method: str, **kwargs: Any) -> Any:
        """An S3 call without a body, retried (see :meth:`send`)."""
        return self.send(method, **kwargs)

    # -- listings, lookups, deletes (retried like every other request) -----------------

    def list_objects(self, path: str) -> list[Listed]:
        return s3_listing.list_objects(self, path)

    def list_level(self, path: str) -> list[Listed]:
        return s3_listing.list_level(self, path)

    def is_file(self, path: str) -> bool:
        return s3_listing.is_file(self, path)

    def size(self, path: str) -> int:
        return s3_listing.size(self, path)

    def delete(self, path: str, recursive: bool = False) -> None:
        s3_listing.delete(self, path, recursive)
        self.fs.invalidate_cache(path)

    def bucket_exists(self) -> bool:
        return s3_listing.bucket_exists(self)

    # -- reads -------------------------------------------------------------------------

    def fetch(
        self, path: str, start: int, end: int | None, *, store_checked: bool = False
    ) -> bytes:
        check = store_checked and not start and end is None  # S3 has none for ranges

        def attempt(attempt: Attempt) -> bytes:
            return bytes(self._get(path, attempt, start, end, None, check))

        return self._read(path, attempt)

    def fetch_into(self, path: str, out: memoryview, start: int) -> int:
        return self.fetch_scatter(path, start, (out,))

    def fetch_scatter(self, path: str, start: int, segments: Sequence[memoryview]) -> int:
        """One ranged GET streamed into ``segments`` in order (each attempt from the
        first): no copy of the body besides the one into the segments."""
        end = start + sum(segment.nbytes for segment in segments)

        def attempt(attempt: Attempt) -> int:
            return int(self._get(path, attempt, start, end, segments))

        return self._read(path, attempt)

    def _get(
        self,
        path: str,
        attempt: Attempt,
        start: int,
        end: int | None,
        out: Sequence[memoryview] | None,
        check: bool = False,
    ) -> bytes | int:
        bucket, key, version = self.fs.split_path(path)
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if version:
            kwargs["VersionId"] = version
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if check:
            kwargs["ChecksumMode"] = "ENABLED"
        result: bytes | int = _once(self.fs, attempt.timeout_s, _get_once, out, **kwargs)
        return result

    def _read(self, path: str, attempt: Callable[[Attempt], R]) -> R:
        try:
            return self.retrier.run(attempt, f"GET {path}")
        except io_errors() as exc:
            if error_code(exc) in NOT_FOUND:
                raise FileNotFoundError(f"no such object: {path}") from exc
            raise

    # -- multipart uploads -------------------------------------------------------------

    def start_multipart(
        self,
        executor: ThreadPoolExecutor,
        item: PendingWrite,
        path: str,
        progress: Progress,
        cancel: Event,
    ) -> None:
        item.upload_id = self.begin_upload(path, self._uri(item))
        for number, (start, end) in enumerate(plan_parts(item.view.nbytes, self.part_size), 1):
            item.futures.append(
                executor.submit(
                    guarded, cancel, self._upload_part, item, path, number, start, end, progress
                )
            )

    def _upload_part(
        self, item: PendingWrite, path: str, number: int, start: int, end: int, progress: Progress
    ) -> dict[str, Any]:
        part = item.view[start:end]
        # once, with the part's block CRCs: every attempt sends this one
        item.parts[number] = part_checksum(part, item.block_size)
        where = (self._uri(item), start)
        sent = self.send_part(path, str(item.upload_id), number, part, item.parts[number], where)
        progress.add(part.nbytes)
        return sent

    # -- multipart uploads written front to back (storage.streams.UploadStream) ---------

    def begin_upload(self, path: str, uri: str) -> str:
        """Start a multipart upload (parts with CRC-32Cs); its id."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            upload = self.call(
                "create_multipart_upload", Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C"
            )
        except io_errors() as exc:
            raise translate(exc, f"failed to start a multipart upload of {uri}: {exc}") from exc
        upload_id = str(upload["UploadId"])
        logger.debug("multipart upload %s of %s started", upload_id, uri)
        return upload_id

    def send_part(
        self,
        path: str,
        upload_id: str,
        number: int,
        body: memoryview | Sequence[memoryview],
        checksum: PartChecksum,
        where: tuple[str, int],
    ) -> dict[str, Any]:
        """Upload part ``number`` (``body``: its bytes, or its pieces in order), retried;
        what the completion lists for it. ``where``: the object's URI and the part's
        first byte, for the error."""
        bucket, key, _ = self.fs.split_path(path)
        crc = crc32c_base64(checksum.crc)
        try:
            response = self.send(
                "upload_part",
                body=body,
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                ChecksumCRC32C=crc,
            )
        except io_errors() as exc:
            uri, start = where
            raise translate(
                exc,
                f"failed to upload part {number} (bytes {start}-{start + checksum.length}) "
                f"of {uri}: {exc}",
            ) from exc
        return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": crc}

    def put_pieces(self, path: str, pieces: Sequence[memoryview], checksum: int) -> None:
        """Write a whole object from its pieces, in order, replacing any previous one."""
        self.put(path, pieces, checksum)

    def complete_multipart(self, item: PendingWrite, path: str) -> None:
        parts = [future.result() for future in item.futures]
        self.complete_upload(path, self._uri(item), str(item.upload_id), parts, item.view.nbytes)

    def complete_upload(
        self, path: str, uri: str, upload_id: str, parts: list[dict[str, Any]], size: int
    ) -> None:
        """Complete a multipart upload of ``size`` bytes from its ``parts``, retried."""
        bucket, key, _ = self.fs.split_path(path)

        def attempt(attempt: Attempt) -> None:
            try:
                _once(
                    self.fs,
                    attempt.timeout_s,
                    _call_once,
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except io_errors() as exc:
                # an earlier attempt completed it, but its answer was lost
                if not (attempt.number > 1 and error_code(exc) in NO_SUCH_UPLOAD):
                    raise
                if not self._has_object(bucket, key, size):
                    raise
                logger.info("%s: a retried completion found its upload complete", uri)

        try:
            self.retrier.run(attempt, f"complete {uri}")
        except io_errors() as exc:
            raise translate(
                exc, f"failed to complete the multipart upload of {uri}: {exc}"
            ) from exc
        self.fs.invalidate_cache(path)

    def _has_object(self, bucket: str, key: str, size: int) -> bool:
        try:
            head = self.call("head_object", Bucket=bucket, Key=key)
        except io_errors():
            return False
        return bool(head.get("ContentLength") == size)

    def abort_multipart(self, item: PendingWrite, path: str) -> None:
        self.abort_started(path, self._uri(item), str(item.upload_id))

    def abort_started(self, path: str, uri: str, upload_id: str) -> None:
        """Abort a multipart upload, logging (not raising) a failure."""
        bucket, key, _ = self.fs.split_path(path)
        try:
            self._abort(bucket, key, upload_id)
            logger.info("aborted multipart upload of %s", uri)
        except io_errors() as exc:  # keep the original error; say what is left
            logger.warning(
                "could not abort multipart upload %s of %s (`cloudckpt gc` or a bucket "
                "lifecycle rule will remove it): %s",
                upload_id,
                uri,
                exc,
            )

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        """Abort an upload, retried; one already gone (an earlier attempt's answer was
        lost, or another process aborted it) counts as aborted."""
        try:
            self.send(
                "abort_multipart_upload",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                cleanup=True,
            )
        except io_errors() as exc:
            if error_code(exc) not in NO_SUCH_UPLOAD:
                raise

    def open_uploads(self) -> list[OpenUpload]:
        bucket, key, _ = self.fs.split_path(self.location.root)
        prefix = key.rstrip("/") + "/" if key else ""
        uploads: list[OpenUpload] = []
        markers: dict[str, str] = {}
        while True:
            page = self.call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
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
        bucket, key, _ = self.fs.split_path(self.location.full_path(upload.path))
        self._abort(bucket, key, upload.upload_id)

    def _uri(self, item: PendingWrite) -> str:
        return self.location.child_uri(item.relpath)


def _once(fs: Any, timeout_s: float, request: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run one attempt (``request(fs, timeout_s, ...)``, a coroutine function) on the
    filesystem's event loop; one that passed ``timeout_s`` raises a ``TimeoutError``
    that says so (fsspec's own has no message)."""
    try:
        return fsspec.asyn.sync(fs.loop, request, fs, timeout_s, *args, **kwargs)
    except fsspec.exceptions.FSTimeoutError as exc:
        raise TimeoutError(f"no answer within {timeout_s:.1f} s") from exc


async def _call_once(fs: Any, timeout_s: float, method: str, **kwargs: Any) -> Any:
    """One attempt of an S3 API call, within ``timeout_s`` seconds: straight to the
    botocore client, not through s3fs's retry loop (which would resend a body without
    rewinding it), and with botocore's own retries switched off for this call only
    (:func:`_one_botocore_attempt`). s3fs's ``s3_additional_kwargs`` (for example
    server-side encryption settings) still apply."""
    await fs.set_session()
    client = await fs.get_s3(kwargs.get("Bucket"))
    events = client.meta.events
    events.register_first("needs-retry.s3", _one_botocore_attempt, unique_id=_ONE_ATTEMPT_HOOK)
    events.register_first("before-sign.s3", _unsigned_body, unique_id=_UNSIGNED_HOOK)
    events.register_first("before-send.s3", _body_from_memory, unique_id=_VIEW_BODY_HOOK)
    call = getattr(client, method)
    _ONE_ATTEMPT.set(True)  # this task only: s3fs's own calls keep botocore's retries
    return await asyncio.wait_for(call(**fs._get_s3_method_kwargs(call, **kwargs)), timeout_s)


_ONE_ATTEMPT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cloudckpt_one_botocore_attempt", default=False
)
_ONE_ATTEMPT_HOOK = "cloudckpt-one-botocore-attempt"


def _one_botocore_attempt(
    response: Any = None, caught_exception: BaseException | None = None, **kwargs: Any
) -> None:
    """botocore's ``needs-retry`` hook, first in line: for cloudckpt's own calls, end
    the call after its first attempt with what botocore would raise without retries (the
    connection error, or the error answer as a ``ClientError``), before botocore's retry
    handler can schedule another attempt. Other calls go on to botocore's handler."""
    if not _ONE_ATTEMPT.get():
        return
    if caught_exception is not None:
        raise caught_exception
    if response is not None and response[0].status_code >= 300:
        from botocore.exceptions import ClientError  # type: ignore[import-untyped]  # noqa: PLC0415

        operation = kwargs.get("operation")
        raise ClientError(response[1], getattr(operation, "name", "request"))


_UNSIGNED_HOOK = "cloudckpt-unsigned-body"
_VIEW_BODY_HOOK = "cloudckpt-view-body"
# client configs with payload signing switched off, by the client's own config
_UNSIGNED_CONFIGS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _unsigned_body(request: Any = None, **kwargs: Any) -> None:
    """botocore's ``before-sign`` hook: a body of cloudckpt's (a :class:`BufferReader`)
    sent to a loopback endpoint over plain HTTP is not SHA-256 hashed for the signature
    (``UNSIGNED-PAYLOAD``, as botocore itself does over HTTPS when a checksum header
    comes with the body): its CRC-32C header, which is signed and which the store
    checks, protects it. Hashing cost about 0.6 CPU-s per GB (plus a copy of the body
    to feed the hash) on the client that shares its cores with the store. Elsewhere,
    and when the client's config sets ``s3={"payload_signing_enabled": ...}``, botocore
    decides as it always does."""
    if request is None or not isinstance(getattr(request, "data", None), _READERS):
        return
    if not _is_loopback_http(str(request.url)):
        return
    config = request.context.get("client_config")
    if config is None:
        return
    unsigned = _UNSIGNED_CONFIGS.get(config)
    if unsigned is None:
        s3 = dict(getattr(config, "s3", None) or {})
        if "payload_signing_enabled" in s3:
            unsigned = config  # the user's explicit choice
        else:
            from botocore.config import Config  # type: ignore[import-untyped]  # noqa: PLC0415

            unsigned = config.merge(Config(s3={**s3, "payload_signing_enabled": False}))
        _UNSIGNED_CONFIGS[config] = unsigned
    request.context["client_config"] = unsigned


def _is_loopback_http(url: str) -> bool:
    """Whether ``url`` is plain HTTP to this host (127.0.0.0/8, ::1, localhost)."""
    if not url.startswith("http://"):
        return False
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _body_from_memory(request: Any = None, **kwargs: Any) -> None:
    """botocore's ``before-send`` hook: a body of cloudckpt's (a :class:`BufferReader`)
    goes to aiohttp as the memory it reads (:class:`_ViewPayload`), not as a file, which
    aiohttp reads in 256 KiB chunks, each copied (``read``) in a thread of the loop's
    executor: a thread hop and a copy per chunk."""
    body = getattr(request, "body", None)
    if isinstance(body, BufferReader):
        request.body = _ViewPayload([body.remaining()])
    elif isinstance(body, SegmentsReader):
        request.body = _ViewPayload(body.remaining())


_READERS = (BufferReader, SegmentsReader)


def _reader(body: memoryview | Sequence[memoryview]) -> BufferReader | SegmentsReader:
    return BufferReader(body) if isinstance(body, memoryview) else SegmentsReader(body)


SEND_SLICE = 1024 * 1024
"""Bytes handed to the connection per write of a :class:`_ViewPayload`: the socket
takes most of a slice at once, so little is copied into the transport's buffer."""


class _ViewPayload(aiohttp.payload.Payload):
    """A request body sent from memory: written to the connection in slices of
    :data:`SEND_SLICE` bytes, waiting for each to drain (aiohttp's ``BytesPayload``
    would hand it over whole: all the socket does not take at once is copied into the
    transport's buffer)."""

    def __init__(self, pieces: list[memoryview]) -> None:
        super().__init__(pieces, content_type="application/octet-stream")
        self._view_size = sum(piece.nbytes for piece in pieces)
        self._size = self._view_size
        self._pieces = pieces

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._pieces).decode(encoding, errors)

    async def as_bytes(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"".join(self._pieces)

    async def write(self, writer: Any) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        left = self._view_size if content_length is None else content_length
        for piece in self._pieces:
            view = piece[:left]
            for start in range(0, view.nbytes, SEND_SLICE):
                await writer.write(view[start : start + SEND_SLICE])
            left -= view.nbytes
            if left <= 0:
                return


async def _get_once(
    fs: Any, timeout_s: float, out: Sequence[memoryview] | None, **kwargs: Any
) -> bytes | int:
    """One attempt of a GET within ``timeout_s``: the body as bytes, or written into
    the views of ``out`` in order (returns the bytes written). A body cut short raises
    (and is retried)."""

    async def get() -> bytes | int:
        response = await _call_once(fs, timeout_s, "get_object", **kwargs)
        body = response["Body"]
        try:
            if out is None:
                data = bytes(await body.read())
                if "ChecksumMode" in kwargs:
                    check_store_crc32c(response.get("ChecksumCRC32C"), data)
                return data
            total = 0
            for view in out:
                got = 0
                while got < view.nbytes and (n := await body.readinto(view[got:])):
                    got += int(n)
                total += got
                if got < view.nbytes:
                    break
            return total
        finally:
            body.close()

    return await asyncio.wait_for(get(), timeout_s)


def check_store_crc32c(stored: str | None, data: bytes) -> None:
    """Compare the CRC-32C S3 returned for a whole object with the bytes received.

    Nothing to compare when S3 returned none (the object was written without one) or a
    composite one (``<base64>-<parts>``: a checksum of the part checksums, not of the
    bytes). Raises :class:`StoreChecksumError` on a difference.
    """
    if not stored or "-" in stored:
        return
    received = crc32c_base64(crc32c(data))
    if received != stored:
        raise StoreChecksumError(
            f"the store's CRC-32C of the object is {stored}, that of the {len(data)} bytes "
            f"received {received}: damaged in transit"
        )


def _iso(value: Any) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value or "")
