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

import dataclasses
import hashlib
import json
import zlib
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter
from typing import Any

from cloudckpt.errors import CheckpointingException, MalformedCheckpointError
from cloudckpt.storage.blocks import BlockCrcs
from cloudckpt.storage.types import WriteResult

MANIFEST_FNAME = "manifest.json"
CLAIM_FNAME = ".cloudckpt-claim.json"
INTEGRITY_FNAME = "integrity.json"
"""Megatron-Core 0.19's integrity record, ``{"algorithm": "sha256", "files": {path: hex
digest}}``: written after the commit by ``save(..., verify_integrity=True)`` (theirs and
cloudckpt's), outside the manifest like ``metadata.json``."""
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
        object.__setattr__(self, "objects", tuple(sorted(self.objects, key=_PATH)))
        object.__setattr__(self, "tensors", tuple(sorted(self.tensors, key=_KEY)))
        object.__setattr__(self, "common_keys", tuple(sorted(self.common_keys)))
        paths = list(map(_PATH, self.objects))
        if len(set(paths)) == len(paths):  # the usual case, without counting
            return
        duplicates = sorted(p for p, n in Counter(paths).items() if n > 1)
        raise ManifestError(f"objects listed more than once: {duplicates[:10]}")

    @property
    def total_size(self) -> int:
        """Bytes of all listed objects."""
        return sum(e.size for e in self.objects)

    def by_path(self) -> dict[str, ManifestEntry]:
        """Entries keyed by object path."""
        return {e.path: e for e in self.objects}

    def to_json(self) -> bytes:
        """Canonical JSON: sorted keys, sorted entries, no whitespace variance.

        The bytes of ``json.dumps(doc, sort_keys=True, separators=(",", ":"))`` plus a
        newline; the long lists (objects, tensors) are written entry by entry with the
        encoder's own string escaping, a few times faster than the encoder's walk."""
        members = {
            "format": _dumps(MANIFEST_FORMAT),
            "version": _dumps(self.version),
            "created": _dumps(self.created),
            "world_size": _dumps(self.world_size),
            "backends": _dumps(dict(self.backends)),
            "common_keys": _dumps(list(self.common_keys)),
            "tensors": "[" + ",".join(map(_tensor_json, self.tensors)) + "]",
            "objects": "[" + ",".join(_entries_json(self.objects, self.version)) + "]",
        }
        body = ",".join(f"{_escape(key)}:{members[key]}" for key in sorted(members))
        return ("{" + body + "}\n").encode()

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
                objects=tuple(_entry_from_doc(e, version) for e in _typed(doc, "objects", list)),
                tensors=tuple(_tensor_from_doc(t) for t in _typed(doc, "tensors", list)),
                common_keys=tuple(_strs(_typed(doc, "common_keys", list), "common_keys")),
                world_size=_typed(doc, "world_size", int),
                created=_typed(doc, "created", str),
                backends=dict(_typed(doc, "backends", dict)),
                version=version,
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{where} is malformed: {exc!r}") from exc


_PATH = attrgetter("path")
_KEY = attrgetter("key")
_escape = json.encoder.encode_basestring_ascii  # json.dumps's own (C) escaping, ensure_ascii


def _dumps(value: Any) -> str:
    """The canonical JSON of one value (as a member of the manifest's document)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _ints(values: Iterable[int]) -> str:
    """A JSON list of ints, as ``json.dumps`` writes it."""
    return "[" + ",".join(map(str, map(int, values))) + "]"


def _entries_json(entries: Sequence[ManifestEntry], version: int) -> list[str]:
    """Each entry's ``[path, size, crc]``, or (version 2, with block CRCs)
    ``[path, size, crc, block_size, base64 of the block CRCs]``."""
    if version < 2:
        return [f"[{_escape(e.path)},{e.size},{e.crc32c}]" for e in entries]
    return [
        f"[{_escape(e.path)},{e.size},{e.crc32c}]"
        if e.blocks is None
        else f"[{_escape(e.path)},{e.size},{e.crc32c},{e.blocks.block_size},"
        f"{_escape(e.blocks.to_base64())}]"
        for e in entries
    ]


def _typed(doc: Mapping[str, Any], field: str, kind: type) -> Any:
    """``doc[field]``, which must be a ``kind`` (an int is no bool)."""
    value = doc[field]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {field!r} is {value!r}, not a {kind.__name__}")
    return value


def _strs(values: list[Any], field: str) -> list[str]:
    if not all(type(v) is str for v in values):
        raise ValueError(f"field {field!r} holds something other than strings: {values!r}")
    return values


def _entry_from_doc(doc: list[Any], version: int) -> ManifestEntry:
    """``[path, size, crc]``, or (version 2) with ``block_size`` and the block CRCs."""
    if len(doc) == 3 or (version >= 2 and len(doc) == 5):
        path, size, crc = doc[0], doc[1], doc[2]
    else:
        raise ValueError(f"object entry {doc!r} has {len(doc)} fields")
    if type(path) is not str or type(size) is not int or type(crc) is not int:
        raise ValueError(f"object entry {doc!r}: the path must be a string, size and CRC ints")
    if not 0 <= crc < 2**32 or size < 0:
        raise ValueError(f"object entry {doc!r} has a negative size or a CRC out of range")
    if len(doc) == 3:
        return ManifestEntry(path, size, crc)
    if type(doc[3]) is not int or type(doc[4]) is not str:
        raise ValueError(f"object entry {doc!r}: block size and CRCs must be an int and a string")
    blocks = BlockCrcs.from_base64(doc[3], doc[4])
    if not blocks.covers(size):
        raise ValueError(
            f"object {path!r}: {len(blocks)} block CRCs of {blocks.block_size} bytes do not "
            f"cover its {size} bytes"
        )
    return ManifestEntry(path, size, crc, blocks)


def _tensor_json(t: TensorEntry) -> str:
    """``{"chunks": [...], "dtype": ..., "key": ..., "shape": [...]}`` (keys sorted;
    no ``chunks`` when None)."""
    tail = f'"dtype":{_escape(t.dtype)},"key":{_escape(t.key)},"shape":{_ints(t.global_shape)}}}'
    if t.chunks is None:
        return "{" + tail
    return f'{{"chunks":{_ints(t.chunks)},{tail}'


def _tensor_from_doc(doc: Mapping[str, Any]) -> TensorEntry:
    chunks = doc.get("chunks")
    shape = _typed(doc, "shape", list)
    if not all(type(n) is int for n in shape) or (
        chunks is not None
        and (not isinstance(chunks, list) or not all(type(n) is int for n in chunks))
    ):
        raise ValueError(f"tensor entry {doc!r}: shape and chunks must be lists of ints")
    return TensorEntry(
        key=_typed(doc, "key", str),
        global_shape=tuple(shape),
        dtype=_typed(doc, "dtype", str),
        chunks=tuple(chunks) if chunks is not None else None,
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


# -- the commit record: one rank's part of the manifest, as it travels ----------------------

_INTS = "q"  # array typecode of a commit record's sizes, CRCs and path lengths: 64-bit


def tensors_text(tensors: Iterable[TensorEntry]) -> str:
    """A rank's tensor entries as compact JSON, ``[[key, shape, dtype, chunks], ...]``:
    equal lists give equal text on every rank (the digest compares them)."""
    return json.dumps(
        [
            [t.key, list(t.global_shape), t.dtype, None if t.chunks is None else list(t.chunks)]
            for t in tensors
        ],
        separators=(",", ":"),
    )


def tensors_digest(text: str) -> bytes:
    """16 bytes naming a rank's :func:`tensors_text` (BLAKE2b: the same on every host)."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _tensors_from_text(text: str) -> list[TensorEntry]:
    return [
        TensorEntry(key, tuple(shape), dtype, None if chunks is None else tuple(chunks))
        for key, shape, dtype, chunks in json.loads(text)
    ]


@dataclass(frozen=True)
class CommitRecord:
    """What one rank sends the coordinator at the commit, in columns: its write results
    (paths, sizes and CRCs, compressed together; the block CRCs of the objects that have
    them, by position) and its tensor entries as :func:`tensors_text`. Ranks with equal
    tensor entries (data-parallel replicas, and tensor-parallel ranks of one stage) each
    send one piece of that text (:meth:`piece`): the coordinator joins the pieces of each
    digest in rank order. The gather pads every record to the longest, so no record
    carries all of the text, and paths (long, alike) travel compressed.

    Attributes:
        count: how many write results.
        columns: zlib of their sizes, CRC-32Cs and path lengths (``array("q")`` bytes,
            ``count`` each) followed by their paths, joined (UTF-8).
        blocks: ``(position, block_size, packed block CRCs)`` of the results with blocks.
        digest: :func:`tensors_digest` of this rank's tensor entries.
        tensors: this rank's piece of their :func:`tensors_text` (all of it from
            :meth:`of`).
        common_keys: the common state's key paths this rank reports.
    """

    count: int
    columns: bytes
    blocks: tuple[tuple[int, int, bytes], ...]
    digest: bytes
    tensors: str
    common_keys: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        results: Iterable[ManifestEntry],
        tensors: Iterable[TensorEntry] = (),
        common_keys: Iterable[str] = (),
    ) -> CommitRecord:
        """The record of a rank's write results, tensor entries and common keys, with
        all of its tensor text (see :meth:`piece`)."""
        results = list(results)
        paths = [r.path for r in results]
        ints = array(_INTS, [r.size for r in results])
        ints.extend([r.crc32c for r in results])
        ints.extend(map(len, paths))
        text = tensors_text(tensors)
        return cls(
            count=len(results),
            columns=zlib.compress(ints.tobytes() + _utf8("".join(paths)), 1),
            blocks=tuple(
                (i, r.blocks.block_size, r.blocks.packed)
                for i, r in enumerate(results)
                if r.blocks is not None
            ),
            digest=tensors_digest(text),
            tensors=text,
            common_keys=tuple(common_keys),
        )

    def piece(self, index: int, count: int) -> CommitRecord:
        """This record with piece ``index`` of ``count`` (about equal) of its tensor text:
        what the ``index``-th of ``count`` ranks with this digest sends."""
        text = self.tensors
        cut = text[len(text) * index // count : len(text) * (index + 1) // count]
        return dataclasses.replace(self, tensors=cut)

    def unpacked(self) -> tuple[list[str], list[int], list[int]]:
        """The paths, sizes and CRC-32Cs of the write results.

        Raises:
            CheckpointingException: the columns are not what :meth:`of` packs.
        """
        n = self.count
        try:
            raw = zlib.decompress(self.columns)
            ints = array(_INTS)
            ints.frombytes(raw[: 3 * n * ints.itemsize])
            text = raw[3 * n * ints.itemsize :].decode("utf-8", "surrogatepass")
        except (zlib.error, ValueError) as exc:
            raise CheckpointingException(f"a commit record's columns are malformed: {exc}") from exc
        ends = list(accumulate(ints[2 * n :]))
        if len(ints) != 3 * n or (ends[-1] if ends else 0) != len(text):
            raise CheckpointingException(
                f"a commit record's columns hold {len(ints)} ints and {len(text)} path "
                f"characters for {n} results"
            )
        paths = list(map(text.__getitem__, map(slice, [0, *ends[:-1]], ends)))
        return paths, ints[:n].tolist(), ints[n : 2 * n].tolist()

    def write_results(self) -> list[ManifestEntry]:
        """The write results this record holds, in order."""
        return _GatheredResults([self]).entries(range(self.count))

    def __reduce__(self) -> tuple[type[CommitRecord], tuple[Any, ...]]:
        # by its fields, as WriteResult: the coordinator unpickles one per rank
        return CommitRecord, (
            self.count,
            self.columns,
            self.blocks,
            self.digest,
            self.tensors,
            self.common_keys,
        )


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # any str, lone surrogates too


class _GatheredResults:
    """Every rank's write results, concatenated (positions across all records)."""

    def __init__(self, records: Sequence[CommitRecord]) -> None:
        self.paths: list[str] = []
        self.sizes: list[int] = []
        self.crcs: list[int] = []
        self.blocks: dict[int, BlockCrcs] = {}
        self.starts: list[int] = []  # the position of each rank's first result
        for record in records:
            base = len(self.paths)
            self.starts.append(base)
            paths, sizes, crcs = record.unpacked()
            self.paths += paths
            self.sizes += sizes
            self.crcs += crcs
            for i, block_size, packed in record.blocks:
                self.blocks[base + i] = BlockCrcs(block_size, packed)

    def entry(self, i: int) -> ManifestEntry:
        return ManifestEntry(self.paths[i], self.sizes[i], self.crcs[i], self.blocks.get(i))

    def entries(self, positions: Sequence[int]) -> list[ManifestEntry]:
        """The entries at ``positions``, in that order (built by ``map``: no Python loop)."""
        at: list[Callable[[int], Any]] = [
            self.paths.__getitem__,
            self.sizes.__getitem__,
            self.crcs.__getitem__,
        ]
        if self.blocks:
            at.append(self.blocks.get)
        return list(map(ManifestEntry, *(map(get, positions) for get in at)))

    def same(self, i: int, j: int) -> bool:
        return (self.sizes[i], self.crcs[i], self.blocks.get(i)) == (
            self.sizes[j],
            self.crcs[j],
            self.blocks.get(j),
        )

    def merged(self) -> list[ManifestEntry]:
        """One entry per path, sorted by path (as :func:`merge_entries`, same errors)."""
        paths = self.paths
        # path -> its first position (the last assignment of each key wins)
        first = dict(zip(reversed(paths), range(len(paths) - 1, -1, -1), strict=True))
        if len(first) < len(paths):
            self._check_duplicates(first)
        return self.entries(sorted(first.values(), key=paths.__getitem__))

    def _check_duplicates(self, first: dict[str, int]) -> None:
        for i, path in enumerate(self.paths):
            j = first[path]
            if j != i and not self.same(i, j):
                raise ManifestError(
                    f"object {path!r} was written twice with different contents "
                    f"(rank {bisect_right(self.starts, i) - 1} among them): "
                    f"{self.entry(j)} vs {self.entry(i)}"
                )


def merge_records(
    records: Sequence[CommitRecord],
) -> tuple[list[ManifestEntry], list[TensorEntry], list[str]]:
    """The coordinator's merge of every rank's record (indexed by rank; the tensor text
    in pieces, :meth:`CommitRecord.piece`): the objects
    (sorted by path), the tensors (by key: where ranks differ, the highest rank's entry)
    and the common keys (sorted), as :func:`merge_entries` and a dict by key would give.

    Raises:
        ManifestError: two ranks report different results for one object path.
        CheckpointingException: the pieces of a tensor text do not make up its digest.
    """
    objects = _GatheredResults(records).merged()
    pieces: dict[bytes, list[str]] = {}
    last: dict[bytes, int] = {}  # digest -> the highest rank with it
    for rank, record in enumerate(records):
        pieces.setdefault(record.digest, []).append(record.tensors)
        last[record.digest] = rank
    tensors: dict[str, TensorEntry] = {}
    for digest in sorted(last, key=last.__getitem__):  # the highest ranks' entries last
        text = "".join(pieces[digest])
        if tensors_digest(text) != digest:
            raise CheckpointingException(
                f"the tensor entries of digest {digest.hex()}, joined from the pieces of "
                f"{len(pieces[digest])} ranks (the last rank {last[digest]}), do not match "
                "their digest"
            )
        tensors.update((t.key, t) for t in _tensors_from_text(text))
    common = sorted({k for record in records for k in record.common_keys})
    return objects, list(tensors.values()), common
