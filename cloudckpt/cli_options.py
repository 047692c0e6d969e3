"""Options and helpers shared by the storage subcommands of the ``cloudckpt`` command line.

``--config YAML`` and repeatable ``--storage-option KEY=VALUE`` (VALUE parsed as JSON when
it is JSON), ``--json`` and ``--progress``; the keyword arguments of the library calls they
give (:func:`_library_kwargs`); argparse types with a lower bound; and the check that a
parent prefix holds anything at all. :class:`UsageError` is what they raise for bad
arguments found after parsing (exit status 2, :mod:`cloudckpt.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from cloudckpt.config import CheckpointConfig, from_yaml
from cloudckpt.errors import CheckpointNotFoundError, ConfigError
from cloudckpt.redact import redact_uri
from cloudckpt.storage import open_checkpoint

Handler = Callable[[argparse.Namespace], int]
Subparsers = Any  # argparse._SubParsersAction is private


class UsageError(Exception):
    """Bad arguments found after parsing (e.g. an unreadable --config): exit status 2."""


def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (KEY, VALUE parsed as JSON, else the string). The value never
    appears in an error message: it may be a secret."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            "expected KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000"
        )
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key, value


def _add_store_options(
    parser: argparse.ArgumentParser, with_json: bool = True, with_progress: bool = False
) -> None:
    add = parser.add_argument
    add(
        "--config",
        metavar="YAML",
        help="a training config whose 'cloudckpt' section (or the whole file) sets "
        "storage_options, part_size and max_in_flight",
    )
    _add_storage_option_flag(
        parser,
        "--storage-option",
        "storage_options",
        "an fsspec storage option (repeatable; VALUE is parsed as JSON when it is JSON, "
        'e.g. endpoint_url=http://127.0.0.1:9000 or client_kwargs=\'{"region_name": '
        '"eu-west-1"}\'); overrides --config and the environment',
    )
    if with_json:
        add("--json", action="store_true", help="print JSON instead of a table")
    if with_progress:
        add(
            "--progress",
            action=argparse.BooleanOptionalAction,
            help="show a progress bar on stderr (default: when stderr is a terminal)",
        )


def _add_storage_option_flag(
    parser: argparse.ArgumentParser, flag: str, dest: str, help_text: str
) -> None:
    parser.add_argument(
        flag,
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        dest=dest,
        help=help_text,
    )


def _show_progress(args: argparse.Namespace) -> bool:
    if args.progress is not None:
        return bool(args.progress)
    return sys.stderr.isatty()


def _library_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``storage_options`` and ``config`` for the library calls, from --storage-option
    and --config.

    Raises:
        UsageError: the config file cannot be read or is invalid.
    """
    config: CheckpointConfig | None = None
    if args.config:
        try:
            config = from_yaml(args.config)
        except OSError as exc:
            raise UsageError(f"cannot read --config: {exc}") from exc
        except ConfigError as exc:
            raise UsageError(f"invalid --config: {exc}") from exc
    options = dict(args.storage_options) or None
    return {"storage_options": options, "config": config}


def _at_least(cast: Callable[[str], float], low: float, what: str) -> Callable[[str], Any]:
    """An argparse type: ``cast(text)``, which must be >= ``low`` (NaN is refused)."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not value >= low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


def _require_stored(parent_uri: str, kwargs: dict[str, Any]) -> None:
    """A parent prefix under which nothing is stored (a typo?) is an error, not an empty
    listing; one holding other objects but no checkpoint is listed as empty."""
    if open_checkpoint(parent_uri, **kwargs).is_empty():
        raise CheckpointNotFoundError(
            f"no checkpoint under {redact_uri(parent_uri)!r}: nothing is stored there"
        )
