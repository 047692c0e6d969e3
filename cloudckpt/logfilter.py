"""Log records without secrets, from cloudckpt and from the libraries it calls.

A ``logging.Filter`` on a *logger* sees only the records logged to that very logger,
not those propagated from its children (``botocore.endpoint``, ``botocore.auth``,
``urllib3.connectionpool``, ...), and a library must not touch the user's handlers.
So :func:`install` wraps the process's log-record factory (``logging.setLogRecordFactory``,
chaining to the factory in place, the user's own included): every record made by a
logger of :data:`WATCHED_LOGGERS` or one of their children is scrubbed when it is made,
before any filter, handler or formatter sees it, whatever handlers the user configured
(pytest's ``caplog`` included). Records are only made for enabled levels, so nothing is
done while DEBUG is off. cloudckpt calls :func:`install` whenever it opens a checkpoint
(:func:`cloudckpt.storage.location.resolve`) and in the CLI; it is idempotent, and it
installs itself again if someone replaced the factory without chaining to it.

The CLI also puts a :class:`SecretFilter` on the handler it configures, which scrubs
every record that handler emits, whichever logger made it.

Scrubbing a record (:func:`scrub_record`): the formatted message goes through
:func:`~cloudckpt.redact.redact_text`; when that changes it, ``msg`` becomes the
redacted text and ``args`` empty. When the formatted traceback (``exc_info``) or
``stack_info`` shows a secret, the record carries the redacted traceback as
``exc_text`` and drops ``exc_info``, so that no formatter can format the original.
Records with nothing to hide are left as they are.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from cloudckpt.redact import redact_text

WATCHED_LOGGERS: tuple[str, ...] = (
    "cloudckpt",
    "s3fs",
    "fsspec",
    "gcsfs",
    "botocore",
    "aiobotocore",
    "boto3",
    "s3transfer",
    "urllib3",
    "requests",
    "google",
    "google_auth_httplib2",
    "aiohttp",
    "asyncio",
)
_MARK = "_cloudckpt_scrubs_secrets"
_install_lock = threading.Lock()
_formatter = logging.Formatter()


def _watched(name: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in WATCHED_LOGGERS)


def scrub_record(record: logging.LogRecord) -> logging.LogRecord:
    """Redact ``record``'s message and traceback in place (see the module docstring)."""
    try:
        message = record.getMessage()
    except Exception:  # noqa: BLE001 - a bad format string: logging reports it later
        return record
    clean = redact_text(message)
    if clean != message:
        record.msg, record.args = clean, ()
    if record.exc_info and record.exc_info[0] is not None:
        text = record.exc_text or _formatter.formatException(record.exc_info)
        clean_text = redact_text(text)
        if clean_text != text:
            record.exc_info, record.exc_text = None, clean_text
    if record.stack_info:
        record.stack_info = redact_text(record.stack_info)
    return record


class SecretFilter(logging.Filter):
    """A filter that scrubs every record it sees (:func:`scrub_record`) and drops none.

    Put it on a handler to cover every logger whose records reach that handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        scrub_record(record)
        return True


def install() -> None:
    """Scrub the records of :data:`WATCHED_LOGGERS` in this process from now on
    (idempotent; see the module docstring)."""
    with _install_lock:
        previous = logging.getLogRecordFactory()
        if getattr(previous, _MARK, False):
            return

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            if _watched(record.name):
                scrub_record(record)
            return record

        setattr(factory, _MARK, True)
        logging.setLogRecordFactory(factory)


def install_on_handler(handler: logging.Handler) -> logging.Handler:
    """Add a :class:`SecretFilter` to ``handler`` (once) and return it."""
    if not any(isinstance(f, SecretFilter) for f in handler.filters):
        handler.addFilter(SecretFilter())
    return handler
