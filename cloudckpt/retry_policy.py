"""How failed storage requests are retried: :class:`RetryPolicy`, the ``retry`` field
of :class:`~cloudckpt.config.CheckpointConfig` (``retry: {max_attempts: 8, ...}`` in a
config section). :mod:`cloudckpt.storage.retry` applies it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from cloudckpt.errors import ConfigError

MAX_HASHED_KEY_PREFIX = 8
"""The most hex digits of a hashed key prefix (16**8 prefixes is far beyond need)."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a failed storage request is retried (S3 requests cloudckpt sends itself:
    whole-object PUTs, multipart parts, their start, completion and abort, ranged GETs).

    Throttling (503 SlowDown, 429), server errors (500, 502, 504), timeouts and dropped
    connections are retried with exponential backoff and full jitter: before attempt
    ``n + 1`` the request waits a random time in ``[0, min(max_delay_s, base_delay_s *
    2**(n-1))]``, or at least what the store's ``Retry-After`` (or
    ``x-amz-retry-after``) header asks. Other errors (access denied, not found, a
    failed precondition) are not retried. A retry resends the same bytes from memory,
    with the same CRC-32C.

    Attributes:
        max_attempts: attempts per request, the first included (1: no retries).
        base_delay_s: the backoff before the second attempt is at most this; it doubles
            with every attempt.
        max_delay_s: the longest backoff between two attempts (a ``Retry-After`` may ask
            for longer; the request deadline still bounds it).
        attempt_timeout_s: an attempt fails when the store sends nothing for this long
            (botocore's ``read_timeout``), and is retried.
        request_timeout_s: deadline of one request, all its attempts and waits
            included; then it fails with a :class:`~cloudckpt.errors.StorageTimeoutError`.
        operation_timeout_s: deadline of everything one opened checkpoint does in this
            process (one save, load or verify), counted from when it is opened: no
            request is started or retried after it. None: no such deadline.
        adaptive: lower the number of requests in flight while the store throttles
            (halved on a throttling answer, raised by one per window of successes).
    """

    max_attempts: int = 8
    base_delay_s: float = 0.25
    max_delay_s: float = 10.0
    attempt_timeout_s: float = 30.0
    request_timeout_s: float = 120.0
    operation_timeout_s: float | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigError(f"retry.max_attempts must be an integer >= 1, got {attempts!r}")
        for name in ("base_delay_s", "max_delay_s", "attempt_timeout_s", "request_timeout_s"):
            _check_seconds(f"retry.{name}", getattr(self, name))
        if self.operation_timeout_s is not None:
            _check_seconds("retry.operation_timeout_s", self.operation_timeout_s)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"retry.adaptive must be true or false, got {self.adaptive!r}")

    def backoff_cap(self, attempt: int) -> float:
        """The longest wait after failed attempt ``attempt`` (1-based), before jitter."""
        return float(min(self.max_delay_s, self.base_delay_s * 2 ** min(attempt - 1, 60)))


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


_RETRY_KEYS = tuple(f.name for f in dataclasses.fields(RetryPolicy))


def to_retry_policy(value: object) -> RetryPolicy:
    """A :class:`RetryPolicy` from itself, None (the defaults) or a mapping of its fields.

    Raises:
        ConfigError: an unknown field (the message lists the allowed ones) or a bad value.
    """
    if isinstance(value, RetryPolicy):
        return value
    if value is None:
        return RetryPolicy()
    if not isinstance(value, Mapping):
        raise ConfigError(f"retry must be a mapping of its settings, got {type(value).__name__}")
    unknown = [key for key in value if key not in _RETRY_KEYS]
    if unknown:
        raise ConfigError(
            f"unknown retry setting(s): {', '.join(sorted(map(repr, unknown)))}; "
            f"allowed: {', '.join(_RETRY_KEYS)}"
        )
    return RetryPolicy(**value)
