"""Retries of the storage requests cloudckpt sends itself: exponential backoff with
full jitter, the store's ``Retry-After``, a deadline per request and per opened
checkpoint, and the adaptive limit of requests in flight (:mod:`.pool`).

What is retried (:func:`classify`): throttling (503 SlowDown, 429, "Throttling"
codes), server errors (500, 502, 504), timeouts, dropped or reset connections and
bodies cut short. Everything else (403, 404, 412, a bug) is raised at once.

One layer retries, not three. botocore's client is configured for one attempt
(:mod:`.location`) and the S3 transport calls it directly, not through s3fs's own
retry loop, so one of these requests is sent at most ``max_attempts`` times, never
``max_attempts`` x botocore's x s3fs's. Listings, HEADs and deletes are such requests too
(:mod:`.s3_listing`); only the probe of a new filesystem's first request goes through
s3fs, with one attempt (:mod:`.s3_access`).

Hand-written rather than with tenacity or backoff: the loop needs the failed
response's ``Retry-After`` to set the next wait, a deadline shared by every request of
a save, each attempt to hold a slot of the adaptive pool (and not while it waits),
and counters; with a library each would be a custom hook, and the loop itself is
some 30 lines.
"""

from __future__ import annotations

import email.utils
import functools
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Protocol, TypeVar

from cloudckpt.retry_policy import RetryPolicy

logger = logging.getLogger(__name__)


class SlotLimit(Protocol):
    """The limit of requests in flight an attempt holds a slot of
    (:class:`~cloudckpt.storage.pool.AdaptiveLimit`): entered for a ticket, told when
    that attempt was throttled or any succeeded."""

    def __enter__(self) -> int: ...
    def __exit__(self, *exc: object) -> None: ...
    def throttled(self, ticket: int) -> None: ...
    def succeeded(self) -> None: ...


T = TypeVar("T")

THROTTLING_STATUSES = frozenset({429, 503})
SERVER_ERROR_STATUSES = frozenset({500, 502, 504})
THROTTLING_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "RequestThrottled",
        "ServiceUnavailable",
    }
)
SERVER_ERROR_CODES = frozenset({"InternalError", "RequestTimeout", "BadGateway", "GatewayTimeout"})


class Failure(Enum):
    """Why an attempt failed, when that is worth another attempt."""

    THROTTLED = "throttled"
    SERVER_ERROR = "server error"
    TIMEOUT = "timeout"
    CONNECTION = "connection error"


class RetriesExhausted(OSError):
    """A request failed on every attempt it was allowed; its ``__cause__`` is the last
    error. The storage edge turns it into a :class:`~cloudckpt.errors.StorageError`
    naming the object."""


class RequestDeadlineExceeded(RetriesExhausted, TimeoutError):
    """A request, or the opened checkpoint's operation, passed its deadline."""


@dataclass(frozen=True)
class RequestStats:
    """Counts of requests and of what went wrong with them (see :class:`RequestCounters`).

    ``retries`` is the number of extra attempts; ``throttled`` ... ``connection_errors``
    count failed attempts by kind; ``gave_up`` counts requests that failed for good.
    ``requests`` and those count the requests cloudckpt retries itself (S3); ``reads``
    and ``bytes_read`` count the reads of object bytes (whole or ranged GETs, on every
    kind of store) and the bytes they returned.
    """

    requests: int = 0
    retries: int = 0
    throttled: int = 0
    server_errors: int = 0
    timeouts: int = 0
    connection_errors: int = 0
    gave_up: int = 0
    reads: int = 0
    bytes_read: int = 0

    def __add__(self, other: RequestStats) -> RequestStats:
        return RequestStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __sub__(self, other: RequestStats) -> RequestStats:
        return RequestStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def summary(self) -> str:
        """``"3 retries (2 throttled, 1 timeouts)"``, for a log line."""
        kinds = ", ".join(
            f"{getattr(self, name)} {label}"
            for name, label in (
                ("throttled", "throttled"),
                ("server_errors", "server errors"),
                ("timeouts", "timeouts"),
                ("connection_errors", "connection errors"),
                ("gave_up", "given up"),
            )
            if getattr(self, name)
        )
        return f"{self.retries} retries" + (f" ({kinds})" if kinds else "")


_FIELD_OF = {
    Failure.THROTTLED: "throttled",
    Failure.SERVER_ERROR: "server_errors",
    Failure.TIMEOUT: "timeouts",
    Failure.CONNECTION: "connection_errors",
}


class RequestCounters:
    """Thread-safe running counts behind :class:`RequestStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys((f.name for f in fields(RequestStats)), 0)

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            self._counts[name] += count

    def snapshot(self) -> RequestStats:
        with self._lock:
            return RequestStats(**self._counts)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a request: its number (1-based) and the seconds it may take."""

    number: int
    timeout_s: float


class Retrier:
    """Runs requests under a :class:`RetryPolicy`, one slot of ``limit`` per attempt.

    Args:
        policy: attempts, backoff and deadlines.
        limit: the process's adaptive limit of requests in flight.
        counters: where to count requests and failures (e.g. the storage's and the
            process's).
    """

    def __init__(
        self, policy: RetryPolicy, limit: SlotLimit, counters: Sequence[RequestCounters]
    ) -> None:
        self.policy = policy
        self.limit = limit
        self.counters = tuple(counters)
        self.operation_deadline = (
            None
            if policy.operation_timeout_s is None
            else time.monotonic() + policy.operation_timeout_s
        )
        # after a request gave up on a store that stopped answering, the next ones make
        # one attempt each until one succeeds: a save's clean-up (aborting its uploads)
        # then fails fast instead of waiting out every request's retries in turn
        self._unreachable_until = 0.0

    def run(self, request: Callable[[Attempt], T], what: str, *, cleanup: bool = False) -> T:
        """Call ``request`` until it succeeds, fails with an error not worth retrying
        (raised as is), or runs out of attempts or time (:class:`RetriesExhausted`,
        :class:`RequestDeadlineExceeded`, with the last error as ``__cause__``).

        ``cleanup`` requests (aborting a failed save's uploads) ignore the operation's
        deadline, which may be what failed the save."""
        state = _RequestState(self._allowed_attempts())
        while True:
            state.number += 1
            with self.limit as ticket:
                state.started = time.monotonic() if state.started is None else state.started
                deadline, which = self._deadline(state.started, cleanup)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._gave_up(state, f"{which} passed", True) from state.error
                try:
                    result = request(Attempt(state.number, remaining))
                except Exception as exc:  # noqa: BLE001 - re-raised unless retryable
                    state.failed(exc)  # raises it when not worth retrying
                    if state.failure is Failure.THROTTLED and self.policy.adaptive:
                        self.limit.throttled(ticket)
                else:
                    self.limit.succeeded()
                    self._unreachable_until = 0.0
                    self._count("requests")
                    return result
            self._count(_FIELD_OF[state.failure])
            if state.number >= state.allowed:
                raise self._gave_up(state, self._why_exhausted(state), False) from state.error
            wait = self._wait(state.number, state.error)
            if time.monotonic() + wait >= deadline:
                why = f"{which} would pass during the {wait:.1f} s wait before another attempt"
                raise self._gave_up(state, why, True) from state.error
            logger.debug(
                "%s: attempt %d failed (%s), retrying in %.2f s: %s",
                what,
                state.number,
                state.failure.value,
                wait,
                state.error,
            )
            time.sleep(wait)
            self._count("retries")

    def _allowed_attempts(self) -> int:
        return 1 if time.monotonic() < self._unreachable_until else self.policy.max_attempts

    def _why_exhausted(self, state: _RequestState) -> str:
        if state.allowed < self.policy.max_attempts:
            return "one attempt: an earlier request found the store not answering"
        return f"retry.max_attempts={self.policy.max_attempts}"

    def _deadline(self, started: float, cleanup: bool = False) -> tuple[float, str]:
        request = started + self.policy.request_timeout_s
        deadline = (
            request,
            f"the request deadline retry.request_timeout_s={self.policy.request_timeout_s:g}",
        )
        operation = self.operation_deadline
        if not cleanup and operation is not None and operation < request:
            deadline = (
                operation,
                f"the deadline of this save or load, retry.operation_timeout_s="
                f"{self.policy.operation_timeout_s:g}",
            )
        return deadline

    def _wait(self, attempt: int, error: BaseException | None) -> float:
        """Full jitter, but at least what the store asked for."""
        jittered = random.uniform(0.0, self.policy.backoff_cap(attempt))
        asked = None if error is None else retry_after(error)
        return jittered if asked is None else max(jittered, asked)

    def _count(self, name: str) -> None:
        for counters in self.counters:
            counters.add(name)

    def _gave_up(self, state: _RequestState, why: str, timed_out: bool) -> RetriesExhausted:
        self._count("gave_up")
        if state.failure in (Failure.CONNECTION, Failure.TIMEOUT) and state.error is not None:
            self._unreachable_until = time.monotonic() + self.policy.request_timeout_s
        kind = RequestDeadlineExceeded if timed_out else RetriesExhausted
        error = state.error
        last = f"; last error: {type(error).__name__}: {error}" if error is not None else ""
        elapsed = time.monotonic() - (state.started or time.monotonic())
        return kind(
            f"gave up on rank {current_rank()} after {state.number if error else 0} "
            f"attempt(s) in {elapsed:.1f} s ({why}){last}"
        )


@dataclass
class _RequestState:
    """The attempts of one request so far."""

    allowed: int
    number: int = 0
    started: float | None = None
    error: BaseException | None = None
    failure: Failure = Failure.CONNECTION

    def failed(self, exc: Exception) -> None:
        """Record a failed attempt; re-raise ``exc`` when retrying cannot help."""
        failure = classify(exc)
        if failure is None:
            raise exc
        self.failure, self.error = failure, exc


def classify(exc: BaseException) -> Failure | None:
    """What kind of retryable failure ``exc`` is, or None when retrying cannot help."""
    status, code = _status_and_code(exc)
    if status in THROTTLING_STATUSES or code in THROTTLING_CODES:
        return Failure.THROTTLED
    if status in SERVER_ERROR_STATUSES or code in SERVER_ERROR_CODES:
        return Failure.SERVER_ERROR
    if status is not None:
        return None  # any other answer of the store: 4xx
    if isinstance(exc, (TimeoutError, *_timeout_errors())):
        return Failure.TIMEOUT
    if isinstance(exc, (ConnectionError, *_transport_errors())):
        return Failure.CONNECTION
    return None


def retry_after(exc: BaseException) -> float | None:
    """Seconds the store asked to wait: ``Retry-After`` (seconds or an HTTP date; the
    standard header, which botocore ignores) or ``x-amz-retry-after`` (milliseconds)."""
    headers = _response(exc).get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
    value = headers.get("retry-after")
    if value is not None:
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if _is_date(value) else None
            return None if when is None else max(0.0, when.timestamp() - time.time())
    value = headers.get("x-amz-retry-after")
    try:
        return None if value is None else max(0.0, int(value) / 1000.0)
    except ValueError:
        return None


def _is_date(value: str) -> bool:
    try:
        return email.utils.parsedate_to_datetime(value) is not None
    except (TypeError, ValueError):
        return False


def _response(exc: BaseException) -> dict[str, Any]:
    response = getattr(exc, "response", None)
    return response if isinstance(response, dict) else {}


def _status_and_code(exc: BaseException) -> tuple[int | None, str]:
    response = _response(exc)
    if not response:
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = str(response.get("Error", {}).get("Code", ""))
    return (int(status) if status is not None else None), code


@functools.cache
def _timeout_errors() -> tuple[type[BaseException], ...]:
    """botocore's timeouts (not built-in ``TimeoutError`` subclasses)."""
    try:
        from botocore import exceptions  # type: ignore[import-untyped]  # noqa: PLC0415
    except ImportError:
        return ()
    return (exceptions.ReadTimeoutError, exceptions.ConnectTimeoutError)


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    """Errors of the installed HTTP clients for a connection that dropped or a body cut
    short (imported on first use: botocore and aiohttp are optional)."""
    found: list[type[BaseException]] = []
    for module, names in (
        ("botocore.exceptions", ("ConnectionError", "HTTPClientError", "IncompleteReadError")),
        ("botocore.parsers", ("ResponseParserError",)),  # throttling pages of bad XML
        ("aiohttp", ("ClientConnectionError", "ClientPayloadError")),
    ):
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:
            continue
        found += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return tuple(found)


def current_rank() -> int:
    """This process's rank for messages: torch.distributed's when a group is initialised
    (without importing torch here), else ``$RANK``, else 0."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
