"""The manifest: cloudckpt's record of a committed checkpoint.

``manifest.json`` lists every object of the checkpoint with its size and CRC-32C,
as the writing ranks measured them while the bytes streamed out, plus what a reader
or an operator wants to know without opening the data: each tensor's global shape,
dtype and zarr chunk shape, the common-state keys, the writer's world size and the
time of the commit. It is written once (create-only) by the coordinator after every
rank's data is stored, and before ``metadata.json``; it is never built by reading the
bucket back.

Next to it, ``.cloudckpt-claim.json`` is the first object a cloudckpt save writes
(also create-only): it keeps a second job from writing into the same URI, and it
tells a checkpoint written by cloudckpt (which must have a manifest to be committed)
from one written by Megatron-Core or PyTorch (which never has one).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cloudckpt.errors import MalformedCheckpointError
from cloudckpt.storage.blocks import BlockCrcs
from cloudckpt.storage.types import WriteResult

MANIFEST_FNAME = "manifest.json"
CLAIM_FNAME = ".cloudckpt-claim.json"
MANIFEST_FORMAT = "cloudckpt-manifest"
MANIFEST_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 2 adds block CRCs to objects larger than one block (``[path, size, crc,
block_size, base64 of the packed block CRCs]``); version 1 lists ``[path, size, crc]``
only, and still loads (its ranged reads are checked against sizes only)."""


class ManifestError(MalformedCheckpointError):
    """``manifest.json`` is not a valid cloudckpt manifest."""


ManifestEntry = WriteResult
"""One stored object: path relative to the checkpoint root, size, CRC-32C and block
CRCs. The same type as a write's result: what a rank measured while writing is what
the manifest records."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One stored tensor (a zarr array, or a DCP tensor): its global layout."""

    key: str
    global_shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...] | None = None

    def __reduce__(
        self,
    ) -> tuple[type[TensorEntry], tuple[str, tuple[int, ...], str, tuple[int, ...] | None]]:
        # by its fields: unpickles faster than a slotted dataclass's default (see WriteResult)
        return TensorEntry, (self.key, self.global_shape, self.dtype, self.chunks)


@dataclass(frozen=True)
class Manifest:
    """Everything ``manifest.json`` holds.

    Attributes:
        objects: every object of the checkpoint except ``manifest.json`` and
            ``metadata.json`` themselves, sorted by path.
        tensors: stored tensors, sorted by key.
        common_keys: dotted paths of the common state's values, sorted.
        world_size: ranks of the job that wrote the checkpoint.
        created: commit time, ISO 8601 UTC.
        backends: ``metadata.json``'s four values (sharded/common backend and version).
    """

    objects: tuple[ManifestEntry, ...]
    tensors: tuple[TensorEntry, ...] = ()
    common_keys: tuple[str, ...] = ()
    world_size: int = 1
    created: str = ""
    backends: Mapping[str, Any] = field(default_factory=dict)
    version: int = MANIFEST_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", tuple(sorted(self.objects, key=lambda e: e.path)))
        object.__setattr__(self, "tensors", tuple(sorted(self.tensors, key=lambda t: t.key)))
        object.__setattr__(self, "common_keys", tuple(sorted(self.common_keys)))
        counts = Counter(e.path for e in self.objects)
        duplicates = sorted(p for p, n in counts.items() if n > 1)
        if duplicates:
            raise ManifestError(f"objects listed more than once: {duplicates[:10]}")

    @property
    def total_size(self) -> int:
        """Bytes of all listed objects."""
        return sum(e.size for e in self.objects)

    def by_path(self) -> dict[str, ManifestEntry]:
        """Entries keyed by object path."""
        return {e.path: e for e in self.objects}

    def to_json(self) -> bytes:
        """Canonical JSON: sorted keys, sorted entries, no whitespace variance."""
        doc = {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "created": self.created,
            "world_size": self.world_size,
            "backends": dict(self.backends),
            "common_keys": list(self.common_keys),
            "tensors": [_tensor_doc(t) for t in self.tensors],
            "objects": [_entry_doc(e, self.version) for e in self.objects],
        }
        return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()

    def digest(self) -> str:
        """SHA-256 of the canonical JSON, hex: one value naming this exact commit."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "manifest.json") -> Manifest:
        """Parse and check a manifest.

        Raises:
            ManifestError: not JSON, not a cloudckpt manifest, or malformed (naming ``where``).
        """
        try:
            doc = json.loads(raw)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ManifestError(f"{where} is not a cloudckpt manifest")
            version = doc.get("version")
            if version not in READABLE_VERSIONS:
                raise ManifestError(
                    f"{where} has manifest version {version!r}; this cloudckpt reads "
                    f"versions {', '.join(map(str, READABLE_VERSIONS))}"
                )
            return cls(
                objects=tuple(_entry_from_doc(e, version) for e in doc["objects"]),
                tensors=tuple(_tensor_from_doc(t) for t in doc["tensors"]),
                common_keys=tuple(str(k) for k in doc["common_keys"]),
                world_size=int(doc["world_size"]),
                created=str(doc["created"]),
                backends=dict(doc["backends"]),
                version=version,
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{where} is malformed: {exc!r}") from exc


def _entry_doc(entry: ManifestEntry, version: int) -> list[Any]:
    doc: list[Any] = [entry.path, entry.size, entry.crc32c]
    if entry.blocks is not None and version >= 2:
        doc += [entry.blocks.block_size, entry.blocks.to_base64()]
    return doc


def _entry_from_doc(doc: list[Any], version: int) -> ManifestEntry:
    """``[path, size, crc]``, or (version 2) with ``block_size`` and the block CRCs."""
    if len(doc) == 3 or (version >= 2 and len(doc) == 5):
        path, size, crc = str(doc[0]), int(doc[1]), int(doc[2])
    else:
        raise ValueError(f"object entry {doc!r} has {len(doc)} fields")
    if not 0 <= crc < 2**32 or size < 0:
        raise ValueError(f"object entry {doc!r} has a negative size or a CRC out of range")
    if len(doc) == 3:
        return ManifestEntry(path, size, crc)
    blocks = BlockCrcs.from_base64(int(doc[3]), str(doc[4]))
    if not blocks.covers(size):
        raise ValueError(
            f"object {path!r}: {len(blocks)} block CRCs of {blocks.block_size} bytes do not "
            f"cover its {size} bytes"
        )
    return ManifestEntry(path, size, crc, blocks)


def _tensor_doc(t: TensorEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"key": t.key, "shape": list(t.global_shape), "dtype": t.dtype}
    if t.chunks is not None:
        doc["chunks"] = list(t.chunks)
    return doc


def _tensor_from_doc(doc: Mapping[str, Any]) -> TensorEntry:
    chunks = doc.get("chunks")
    return TensorEntry(
        key=str(doc["key"]),
        global_shape=tuple(int(n) for n in doc["shape"]),
        dtype=str(doc["dtype"]),
        chunks=tuple(int(n) for n in chunks) if chunks is not None else None,
    )


def common_key_paths(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of nested dicts (lists and other values are leaves)."""
    paths: list[str] = []
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(common_key_paths(value, path + "."))
        else:
            paths.append(path)
    return paths


def merge_entries(per_rank: Iterable[Iterable[ManifestEntry]]) -> list[ManifestEntry]:
    """All ranks' write results as one list.

    Raises:
        ManifestError: two different results for one path (two ranks wrote one object).
    """
    merged: dict[str, ManifestEntry] = {}
    for rank, entries in enumerate(per_rank):
        for entry in entries:
            previous = merged.setdefault(entry.path, entry)
            if previous != entry:
                raise ManifestError(
                    f"object {entry.path!r} was written twice with different contents "
                    f"(rank {rank} among them): {previous} vs {entry}"
                )
    return list(merged.values())
