"""Secrets never shown: storage options and URIs made safe to log, print or put in a
message (:func:`redact_options`, :func:`redact_uri`). :mod:`cloudckpt.config`
re-exports both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, unquote_plus, urlsplit, urlunsplit

_REDACTED = "***"
_SECRET_OPTION_PARTS = ("secret", "password", "token", "key", "credential", "session")
_SECRET_QUERY_PARTS = ("signature", "token", "credential", "secret", "key", "password")
_PUBLIC_TOKENS = frozenset({"anon", "google_default", "cloud", "browser"})


def _is_secret_name(name: object, parts: tuple[str, ...]) -> bool:
    lowered = str(name).lower()
    return any(part in lowered for part in parts)


def _redact_value(key: str, value: Any) -> Any:
    if value is None:
        return None
    if key.lower() == "token" and isinstance(value, str) and value in _PUBLIC_TOKENS:
        return value
    return _REDACTED


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` safe to log or show.

    The value of every key whose name contains "secret", "password", "token", "key",
    "credential" or "session" (case-insensitive) becomes ``"***"``, unless it is None or
    a ``token`` naming a credential method (``"anon"``, ``"google_default"``, ...).
    Nested mappings (``client_kwargs``) are redacted recursively, and strings elsewhere
    go through :func:`redact_uri`.
    """
    redacted: dict[str, Any] = {}
    for key, value in options.items():
        if _is_secret_name(key, _SECRET_OPTION_PARTS):
            redacted[key] = _redact_value(str(key), value)
        elif isinstance(value, Mapping):
            redacted[key] = redact_options(value)
        elif isinstance(value, str):
            redacted[key] = redact_uri(value)
        else:
            redacted[key] = value
    return redacted


def _redact_netloc(parts: SplitResult) -> str:
    if not parts.password:
        return parts.netloc
    userinfo, _, host = parts.netloc.rpartition("@")
    return f"{userinfo.partition(':')[0]}:{_REDACTED}@{host}"


def _redact_query(query: str) -> str:
    pairs = query.split("&")
    for i, pair in enumerate(pairs):
        name, _, value = pair.partition("=")
        if value and _is_secret_name(unquote_plus(name), _SECRET_QUERY_PARTS):
            pairs[i] = f"{name}={_REDACTED}"
    return "&".join(pairs)


def redact_uri(uri: str) -> str:
    """``uri`` safe to log or show.

    A password in the userinfo (``scheme://user:pass@host/...``) and the values of query
    parameters whose names contain "signature", "token", "credential", "secret", "key"
    or "password" (case-insensitive; e.g. presigned URLs' ``X-Amz-Signature``) become
    ``"***"``. Anything else - plain paths, URIs with nothing to hide, strings that do not
    parse as URIs - comes back unchanged.
    """
    try:
        parts = urlsplit(uri)
    except ValueError:  # e.g. a malformed IPv6 host
        return uri
    if not parts.netloc:
        return uri
    netloc = _redact_netloc(parts)
    query = _redact_query(parts.query) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return uri
    return urlunsplit(parts._replace(netloc=netloc, query=query))
