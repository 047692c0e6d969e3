"""Which keys a save can store: the whole key set of every rank, checked before the
claim and before any write, the same way on every store (pure functions, no I/O).

Two kinds of problem are found, each listing every key at fault and the ranks that
hold it:

* :class:`~cloudckpt.errors.InvalidKeyError`: a key that is no usable object path
  (:func:`cloudckpt.storage.location.relpath_problem`: empty, leading ``/``, empty,
  ``.`` or ``..`` segments, ``?``, ``#``, ``*``, ``[``, ``]``, backslash, control
  characters), or whose object paths are longer than the store holds
  (:class:`~cloudckpt.storage.limits.PathLimits` of the layout: S3 1,024 bytes per
  key, the checkpoint's prefix included; a local disk 255 bytes per segment and 4,096
  per path). The paths checked are those the layout derives from the key: zarr
  ``<key>/.zarray`` and ``<key>/<chunk>`` (the longest chunk name the tensor's global
  shape allows: every index at most the axis length - 1), a ShardedObject file
  ``<unique_key>.pt``; torch_dist keys are DCP item names inside ``__<r>_<i>.distcp``
  objects, whose names no key changes, so no length applies to them.
* :class:`~cloudckpt.errors.KeyCollisionError`: keys that the backend's layout
  (:class:`KeyLayout`) would store at one path, one inside another's object, at one of
  cloudckpt's own files, or (torch_dist) under one DCP item name.

Layouts: zarr keeps a tensor under ``<key>/`` (``.zarray`` and chunks named by their
index, ``0.0``), so no other key may reach ``<key>/<chunk-like segment>`` (``a`` and
``a/0``); ShardedObjects written by the common strategy are files
``<key>/shard_<offsets>_<shape>.pt``, which no other key may pass through; nothing may
be stored at or below ``manifest.json``, ``metadata.json``, ``.cloudckpt-claim.json``,
``common.pt`` or ``.metadata``, and no segment may be a zarr metadata name
(``.zarray``, ``.zgroup``, ``.zattrs``, ``.zmetadata``). torch_dist stores every tensor
and object as a DCP item named by its key (objects: their ``unique_key``), inside
shared ``.distcp`` objects: there keys are no paths, and the collisions are a tensor key
equal to an object's ``unique_key``, and objects named ``common_state`` (Megatron-Core
0.19's common-state item).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloudckpt.errors import InvalidKeyError, KeyCollisionError
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor
from cloudckpt.storage.limits import NO_PATH_LIMITS, PathLimits
from cloudckpt.storage.location import relpath_problem

if TYPE_CHECKING:
    from cloudckpt.formats.protocol import FormatTraits

MAX_LISTED = 10  # problems listed in one message before "... and N more"
MAX_SHOWN_CHARS = 80  # a longer key or path is shown by its ends and its length

RESERVED_FILES = {
    "manifest.json": "cloudckpt's manifest.json",
    "metadata.json": "cloudckpt's metadata.json",
    ".cloudckpt-claim.json": "cloudckpt's claim .cloudckpt-claim.json",
    "common.pt": "the common state's common.pt",
    ".metadata": "PyTorch DCP's .metadata",
}
ZARR_METADATA_NAMES = frozenset({".zarray", ".zgroup", ".zattrs", ".zmetadata"})
DCP_COMMON_STATE_ITEM = "common_state"
_CHUNK_NAME = re.compile(r"\d+(\.\d+)*")


@dataclass(frozen=True)
class KeyLayout:
    """How a save maps keys to object paths.

    Attributes:
        tensor_dirs: a ShardedTensor ``key`` owns the directory ``<key>/`` (zarr);
            False: tensors are DCP items inside shared objects (torch_dist).
        object_files: a ShardedObject is the file ``<unique_key>.pt`` (the torch common
            strategy); False: objects are DCP items of the sharded backend.
        limits: the longest paths the store holds below the checkpoint's root.
    """

    tensor_dirs: bool
    object_files: bool
    limits: PathLimits = NO_PATH_LIMITS

    @classmethod
    def of(cls, traits: FormatTraits, limits: PathLimits = NO_PATH_LIMITS) -> KeyLayout:
        """The layout of a save in a format with ``traits``; ``limits``: those of the
        store (:func:`cloudckpt.storage.limits.path_limits`)."""
        return cls(traits.tensor_dirs, not traits.writes_objects, limits)

    @property
    def needs_shapes(self) -> bool:
        """Whether the key checks need the tensors' global shapes (their zarr chunk
        names count against the store's path limits)."""
        return self.tensor_dirs and self.limits.bounded

    @property
    def dcp_items(self) -> bool:
        """Tensors and objects share one namespace of DCP item names."""
        return not self.tensor_dirs and not self.object_files


@dataclass(frozen=True)
class _Owner:
    """A stored thing and the ranks that hold it, for messages."""

    what: str  # "tensor 'a'", "object 'o'" or a reserved file's description
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        if not self.ranks:
            return self.what
        word = "rank" if len(self.ranks) == 1 else "ranks"
        return f"{self.what} ({word} {', '.join(map(str, self.ranks))})"


KeySet = tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]
"""(tensor key -> ranks holding it, object unique key -> ranks holding it)."""


def gather_keys(per_rank: Mapping[int, Iterable[ShardedBase]]) -> KeySet:
    """The distinct tensor keys and object unique keys of the ranks' shards (rank ->
    shards), with the ranks holding each."""
    tensors: dict[str, set[int]] = defaultdict(set)
    objects: dict[str, set[int]] = defaultdict(set)
    for rank, shards in per_rank.items():
        for shard in shards:
            if isinstance(shard, ShardedTensor):  # the common case first (ABC checks cost)
                tensors[shard.key].add(rank)
            elif isinstance(shard, ShardedObject):
                objects[shard.unique_key].add(rank)
    return _sorted(tensors), _sorted(objects)


def tensor_shapes(per_rank: Mapping[int, Iterable[ShardedBase]]) -> dict[str, tuple[int, ...]]:
    """Each tensor key's global shape (the first shard's; the sharding checks compare
    the others), for :func:`validate_key_set`."""
    shapes: dict[str, tuple[int, ...]] = {}
    for shards in per_rank.values():
        for shard in shards:
            if isinstance(shard, ShardedTensor) and shard.key not in shapes:
                shapes[shard.key] = tuple(shard.global_shape)
    return shapes


def key_set(tensors: Mapping[str, Iterable[int]], objects: Mapping[str, Iterable[int]]) -> KeySet:
    """The key set of tensor keys and object unique keys -> the ranks holding each,
    ordered as :func:`gather_keys` orders it."""
    return _sorted(tensors), _sorted(objects)


def _sorted(found: Mapping[str, Iterable[int]]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(sorted(v)) for k, v in sorted(found.items(), key=lambda kv: str(kv[0]))}


def validate_key_set(
    keys: KeySet,
    layout: KeyLayout,
    uri: str,
    rank: int,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> None:
    """Check every key of a save (all ranks) before anything is written.

    Args:
        keys: from :func:`gather_keys` over every rank's shards.
        layout: how the save's backends store keys, and the store's path limits.
        uri: the checkpoint (redacted), for the message.
        rank: this rank, for the message.
        shapes: tensor key -> global shape (:func:`tensor_shapes`), where
            ``layout.needs_shapes``; a tensor missing from it counts as 0-d.

    Raises:
        InvalidKeyError: keys that are no usable object path, or whose paths are
            longer than the store holds (all listed).
        KeyCollisionError: keys that collide after mapping to paths (all listed).
    """
    where = f"rank {rank}: checkpoint {uri!r}"
    invalid = _invalid_keys(keys) + _overlong_paths(keys, layout, shapes or {})
    if invalid:
        raise InvalidKeyError(_message(f"{where}: invalid key(s)", invalid))
    collisions = _dcp_collisions(keys) if layout.dcp_items else _path_collisions(keys, layout)
    if collisions:
        raise KeyCollisionError(
            _message(f"{where}: keys collide once mapped to object paths", collisions)
        )


def _message(head: str, problems: list[str]) -> str:
    shown = problems[:MAX_LISTED]
    more = len(problems) - len(shown)
    tail = f"\n  ... and {more} more" if more else ""
    return f"{head} ({len(problems)}):\n  - " + "\n  - ".join(shown) + tail


def _invalid_keys(keys: KeySet) -> list[str]:
    tensors, objects = keys
    named = [(f"tensor {k!r}", k, r) for k, r in tensors.items()]
    by_key: dict[str, set[int]] = defaultdict(set)
    for unique_key, ranks in objects.items():
        by_key[unique_key.rpartition("/")[0]].update(ranks)
    named += [(f"object {k!r}", k, tuple(sorted(r))) for k, r in sorted(by_key.items())]
    out = []
    for what, key, ranks in named:
        problem = relpath_problem(key)
        if problem is not None:
            out.append(f"{_Owner(what, ranks)}: {problem}")
    return out


def longest_chunk_name(global_shape: Sequence[int]) -> str:
    """The longest name a zarr chunk of an array of ``global_shape`` can have: each index
    at most the axis length - 1 (a chunk is at least one element wide), ``.``-joined
    as cloudckpt names chunks; ``0`` for a 0-d array."""
    return ".".join(str(max(int(n) - 1, 0)) for n in global_shape) or "0"


def _shown(text: str) -> str:
    """``repr(text)``; for a long one, its ends and its length."""
    if len(text) <= MAX_SHOWN_CHARS:
        return repr(text)
    return f"{text[:40] + '...' + text[-20:]!r} ({len(text)} characters)"


def _overlong_paths(
    keys: KeySet, layout: KeyLayout, shapes: Mapping[str, Sequence[int]]
) -> list[str]:
    """Keys (usable paths otherwise) one of whose derived object paths the store cannot
    hold (:class:`PathLimits`): zarr tensors' ``.zarray`` and longest chunk, objects'
    ``.pt`` files; torch_dist items derive none."""
    if not layout.limits.bounded:
        return []
    tensors, objects = keys
    derived: list[tuple[str, tuple[int, ...], list[str]]] = []
    if layout.tensor_dirs:
        for key, ranks in tensors.items():
            chunk = longest_chunk_name(shapes.get(key, ()))
            derived.append((f"tensor {_shown(key)}", ranks, [f"{key}/.zarray", f"{key}/{chunk}"]))
    if layout.object_files:
        for unique_key, ranks in objects.items():
            derived.append((f"object shard {_shown(unique_key)}", ranks, [f"{unique_key}.pt"]))
    out = []
    for what, ranks, paths in derived:
        if relpath_problem(paths[0].rpartition("/")[0]) is not None:
            continue  # refused for that already
        for path in paths:
            problem = layout.limits.problem(path)
            if problem is not None:
                out.append(
                    f"{_Owner(what, ranks)}: its object {_shown(path)} is too long: {problem}"
                )
                break
    return out


def _dcp_collisions(keys: KeySet) -> list[str]:
    tensors, objects = keys
    out = [
        f"{_Owner(f'tensor {k!r}', tensors[k])} and {_Owner(f'object shard {k!r}', r)} "
        "would be one DCP item"
        for k, r in objects.items()
        if k in tensors
    ]
    out += [
        f"{_Owner(f'object shard {k!r}', r)}: {DCP_COMMON_STATE_ITEM!r} is the DCP item of "
        "Megatron-Core 0.19's common state"
        for k, r in objects.items()
        if k.rpartition("/")[0] == DCP_COMMON_STATE_ITEM
    ]
    return out


def _path_collisions(keys: KeySet, layout: KeyLayout) -> list[str]:
    """Collisions among the paths the keys map to (directories of zarr tensors, files
    of objects) and cloudckpt's own files."""
    tensors, objects = keys
    files: dict[str, _Owner] = {name: _Owner(what) for name, what in RESERVED_FILES.items()}
    dirs: dict[str, _Owner] = {}
    claims: list[tuple[str, _Owner]] = []
    if layout.tensor_dirs:
        for key, ranks in tensors.items():
            dirs[key] = _Owner(f"tensor {key!r}", ranks)
            claims.append((key, dirs[key]))
    if layout.object_files:
        for unique_key, ranks in objects.items():
            path = f"{unique_key}.pt"
            files[path] = _Owner(f"object shard {unique_key!r}", ranks)
            claims.append((path, files[path]))
    out: list[str] = []
    for path, owner in claims:
        if path in dirs and files.get(path, owner) is not owner and files[path].ranks:
            continue  # a key's file where another key's directory is: reported by the file
        problem = _claim_problem(path, owner, files, dirs)
        if problem is not None:
            out.append(problem)
    return out


def _claim_problem(
    path: str, owner: _Owner, files: dict[str, _Owner], dirs: dict[str, _Owner]
) -> str | None:
    """What ``owner``'s ``path`` collides with, or None."""
    segments = path.split("/")
    meta = [s for s in segments if s in ZARR_METADATA_NAMES]
    if meta:
        return f"{owner}: {meta[0]!r} is a zarr metadata name; no key segment may be one"
    if path in files and files[path] is not owner:
        return f"{owner} would be stored at {path!r}, the path of {files[path]}"
    if path in dirs and dirs[path] is not owner:
        return f"{owner} would be stored at {path!r}, the directory of {dirs[path]}"
    for i in range(1, len(segments)):
        above = "/".join(segments[:i])
        if above in files:
            return f"{owner} would be stored below {above!r}, the path of {files[above]}"
        inside = dirs.get(above)
        if inside is not None and inside is not owner and _CHUNK_NAME.fullmatch(segments[i]):
            return (
                f"{owner} would be stored at {'/'.join(segments[: i + 1])!r}, which is "
                f"{inside}'s chunk {segments[i]!r}: no key may continue a tensor key with a "
                "chunk-like segment (digits and dots)"
            )
    return None
