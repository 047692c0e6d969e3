"""How long cloudckpt's collectives may wait (:mod:`cloudckpt.dist_guard` bounds them).

:class:`Bounds` holds the collective timeout and the heartbeat timeout, resolved from a
:class:`~cloudckpt.config.CheckpointConfig`'s fields, else the environment
(``$CLOUDCKPT_COLLECTIVE_TIMEOUT_S``, ``$CLOUDCKPT_HEARTBEAT_TIMEOUT_S``), else the
defaults; :func:`current_bounds` gives those of the innermost
:func:`cloudckpt.dist_guard.bounded` block.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from cloudckpt.errors import ConfigError

ENV_COLLECTIVE_TIMEOUT = "CLOUDCKPT_COLLECTIVE_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "CLOUDCKPT_HEARTBEAT_TIMEOUT_S"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
BEATS_PER_TIMEOUT = 5
MIN_BEAT_S = 0.1
WAIT_SLICE_S = 0.2  # how often a waiting rank looks at its deadline and the heartbeats


@dataclass(frozen=True)
class Bounds:
    """How long cloudckpt's collectives may wait (see :class:`CheckpointConfig`'s
    ``collective_timeout_s`` and ``heartbeat_timeout_s``); heartbeat 0: off."""

    collective_timeout_s: float
    heartbeat_timeout_s: float

    @classmethod
    def resolve(
        cls,
        collective_timeout_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Bounds:
        """The given values, else the environment's, else the defaults."""
        env = os.environ if environ is None else environ
        collective = collective_timeout_s
        if collective is None:
            collective = _env_seconds(env, ENV_COLLECTIVE_TIMEOUT, DEFAULT_COLLECTIVE_TIMEOUT_S)
        heartbeat = heartbeat_timeout_s
        if heartbeat is None:
            heartbeat = _env_seconds(env, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S)
        return cls(float(collective), float(heartbeat))

    @property
    def beat_s(self) -> float:
        return max(MIN_BEAT_S, self.heartbeat_timeout_s / BEATS_PER_TIMEOUT)


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0 or (value == 0 and name == ENV_COLLECTIVE_TIMEOUT):
        raise ConfigError(f"${name} must be a number of seconds > 0, got {raw!r}")
    return value


_BOUNDS: ContextVar[Bounds | None] = ContextVar("cloudckpt_collective_bounds", default=None)


def current_bounds() -> Bounds:
    """The bounds of the innermost :func:`bounded` block, else the environment's."""
    return _BOUNDS.get() or Bounds.resolve()
