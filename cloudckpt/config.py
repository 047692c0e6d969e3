"""Checkpoint configuration: defaults, limits and where storage options come from.

:class:`CheckpointConfig` holds where a checkpoint lives and how it is written (backend,
multipart part size, request concurrency, zarr chunk size). Build it directly, from the
``cloudckpt`` section of a training config (:func:`from_dict`) or from a YAML file
(:func:`from_yaml`).

Storage options - the keyword arguments of the fsspec filesystem (``endpoint_url``,
``key``, ``secret``, ``token``, ``client_kwargs``, ...) - come from three sources, in
increasing precedence::

    explicit storage_options  >  config section  >  environment

1. the environment (:func:`env_storage_options`): ``AWS_ENDPOINT_URL_S3`` /
   ``AWS_ENDPOINT_URL`` and ``AWS_PROFILE`` for S3, ``STORAGE_EMULATOR_HOST`` for GCS.
   Credentials are never copied out of the environment; botocore and google-auth read
   them through their own default credential chains.
2. ``CheckpointConfig.storage_options`` (the config section).
3. the ``storage_options`` a caller passes explicitly.

:func:`resolve_storage_options` merges them key by key; ``client_kwargs`` and
``config_kwargs`` are merged one level deeper.

Secrets are never logged: whatever this module logs or shows in a repr goes through
:func:`redact_options` or :func:`redact_uri` first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import yaml

from cloudckpt.errors import ConfigError
from cloudckpt.redact import redact_options, redact_uri
from cloudckpt.retry_policy import MAX_HASHED_KEY_PREFIX, RetryPolicy, to_retry_policy

logger = logging.getLogger(__name__)

MiB = 2**20
GiB = 2**30

# S3's multipart limits (also those of MinIO and GCS's XML API).
S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000

DEFAULT_PART_SIZE = 32 * MiB
"""Objects larger than this go up as multipart uploads of parts this size."""
DEFAULT_MAX_IN_FLIGHT = 16
"""The most storage requests (whole objects, parts or ranges) one process keeps in flight."""
DEFAULT_CHUNK_SIZE = 256 * MiB
"""Shards larger than this are split into several zarr chunks (objects)."""

_SECTION = "cloudckpt"
_CONFIG_KEYS = (
    "uri",
    "storage_options",
    "backend",
    "part_size",
    "max_in_flight",
    "chunk_size",
    "retry",
    "hashed_key_prefix",
    "collective_timeout_s",
    "heartbeat_timeout_s",
)
_NESTED_OPTION_KEYS = ("client_kwargs", "config_kwargs")

# gcsfs's ``token`` values that name a credential method rather than hold a credential.

_SIZE_RE = re.compile(r"\s*(\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})\s*([kmgt]i?b|b)?\s*", re.I)
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{prefix}b": 1000**power for power, prefix in enumerate("kmgt", start=1)},
    **{f"{prefix}ib": 1024**power for power, prefix in enumerate("kmgt", start=1)},
}


@dataclass(frozen=True, repr=False)
class CheckpointConfig:
    """Where a checkpoint lives and how it is written.

    Attributes:
        uri: checkpoint location (``s3://bucket/run/iter_0001000``, ``gs://...``, a local
            path), or None when the caller supplies it later.
        storage_options: fsspec filesystem options (``endpoint_url``, ``key``, ``secret``,
            ``token``, ``client_kwargs``, ...); stored as a plain ``dict`` copy.
        backend: sharded backend name ("torch_dist", the default as in Megatron-Core, or "zarr").
        part_size: multipart upload part size in bytes, within S3's limits.
        max_in_flight: the most storage requests one process keeps in flight.
        chunk_size: shards larger than this many bytes are split into several objects;
            None disables splitting.
        retry: how failed storage requests are retried (:class:`RetryPolicy`); a
            mapping of its fields is accepted too.
        hashed_key_prefix: torch_dist only: this many hex digits of a hash in front of
            each data object's name (``<uri>/3f/__0_0.distcp``), spreading one
            checkpoint's requests over S3 prefixes; 0 (the default) keeps DCP's flat
            layout. The DCP metadata records the paths, so readers need no setting.
        collective_timeout_s: the longest any rank waits in one of cloudckpt's
            collectives for the other ranks (then every waiting rank raises a
            :class:`~cloudckpt.errors.CollectiveTimeoutError` naming the silent ranks),
            independent of the process group's own timeout (gloo's is 30 minutes).
            None: ``$CLOUDCKPT_COLLECTIVE_TIMEOUT_S``, else 600. It must exceed the
            longest time one rank may legitimately wait for the others (a slower rank's
            upload).
        heartbeat_timeout_s: a rank whose heartbeat (a counter each rank advances in the
            process group's store from a background thread) stops for this long while
            others wait for it is reported lost (killed, crashed or frozen) at once, with
            a :class:`~cloudckpt.errors.RankLostError`. None:
            ``$CLOUDCKPT_HEARTBEAT_TIMEOUT_S``, else 15; 0 turns heartbeats off.
    """

    uri: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    backend: str = "torch_dist"
    part_size: int = DEFAULT_PART_SIZE
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    chunk_size: int | None = DEFAULT_CHUNK_SIZE
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    hashed_key_prefix: int = 0
    collective_timeout_s: float | None = None
    heartbeat_timeout_s: float | None = None

    def __post_init__(self) -> None:
        """Validate every field; raise :class:`ConfigError` naming the field and value."""
        _check_uri(self.uri)
        object.__setattr__(self, "storage_options", _check_options(self.storage_options))
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError(f"backend must be a non-empty string, got {self.backend!r}")
        _check_int("part_size", self.part_size, S3_MIN_PART_SIZE, S3_MAX_PART_SIZE)
        _check_int("max_in_flight", self.max_in_flight, 1)
        if self.chunk_size is not None:
            _check_int("chunk_size", self.chunk_size, 1)
        object.__setattr__(self, "retry", to_retry_policy(self.retry))
        prefix = self.hashed_key_prefix
        if (
            isinstance(prefix, bool)
            or not isinstance(prefix, int)
            or not (0 <= prefix <= MAX_HASHED_KEY_PREFIX)
        ):
            raise ConfigError(
                f"hashed_key_prefix must be an integer from 0 (off) to {MAX_HASHED_KEY_PREFIX} "
                f"hex digits, got {prefix!r}"
            )
        _check_optional_seconds("collective_timeout_s", self.collective_timeout_s, zero=False)
        _check_optional_seconds("heartbeat_timeout_s", self.heartbeat_timeout_s, zero=True)

    def __repr__(self) -> str:
        """Show every field (retry settings when not the defaults), with secrets in the URI
        and storage options redacted."""
        uri = None if self.uri is None else redact_uri(self.uri)
        return (
            f"{type(self).__name__}(uri={uri!r}, "
            f"storage_options={redact_options(self.storage_options)!r}, "
            f"backend={self.backend!r}, part_size={self.part_size!r}, "
            f"max_in_flight={self.max_in_flight!r}, chunk_size={self.chunk_size!r}"
            f"{self._non_default_repr()})"
        )

    def _non_default_repr(self) -> str:
        """``, retry=..., hashed_key_prefix=...`` for those not at their defaults."""
        shown = [
            f", {name}={getattr(self, name)!r}"
            for name, default in (
                ("retry", RetryPolicy()),
                ("hashed_key_prefix", 0),
                ("collective_timeout_s", None),
                ("heartbeat_timeout_s", None),
            )
            if getattr(self, name) != default
        ]
        return "".join(shown)

    def replace(self, **changes: Any) -> CheckpointConfig:
        """A copy with ``changes`` applied (and validated), like :func:`dataclasses.replace`."""
        return dataclasses.replace(self, **changes)

    def max_object_size(self) -> int:
        """The largest object one multipart upload can carry with this part size."""
        return self.part_size * S3_MAX_PARTS


def _format_size(nbytes: int) -> str:
    for unit, factor in (("GiB", GiB), ("MiB", MiB)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} bytes"


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if high is not None and not low <= value <= high:
        raise ConfigError(
            f"{name}={value!r} is out of range: must be between {low} ({_format_size(low)}) "
            f"and {high} ({_format_size(high)})"
        )
    if value < low:
        raise ConfigError(f"{name}={value!r} is out of range: must be >= {low}")


def _check_optional_seconds(name: str, value: object, *, zero: bool) -> None:
    """None, or a positive number of seconds (or 0 where ``zero`` allows it)."""
    if value is None:
        return
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or value < 0 or (value == 0 and not zero):  # type: ignore[operator]
        allowed = "a number of seconds >= 0 (0: off)" if zero else "a positive number of seconds"
        raise ConfigError(f"{name} must be None or {allowed}, got {value!r}")


def _check_uri(uri: object) -> None:
    if uri is None or (isinstance(uri, str) and uri):
        return
    got = "an empty string" if uri == "" else type(uri).__name__  # never show a value
    raise ConfigError(f"uri must be a non-empty string or None, got {got}")


def _check_options(options: object) -> dict[str, Any]:
    if not isinstance(options, Mapping):
        # Only the type: the value may hold credentials.
        raise ConfigError(f"storage_options must be a mapping, got {type(options).__name__}")
    bad = [key for key in options if not isinstance(key, str)]
    if bad:
        raise ConfigError(f"storage_options keys must be strings, got {bad!r}")
    return dict(options)


def parse_size(value: int | str) -> int:
    """A size in bytes from an int or a string such as ``"64MiB"``, ``"8 MB"`` or ``"1.5GiB"``.

    Units are case-insensitive: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB
    (powers of 1024); a bare number means bytes. The result must be a whole number of bytes.

    Raises:
        ConfigError: ``value`` is negative, a bool, not a whole number of bytes or not
            a size at all.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return value
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match:
            number, unit = match.groups()
            size = Fraction(number) * _SIZE_UNITS[(unit or "").lower()]
            if size.denominator == 1:
                return int(size)
    raise ConfigError(
        f"invalid size {value!r}: expected a whole, non-negative number of bytes, "
        "optionally with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '64MiB'"
    )


def _to_uri(value: object) -> object:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _to_options(value: object) -> object:
    return {} if value is None else value


def _to_optional_size(value: Any) -> int | None:
    return None if value is None else parse_size(value)


def _identity(value: object) -> object:
    return value


_CONVERTERS: dict[str, Callable[[Any], object]] = {
    "uri": _to_uri,
    "storage_options": _to_options,
    "backend": _identity,
    "part_size": parse_size,
    "max_in_flight": _identity,
    "chunk_size": _to_optional_size,
    "retry": to_retry_policy,
    "hashed_key_prefix": _identity,
    "collective_timeout_s": _identity,
    "heartbeat_timeout_s": _identity,
}


def _unwrap_section(section: object) -> Mapping[Any, Any]:
    if not isinstance(section, Mapping):
        raise ConfigError(
            f"a {_SECTION} config section must be a mapping, got {type(section).__name__}"
        )
    inner = section.get(_SECTION) if len(section) == 1 else None
    return inner if isinstance(inner, Mapping) else section


def from_dict(section: Mapping[str, Any]) -> CheckpointConfig:
    """Build a :class:`CheckpointConfig` from a training-config section.

    Keys are those of :class:`CheckpointConfig`; sizes (``part_size``, ``chunk_size``) also
    accept :func:`parse_size` strings, ``chunk_size`` and ``storage_options`` accept None,
    ``uri`` accepts an ``os.PathLike``. A mapping whose only key is ``"cloudckpt"`` is
    unwrapped first. Missing keys keep their defaults.

    Raises:
        ConfigError: an unknown key (the message lists the allowed ones), or a value of
            the wrong type or out of range (the message names its key).
    """
    section = _unwrap_section(section)
    unknown = [key for key in section if key not in _CONFIG_KEYS]
    if unknown:
        raise ConfigError(
            f"unknown {_SECTION} config key(s): {', '.join(sorted(map(repr, unknown)))}; "
            f"allowed keys: {', '.join(_CONFIG_KEYS)}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        try:
            kwargs[key] = _CONVERTERS[key](value)
        except ConfigError as exc:
            raise ConfigError(f"{_SECTION} config key {key!r}: {exc}") from exc
    return CheckpointConfig(**kwargs)


def _load_yaml(path: str) -> Any:
    # A binary stream lets PyYAML detect the encoding, and its error marks then carry
    # no snippet of the file's text (which could hold a secret).
    with open(path, "rb") as stream:
        try:
            return yaml.safe_load(stream)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from exc


def _select_section(doc: Mapping[Any, Any], section: str | None, path: str) -> Mapping[Any, Any]:
    if section is None:
        return doc
    if section in doc:
        value = doc[section]
        if value is None:  # "cloudckpt:" with nothing under it
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: section {section!r} must be a mapping, got {type(value).__name__}"
            )
        return value
    if all(key in _CONFIG_KEYS for key in doc):
        return doc
    raise ConfigError(
        f"{path}: no {section!r} section, and the top level is not such a section "
        f"(top-level keys: {', '.join(sorted(map(str, doc)))})"
    )


def from_yaml(source: str | os.PathLike[str], section: str | None = _SECTION) -> CheckpointConfig:
    """Build a :class:`CheckpointConfig` from a local YAML file.

    Args:
        source: path of the YAML file.
        section: top-level key of the checkpoint section. When the file has no such key,
            the whole document is used if all its keys are config keys. None uses the
            whole document (see :func:`from_dict`).

    Returns:
        The config; the defaults for an empty file.

    Raises:
        ConfigError: invalid YAML, a missing or malformed section or an invalid value;
            the message names the file.
        OSError: the file cannot be read.
    """
    path = os.fspath(source)
    doc = _load_yaml(path)
    if doc is None:
        return CheckpointConfig()
    if not isinstance(doc, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(doc).__name__}")
    selected = _select_section(doc, section, path)
    try:
        config = from_dict(selected)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    logger.debug("loaded checkpoint config from %s: %r", path, config)
    return config


def env_storage_options(protocol: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Storage options for the fsspec ``protocol`` taken from the environment.

    For ``s3``/``s3a``: ``endpoint_url`` from ``AWS_ENDPOINT_URL_S3`` (else
    ``AWS_ENDPOINT_URL``) and ``profile`` from ``AWS_PROFILE``; credentials are left to
    botocore's credential chain. For ``gs``/``gcs``: with ``STORAGE_EMULATOR_HOST`` set,
    ``endpoint_url`` (``http://`` added when it has no scheme) and anonymous ``token``.
    Other protocols get no options.

    Args:
        protocol: fsspec protocol name.
        environ: the environment to read; ``os.environ`` by default.
    """
    env = os.environ if environ is None else environ
    protocol = protocol.lower()
    options: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            options["endpoint_url"] = endpoint
        if env.get("AWS_PROFILE"):
            options["profile"] = env["AWS_PROFILE"]
    elif protocol in ("gs", "gcs"):
        host = env.get("STORAGE_EMULATOR_HOST")
        if host:
            options["endpoint_url"] = host if "://" in host else f"http://{host}"
            options["token"] = "anon"
    return options


def _merge_into(merged: dict[str, Any], options: Mapping[str, Any]) -> None:
    for key, value in options.items():
        below = merged.get(key)
        if key in _NESTED_OPTION_KEYS and isinstance(value, Mapping):
            merged[key] = {**(below if isinstance(below, Mapping) else {}), **value}
        else:
            merged[key] = value


def _log_sources(
    protocol: str, sources: Sequence[tuple[str, Mapping[str, Any]]], merged: Mapping[str, Any]
) -> None:
    if not logger.isEnabledFor(logging.DEBUG):
        return  # redacting costs a little; skip it when nothing would be logged
    contributed = "; ".join(
        f"{name} {redact_options(options)}" for name, options in sources if options
    )
    logger.debug(
        "storage options for %r from %s -> %s",
        protocol,
        contributed or "no source",
        redact_options(merged),
    )


def resolve_storage_options(
    protocol: str,
    explicit: Mapping[str, Any] | None = None,
    config: CheckpointConfig | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Merge storage options: ``explicit`` > ``config.storage_options`` > environment.

    The merge is per top-level key, except that mappings under ``client_kwargs`` and
    ``config_kwargs`` are merged one level deep (the higher source wins per inner key).
    The inputs are never mutated.

    Args:
        protocol: fsspec protocol, for :func:`env_storage_options`.
        explicit: options passed by the caller.
        config: checkpoint config whose ``storage_options`` apply.
        environ: the environment to read; ``os.environ`` by default.

    Returns:
        A new dict of options.
    """
    sources = (
        ("environment", env_storage_options(protocol, environ)),
        ("config", {} if config is None else config.storage_options),
        ("explicit", explicit or {}),
    )
    merged: dict[str, Any] = {}
    for _, options in sources:
        _merge_into(merged, options)
    _log_sources(protocol, sources, merged)
    return merged
