"""The removal's mark in ``manifest.json``'s slot.

A commit and a removal (``cloudckpt gc``, ``cloudckpt rm``) of one checkpoint exclude
each other through one create-only write of ``manifest.json``: the save's commit
creates it holding the manifest, the removal creates it holding a *tombstone* before it
deletes anything. Whichever create comes first decides: a save whose commit finds the
tombstone raises :class:`~cloudckpt.errors.CommitConflictError`, and a removal that
finds a manifest knows the checkpoint was committed (see :mod:`cloudckpt.removal`).

This module only writes and recognises the tombstone's bytes (pure, no I/O).
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TOMBSTONE_KEY = "cloudckpt_removal"
"""The tombstone document's one top-level key (a manifest never has it)."""
_PREFIX = ('{"' + TOMBSTONE_KEY + '"').encode()
PEEK_BYTES = 256
"""Bytes of ``manifest.json`` that tell a tombstone from a manifest (:func:`is_tombstone`)."""


@dataclass(frozen=True)
class Tombstone:
    """Who took a checkpoint's ``manifest.json`` slot to remove it, and when.

    Attributes:
        removal: a random id of this removal.
        host: the host that ran it.
        pid: its process id.
        started: ISO 8601 UTC time it began.
    """

    removal: str
    host: str
    pid: int
    started: str

    @classmethod
    def new(cls) -> Tombstone:
        """A tombstone of this process, now."""
        return cls(
            removal=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )

    def to_json(self) -> bytes:
        """``{"cloudckpt_removal": {...}}``: the key first, so :func:`is_tombstone` needs
        only the object's first bytes."""
        body = {
            "removal": self.removal,
            "host": self.host,
            "pid": self.pid,
            "started": self.started,
        }
        return (json.dumps({TOMBSTONE_KEY: body}) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Tombstone | None:
        """The tombstone ``raw`` holds, or None when it holds none (a manifest, or a
        document that is not a readable tombstone)."""
        if not is_tombstone(raw):
            return None
        try:
            doc = json.loads(raw)
            body: Mapping[str, Any] = doc[TOMBSTONE_KEY]
            return cls(
                removal=str(body["removal"]),
                host=str(body["host"]),
                pid=int(body["pid"]),
                started=str(body["started"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        """``host H, pid P, at T``, for messages."""
        return f"host {self.host}, pid {self.pid}, at {self.started}"


def is_tombstone(head: bytes) -> bool:
    """Whether ``head``, the first bytes (at least :data:`PEEK_BYTES`, or all) of a
    ``manifest.json``, are a tombstone's."""
    return head.lstrip().startswith(_PREFIX)
