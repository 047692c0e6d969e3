"""Secrets never shown: the one place that knows what a secret looks like.

* :func:`redact_options` and :func:`redact_uri` make storage options and a URI safe to
  log, print or put in a message (:mod:`cloudckpt.config` re-exports both);
* :func:`redact_text` does the same for free text: log lines of any library, exception
  messages, CLI output;
* :func:`remember_secrets` registers the secret values cloudckpt is handed (storage
  options, a URI's userinfo), so that :func:`redact_text` removes them wherever they
  show up, whatever surrounds them (s3fs logs ``'Bucket': 'KEY:SECRET@bucket'`` for a
  URI with inline credentials, which no pattern recognises);
* :func:`scrub_exception` rewrites, in place, the text of an exception raised by a
  client library (botocore, aiohttp, requests, google-auth) and of the exceptions it
  chains to, so that re-raising it as a cause shows no secret.

What :func:`redact_text` removes, each replaced by ``***``: the values remembered; a
URI's userinfo password (and, for ``s3://`` / ``gs://``, the access key before it);
PEM private keys; the values of query parameters, ``name=value`` pairs, ``name: value``
headers and ``'name': 'value'`` dict or JSON items whose name ends in a secret word
(token, secret, password, signature, credential, authorization, private key, access
key, ...: presigned URLs' ``X-Amz-Signature`` / ``X-Amz-Credential`` /
``X-Amz-Security-Token`` / ``Signature`` / ``GoogleAccessId``, google-auth's
``access_token=``, botocore's ``Authorization`` header, ``Credential=`` and
``Signature=`` inside it); ``Bearer`` / ``Basic`` credentials; Google OAuth access
tokens (``ya29.``); AWS access key ids and STS session tokens by their prefixes.
"""

from __future__ import annotations

import copyreg
import functools
import os
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, quote, quote_plus, unquote_plus, urlsplit, urlunsplit

_REDACTED = "***"
_SECRET_OPTION_PARTS = ("secret", "password", "token", "key", "credential", "session")
_SECRET_QUERY_PARTS = ("signature", "token", "credential", "secret", "key", "password")
_PUBLIC_TOKENS = frozenset({"anon", "google_default", "cloud", "browser", "cache"})
# schemes whose userinfo user is an access key, not a user name
_KEYED_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs"})
# environment variables read by botocore / google-auth themselves
_SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
_MIN_REMEMBERED = 6  # shorter values would redact ordinary words; patterns still apply
_MAX_REMEMBERED = 256
_NOT_SECRETS = frozenset({_REDACTED, "None", "null", "True", "False", "true", "false"})
_MIN_BARE_AFTER_COLON = 8  # "name: value" without quotes: shorter values are prose


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
    user = userinfo.partition(":")[0]
    if user and parts.scheme.lower() in _KEYED_SCHEMES:
        user = _REDACTED
    return f"{user}:{_REDACTED}@{host}"


def _redact_query(query: str) -> str:
    pairs = query.split("&")
    for i, pair in enumerate(pairs):
        name, _, value = pair.partition("=")
        if value and _is_secret_name(unquote_plus(name), _SECRET_QUERY_PARTS):
            pairs[i] = f"{name}={_REDACTED}"
    return "&".join(pairs)


def redact_uri(uri: str) -> str:
    """``uri`` safe to log or show.

    A password in the userinfo (``scheme://user:pass@host/...``; for ``s3://`` and
    ``gs://`` the user too, an access key there) and the values of query parameters
    whose names contain "signature", "token", "credential", "secret", "key" or
    "password" (case-insensitive; e.g. presigned URLs' ``X-Amz-Signature``) become
    ``"***"``. Anything else - plain paths, URIs with nothing to hide, strings that do
    not parse as URIs - comes back unchanged.
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


# -- secrets in free text ---------------------------------------------------------------

# a name ending in one of these words names a secret (separators optional, any case)
_SECRET_NAME = (
    r"(?:secret|password|passwd|token|signature|credentials?|authorization"
    r"|private[_-]?key(?:[_-]?id)?|access[_-]?key(?:[_-]?id)?|secret[_-]?key|api[_-]?key"
    r"|google[_-]?access[_-]?id|session[_-]?key)"
)
_NAME = rf"[\w.\-]*{_SECRET_NAME}"  # a name ending in a secret word
# a value: quoted (Python bytes / str repr or JSON, escapes included) or bare
_VALUE = r"""b?'(?:[^'\\\n]|\\.)*'|b?"(?:[^"\\\n]|\\.)*"|[^\s'",;&)\]}>]+"""
_PEM = re.compile(
    r"-----BEGIN((?:\s|%20|\+|[A-Z0-9])*?)PRIVATE(?:\s|%20|\+)KEY-----.*?"
    r"(?:-----END(?:\s|%20|\+|[A-Z0-9])*?PRIVATE(?:\s|%20|\+)KEY-----|\Z)",
    re.DOTALL,
)
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^\s/?#@:'\"<>]*)"
    r":(?P<password>[^\s/?#@'\"<>]*)@"
)
_QUERY_PARAM = re.compile(
    rf"(?P<head>[?&;](?:{_NAME}|[\w.\-]*(?:key|sig)))=(?P<value>[^&\s'\"<>#]+)",
    re.IGNORECASE,
)
# matched from the secret word on (the name's start does not matter): a closing quote or
# the separator right after it means the name ends there
_NAMED_VALUE = re.compile(
    rf"(?P<head>{_SECRET_NAME}['\"]?\s*(?P<sep>[:=])\s*)(?P<value>{_VALUE})",
    re.IGNORECASE,
)
# s3fs takes "s3://KEY:SECRET@bucket/..." for a bucket named "KEY:SECRET@bucket"
_S3FS_BUCKET = re.compile(r"""(?P<head>['"]Bucket['"]:\s*['"])[^'"@:/]*:[^'"@/]*@""")
_AUTH_SCHEME = re.compile(r"\b(?P<head>Bearer|Basic)\s+[A-Za-z0-9._~+/\-]{8,}=*", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(
    r"\b(?:(?P<google>ya29\.|1//)[\w.\-]{8,}"  # Google OAuth access / refresh tokens
    r"|(?P<aws>AKIA|ASIA|ABIA|ACCA)[A-Z0-9]{16}\b"  # AWS access key ids
    r"|(?P<sts>FwoGZXIvYXdz|IQoJb3JpZ2lu)[A-Za-z0-9+/=%]{16,})"  # AWS STS session tokens
)


_NAME_HINTS = ("secret", "passw", "token", "signature", "credential", "authoriz", "key", "access")
_TOKEN_HINTS = ("ya29.", "1//", "AKIA", "ASIA", "ABIA", "ACCA", "FwoGZXIvYXdz", "IQoJb3JpZ2lu")


def _userinfo(match: re.Match[str]) -> str:
    scheme = match["scheme"]
    user = match["user"]
    if user and scheme[:-3].lower() in _KEYED_SCHEMES:
        user = _REDACTED
    return f"{scheme}{user}:{_REDACTED}@"


def _named_value(match: re.Match[str]) -> str:
    value = match["value"]
    prefix = "b" if value[:2] in ("b'", 'b"') else ""
    quoted = value[len(prefix)] in "'\""
    bare = value[len(prefix) + 1 : -1] if quoted else value
    if bare in _PUBLIC_TOKENS or bare in _NOT_SECRETS:
        return match[0]
    if quoted:
        return f"{match['head']}{prefix}{value[-1]}{_REDACTED}{value[-1]}"
    if match["sep"] == ":" and len(value) < _MIN_BARE_AFTER_COLON:
        return match[0]  # prose ("ExpiredToken: An error occurred ..."), not a header
    return f"{match['head']}{_REDACTED}"


def _token_shape(match: re.Match[str]) -> str:
    prefix = match["google"] or match["aws"] or ""
    return f"{prefix}{_REDACTED}"


_remembered: dict[str, None] = {}  # an ordered set, oldest first
_remembered_lock = threading.Lock()


@functools.lru_cache(maxsize=8)
def _remembered_pattern(values: tuple[str, ...]) -> re.Pattern[str] | None:
    if not values:
        return None
    return re.compile("|".join(re.escape(v) for v in sorted(values, key=len, reverse=True)))


def _remember_value(value: str) -> None:
    if len(value) < _MIN_REMEMBERED or value in _PUBLIC_TOKENS or os.path.exists(value):
        return  # a file name (gcsfs's token=PATH) is no secret
    with _remembered_lock:
        for form in {value, quote(value, safe=""), quote_plus(value)}:
            _remembered.pop(form, None)
            _remembered[form] = None
        while len(_remembered) > _MAX_REMEMBERED:
            del _remembered[next(iter(_remembered))]


def _remember_option(name: str, value: Any) -> None:
    if isinstance(value, str) and _is_secret_name(name, _SECRET_OPTION_PARTS):
        _remember_value(value)
    elif isinstance(value, Mapping):  # client_kwargs, or a service-account info dict
        for key, inner in value.items():
            _remember_option(str(key), inner)


def remember_secrets(options: Mapping[str, Any] | None = None, uri: str | None = None) -> None:
    """Remember the secret values in ``options`` and ``uri`` for :func:`redact_text`.

    From ``options`` (recursively): the string value of every key whose name contains
    "secret", "password", "token", "key", "credential" or "session" (a service-account
    dict's ``private_key`` too), except credential-method names (``"anon"``, ...). From
    ``uri``: the userinfo password (and, for ``s3://`` / ``gs://``, the access key
    before it). Also the AWS / Google credentials in the environment. Values shorter
    than 6 characters are left to the patterns; the 256 most recent are kept.
    """
    for name in _SECRET_ENV:
        if os.environ.get(name):
            _remember_value(os.environ[name])
    for key, value in (options or {}).items():
        _remember_option(str(key), value)
    if uri:
        _remember_uri(uri)


def _remember_uri(uri: str) -> None:
    for match in _USERINFO.finditer(uri):
        if match["password"]:
            _remember_value(match["password"])
        if match["scheme"][:-3].lower() in _KEYED_SCHEMES and match["user"]:
            _remember_value(match["user"])


def redact_text(text: str) -> str:
    """``text`` (a log line, an exception message, CLI output) with every secret this
    module recognises replaced by ``***`` (see the module docstring). Idempotent;
    text with nothing to hide comes back unchanged."""
    with _remembered_lock:
        values = tuple(_remembered)
    pattern = _remembered_pattern(values)
    if pattern is not None:
        text = pattern.sub(_REDACTED, text)
    # each pattern runs only when a substring it needs is there: DEBUG logs are many
    lowered = text.lower()
    if "@" in text and "://" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "bucket" in lowered:
        text = _S3FS_BUCKET.sub(rf"\g<head>{_REDACTED}:{_REDACTED}@", text)
    if "private" in lowered:
        text = _PEM.sub(rf"-----BEGIN\1PRIVATE KEY-----{_REDACTED}-----END\1PRIVATE KEY-----", text)
    if "=" in text:
        text = _QUERY_PARAM.sub(rf"\g<head>={_REDACTED}", text)
    if any(word in lowered for word in _NAME_HINTS):
        text = _NAMED_VALUE.sub(_named_value, text)
    if "bearer" in lowered or "basic" in lowered:
        text = _AUTH_SCHEME.sub(rf"\g<head> {_REDACTED}", text)
    if any(hint in text for hint in _TOKEN_HINTS):
        text = _TOKEN_SHAPES.sub(_token_shape, text)
    return text


# -- secrets in exceptions --------------------------------------------------------------

_MAX_DEPTH = 4  # how deep scrub_exception looks into containers held by an exception
_MASKED_TEXT = "_cloudckpt_redacted_text"


def scrub_exception(exc: BaseException) -> BaseException:
    """Rewrite, in place, the text of ``exc`` and of every exception it chains to
    (``__cause__``, ``__context__``, exceptions held in its arguments) with
    :func:`redact_text`; return ``exc``.

    Strings in ``args``, in ``OSError``'s ``strerror`` / ``filename`` and in the
    instance's attributes (dicts, lists and tuples of them too) are redacted. An
    exception whose ``str`` or ``repr`` still shows a secret after that - its class
    builds the text from other objects, as aiohttp's ``ClientResponseError`` does from
    its request's URL and headers - is given a subclass of its class (same name, same
    module) that shows the redacted text; where Python refuses that (built-in classes),
    its text came from ``args`` and is clean already.
    """
    _scrub(exc, set())
    return exc


def _scrub(exc: BaseException, seen: set[int]) -> None:
    if id(exc) in seen:
        return
    seen.add(id(exc))
    _set_if_changed(exc, "args", _scrub_value(exc.args, seen, 0))
    if isinstance(exc, OSError):
        for name in ("strerror", "filename", "filename2"):
            _set_if_changed(exc, name, _scrub_value(getattr(exc, name, None), seen, 0))
    for name, value in list(getattr(exc, "__dict__", {}).items()):
        _set_if_changed(exc, name, _scrub_value(value, seen, 0))
    _mask_text(exc)
    for chained in (exc.__cause__, exc.__context__):
        if chained is not None:
            _scrub(chained, seen)


def _set_if_changed(exc: BaseException, name: str, value: Any) -> None:
    try:
        if value is not getattr(exc, name, None):
            setattr(exc, name, value)
    except (AttributeError, TypeError):  # a read-only property
        pass


def _scrub_value(value: Any, seen: set[int], depth: int) -> Any:
    if isinstance(value, str):
        clean = redact_text(value)
        return value if clean == value else clean
    if isinstance(value, BaseException):
        _scrub(value, seen)
        return value
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, dict):
        items = {k: _scrub_value(v, seen, depth + 1) for k, v in value.items()}
        changed = any(items[k] is not v for k, v in value.items())
        return items if changed else value
    if type(value) in (list, tuple):
        scrubbed = [_scrub_value(v, seen, depth + 1) for v in value]
        changed = any(a is not b for a, b in zip(scrubbed, value, strict=True))
        return type(value)(scrubbed) if changed else value
    return value


def _mask_text(exc: BaseException) -> None:
    """Give ``exc`` a class that shows its redacted text when its own still leaks."""
    try:
        text, shown = str(exc), repr(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ is not ours to fix
        return
    clean_text, clean_shown = redact_text(text), redact_text(shown)
    if clean_text == text and clean_shown == shown:
        return
    try:
        exc.__dict__[_MASKED_TEXT] = (clean_text, clean_shown)
        exc.__class__ = _masked_class(type(exc))
    except (TypeError, AttributeError):  # built-in classes: their text comes from args
        exc.__dict__.pop(_MASKED_TEXT, None)


_masked_classes: dict[type[BaseException], type[BaseException]] = {}


def _masked_class(cls: type[BaseException]) -> type[BaseException]:
    with _remembered_lock:
        if cls not in _masked_classes:
            _masked_classes[cls] = _make_masked_class(cls)
        return _masked_classes[cls]


def _make_masked_class(cls: type[BaseException]) -> type[BaseException]:
    def __str__(self: BaseException) -> str:  # noqa: N807
        return str(self.__dict__[_MASKED_TEXT][0])

    def __repr__(self: BaseException) -> str:  # noqa: N807
        return str(self.__dict__[_MASKED_TEXT][1])

    namespace = {
        "__str__": __str__,
        "__repr__": __repr__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    masked = type(cls.__name__, (cls,), namespace)
    copyreg.pickle(masked, _reduce_masked)
    return masked


def _reduce_masked(exc: BaseException) -> tuple[Any, ...]:
    """Pickle a masked exception as one of its original class (pickle finds classes by
    name, and the name leads to the original)."""
    reduced = list(exc.__reduce__())
    if reduced[0] is type(exc):
        reduced[0] = type(exc).__mro__[1]
    if len(reduced) > 2 and isinstance(reduced[2], dict):
        reduced[2] = {k: v for k, v in reduced[2].items() if k != _MASKED_TEXT}
    return tuple(reduced)
