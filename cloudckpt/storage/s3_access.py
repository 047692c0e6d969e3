"""The first request to an S3 store: fail within seconds, naming the setting to fix,
when the endpoint cannot be reached or refuses the credentials (not after botocore's
retries with backoff), and wait no longer than a data request would for a store that
accepts connections but does not answer."""

from __future__ import annotations

import copy
import logging
import weakref
from typing import TYPE_CHECKING, Any

import fsspec

from cloudckpt.errors import StorageAccessDeniedError, StorageError, StorageUnreachableError
from cloudckpt.redact import redact_uri
from cloudckpt.storage.edge import AUTH_ERROR_CODES, error_code, io_errors

if TYPE_CHECKING:
    from cloudckpt.retry_policy import RetryPolicy
    from cloudckpt.storage.location import Location

logger = logging.getLogger(__name__)

PROBE_CONNECT_TIMEOUT_S = 2.0
PROBE_READ_TIMEOUT_S = 5.0
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
# filesystems whose first request succeeded (one probe per client, not per checkpoint)
_checked: weakref.WeakSet[fsspec.AbstractFileSystem] = weakref.WeakSet()


def check_access(location: Location, retry: RetryPolicy) -> None:
    """List one key under the root through a client of the same settings that makes one
    attempt with short timeouts, once per filesystem instance: an unreachable endpoint or
    refused credentials fail within seconds, not after botocore's retries with backoff
    (data requests keep them). The probe waits at most ``PROBE_READ_TIMEOUT_S`` for the
    answer, less when ``retry.attempt_timeout_s`` or ``retry.operation_timeout_s`` is
    less; a store that does not answer it in time is left to the real requests and
    their deadlines.

    Raises:
        StorageUnreachableError / StorageAccessDeniedError: naming the settings to fix.
    """
    fs = location.fs
    bucket, key, _ = fs.split_path(location.root)
    if not bucket or fs in _checked:
        return
    waits = (PROBE_READ_TIMEOUT_S, retry.attempt_timeout_s, retry.operation_timeout_s)
    read_timeout = min(wait for wait in waits if wait is not None)
    probe = type(fs)(**_probe_options(dict(fs.storage_options), read_timeout))
    probe.retries = 1  # s3fs's own retry loop, around botocore's
    try:
        probe.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
    except io_errors() as exc:  # anything else is left to the real request
        error = _access_error(exc, location.uri, _endpoint_of(probe))
        if error is not None:
            raise error from exc
        logger.debug("%s: first request failed: %s", location.uri, exc)
    _checked.add(fs)


def _probe_options(options: dict[str, Any], read_timeout: float) -> dict[str, Any]:
    config_kwargs = copy.deepcopy(dict(options.get("config_kwargs") or {}))
    config_kwargs.update(
        connect_timeout=PROBE_CONNECT_TIMEOUT_S,
        read_timeout=read_timeout,
        retries={"mode": "standard", "total_max_attempts": 1},
    )
    return {**options, "config_kwargs": config_kwargs, "skip_instance_cache": True}


def _endpoint_of(fs: Any) -> str:
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    return redact_uri(str(url)) if url else "the default AWS endpoint"


def _access_error(exc: BaseException, uri: str, endpoint: str) -> StorageError | None:
    """The error to raise for a failed first request, or None when it is neither a
    connection failure nor refused credentials."""
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
    code = error_code(cause)
    if code in AUTH_ERROR_CODES or (not code and isinstance(exc, PermissionError)):
        return StorageAccessDeniedError(
            f"the S3 endpoint {endpoint} refused the credentials for {uri} "
            f"({code or type(exc).__name__}: {exc}). The credentials come from "
            f"{CREDENTIAL_SETTINGS}"
        )
    return None
