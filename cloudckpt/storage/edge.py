"""The error contract at the I/O edge: only I/O errors are caught, and each becomes a
:class:`~cloudckpt.errors.StorageError` that keeps its built-in kind (refused
credentials stay a ``PermissionError``); anything else (a ``TypeError``: a bug)
propagates unchanged. No secret crosses the edge: the message is redacted, and so is
the client's error, which the StorageError keeps as its cause (google-auth's and
requests' errors embed URLs with ``access_token=...``, botocore's a bucket name with
inline credentials, aiohttp's the request's URL and headers).

An ``OSError`` that carries an errno (a full disk: ``ENOSPC``; ``EDQUOT``, ``EROFS``,
``EFBIG``, ``EACCES``) keeps it: the StorageError's ``errno`` is the same, it survives
the pickle that carries a rank's failure to the others, and the message names the
errno's symbol and the rank (``[Errno 28] failed to write <uri>: No space left on
device (ENOSPC, rank 1)``)."""

from __future__ import annotations

import errno
import functools

from cloudckpt.errors import StorageAccessDeniedError, StorageError, StorageTimeoutError
from cloudckpt.redact import redact_text, scrub_exception
from cloudckpt.storage.retry import current_rank

PRECONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict")
AUTH_ERROR_CODES = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "TokenRefreshRequired",
    "403",
)


@functools.cache
def io_errors() -> tuple[type[BaseException], ...]:
    """The exception types of a failed request: ``OSError`` (fsspec's contract, and
    timeouts) plus those of the installed clients (botocore, aiohttp, gcsfs,
    google-auth) that are not ``OSError`` subclasses."""
    found: list[type[BaseException]] = [OSError]
    for module, names in (
        ("botocore.exceptions", ("BotoCoreError", "ClientError")),
        ("aiohttp", ("ClientError",)),
        ("gcsfs.retry", ("HttpError",)),
        ("google.auth.exceptions", ("GoogleAuthError",)),
    ):
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        found += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return tuple(found)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ClientError ("" for anything else)."""
    response = getattr(exc, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def translate(exc: BaseException, message: str) -> StorageError:
    """The StorageError to raise for the I/O error ``exc``, with ``message`` (redacted).

    ``exc`` and the errors it chains to are scrubbed of secrets in place
    (:func:`~cloudckpt.redact.scrub_exception`): the caller raises the result ``from exc``.
    An errno of ``exc`` is kept (see the module docstring).
    """
    scrub_exception(exc)
    message = redact_text(message)
    number = exc.errno if isinstance(exc, OSError) and isinstance(exc.errno, int) else None
    kind: type[StorageError] = StorageError
    if isinstance(exc, PermissionError) or error_code(exc) in AUTH_ERROR_CODES:
        kind = StorageAccessDeniedError
    elif isinstance(exc, TimeoutError):  # a deadline of cloudckpt's retries, or a timeout
        kind = StorageTimeoutError
    if number is None:
        return kind(message)
    return kind(number, _with_errno(message, number))


def _with_errno(message: str, number: int) -> str:
    """``message`` for an error whose ``[Errno N]`` prefix ``str()`` adds: the one it
    quotes from ``exc`` dropped, the errno's symbol and this rank appended."""
    symbol = errno.errorcode.get(number, str(number))
    return f"{message.replace(f'[Errno {number}] ', '', 1)} ({symbol}, rank {current_rank()})"
