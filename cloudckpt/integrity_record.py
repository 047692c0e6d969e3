"""Megatron-Core 0.19's integrity record of a committed checkpoint, ``integrity.json``:
the objects it covers (:func:`integrity_sources`), their SHA-256 digests read back
(:func:`sha256_digests`) and the record written create-only
(:func:`write_integrity_record`), for ``save(..., verify_integrity=True)``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence

from cloudckpt.manifest import INTEGRITY_FNAME
from cloudckpt.storage import CheckpointStorage, WriteResult

logger = logging.getLogger(__name__)


def integrity_sources(storage: CheckpointStorage) -> list[tuple[str, int]]:
    """``(path, size)`` of every object of a committed checkpoint that Megatron-Core
    0.19's ``integrity.json`` lists (all but itself), largest first: what
    :func:`sha256_digests` reads, a share per rank. Coordinator only."""
    listing = storage.list_sizes()
    items = [(path, size) for path, size in listing.items() if path != INTEGRITY_FNAME]
    return sorted(items, key=lambda item: (-item[1], item[0]))


def sha256_digests(storage: CheckpointStorage, items: Sequence[tuple[str, int]]) -> dict[str, str]:
    """Hex SHA-256 of each ``(path, size)`` object, read back ``max_in_flight`` at once."""
    digests = storage.map(lambda item: storage.sha256(*item), list(items))
    return {path: digest for (path, _), digest in zip(items, digests, strict=True)}


def write_integrity_record(storage: CheckpointStorage, digests: Mapping[str, str]) -> WriteResult:
    """Megatron-Core 0.19's ``integrity.json``, ``{"algorithm": "sha256", "files": ...}``,
    written create-only: what ``save(..., verify_integrity=True)`` adds after the commit,
    as Megatron-Core does after ``metadata.json``, so that its ``load(...,
    verify_integrity=True)`` can check cloudckpt's checkpoints too. Coordinator only.

    Raises:
        ObjectExistsError: the checkpoint has an integrity record already.
    """
    payload = {"algorithm": "sha256", "files": dict(sorted(digests.items()))}
    written = storage.write(INTEGRITY_FNAME, json.dumps(payload, indent=2).encode(), exclusive=True)
    logger.info("wrote %s: SHA-256 of %d objects at %s", INTEGRITY_FNAME, len(digests), storage.uri)
    return written
