"""Sharding integrity checks and strict-load handling (pure functions, no I/O).

:func:`validate_sharding_integrity` takes the sharding metadata of every rank (the
``without_data()`` copies gathered from all ranks) and checks, per key:

* every shard of a ShardedTensor agrees on dtype, global shape and on being flattened
  or not;
* shards of one local shape (the common case) sit on the regular grid of chunks it
  defines, and the main replicas cover every chunk exactly once (flattened ranges must
  tile each chunk without gaps or overlaps);
* shards of different local shapes (*uneven* sharding, valid in Megatron-Core with
  torch_dist) must not declare a grid (``axis_fragmentations=None``) nor be flattened,
  and their main replicas must cover the tensor without gaps or overlaps; a backend
  that needs a regular grid (zarr: one chunk shape per array) refuses them;
* for ShardedObjects, main replicas have unique offsets, one per grid cell;
* no key is used both for tensors and for objects.

All violations are reported together in one :class:`ShardingValidationError`.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import numpy as np

from cloudckpt import dist
from cloudckpt.array_utils import sorted_unique
from cloudckpt.dict_utils import nested_values
from cloudckpt.errors import MissingKeysError, ShardingValidationError, UnexpectedKeysError
from cloudckpt.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

logger = logging.getLogger(__name__)

_MAX_LISTED = 5  # chunk indices listed per violation before "..."

RankShard = tuple[int, ShardedBase]


class StrictHandling(Enum):
    """What a load does when the requested keys and the checkpoint's keys differ.

    As in Megatron-Core, *missing* keys are stored in the checkpoint but requested by
    no rank, and *unexpected* keys are requested (by this rank) but absent from the
    checkpoint. Missing keys need every rank's requested keys (one all-gather), so only
    the ``*_ALL`` modes compute them; ``*_UNEXPECTED`` modes report missing keys as
    empty. Every mode except ``ASSUME_OK_UNEXPECTED`` reads the checkpoint's key list
    first and drops the unexpected keys from the request, so the rest loads (unless the
    mode raises); ``ASSUME_OK_UNEXPECTED`` leaves them to the sharded strategy, which
    raises (for torch_dist, a PyTorch ``CheckpointException``). ``RETURN_*`` make
    ``load`` return ``(state_dict, missing_keys, unexpected_keys)``.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether the checkpoint's keys are read to find unexpected keys."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether every rank's requested keys are gathered (to find missing keys)."""
        return val in ALL_MODES

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns ``(state_dict, missing, unexpected)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


ALL_MODES = frozenset(
    {
        StrictHandling.LOG_ALL,
        StrictHandling.RAISE_ALL,
        StrictHandling.RETURN_ALL,
        StrictHandling.IGNORE_ALL,
    }
)
"""The modes that compute missing keys (and so gather every rank's requested keys)."""


def parse_strict_flag(strict: str | StrictHandling) -> StrictHandling:
    """Accept a StrictHandling or its value as a string (``"raise_all"``, case-insensitive)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(str(strict).lower())
    except ValueError:
        valid = ", ".join(m.value for m in StrictHandling)
        raise ValueError(f"unknown strict handling {strict!r}; expected one of: {valid}") from None


def mismatch_message(missing: set[str], unexpected: set[str], where: str) -> str:
    """Megatron-Core's wording for a key mismatch, with ``where`` (checkpoint, rank)
    appended; keys are listed sorted."""
    titles, bodies = [], []
    if missing:
        titles.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict."
        )
        bodies.append(f"Missing keys (for all ranks): {sorted(missing)}.")
    if unexpected:
        titles.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided "
            "sharded state dict."
        )
        bodies.append(f"Unexpected keys (for this rank): {sorted(unexpected)}.")
    return " ".join(titles) + "\n" + " ".join(bodies) + f" ({where})"


def report_mismatch(
    where: str, strict: StrictHandling, missing: set[str], unexpected: set[str]
) -> None:
    """Raise (``RAISE_*``) or log at WARNING (``LOG_*``) the missing and unexpected keys;
    other modes do nothing. ``where`` names the checkpoint and rank.

    Raises:
        UnexpectedKeysError: ``RAISE_*`` and some requested keys are not in the
            checkpoint (the message lists the missing keys too, if any).
        MissingKeysError: ``RAISE_ALL``, no unexpected keys, and some stored keys are
            requested by no rank.
    """
    if not missing and not unexpected:
        return
    if strict in (StrictHandling.RAISE_ALL, StrictHandling.RAISE_UNEXPECTED):
        error = UnexpectedKeysError if unexpected else MissingKeysError
        raise error(mismatch_message(missing, unexpected, where))
    if strict in (StrictHandling.LOG_ALL, StrictHandling.LOG_UNEXPECTED):
        logger.warning("%s", mismatch_message(missing, unexpected, where))


def group_by_key(global_shards: Sequence[Iterable[ShardedBase]]) -> dict[str, list[RankShard]]:
    """``global_shards[rank]`` -> ``{key: [(rank, shard), ...]}``, keys sorted."""
    by_key: dict[str, list[RankShard]] = defaultdict(list)
    for rank, shards in enumerate(global_shards):
        for shard in shards:
            by_key[shard.key].append((rank, shard))
    return dict(sorted(by_key.items()))


def validate_sharding_integrity(
    global_shards: Sequence[Iterable[ShardedBase]],
    uri: str = "",
    regular_grid_for: str | None = None,
) -> None:
    """Check the sharding of a whole (all ranks) sharded state dict.

    Args:
        global_shards: per rank, the ShardedTensors and ShardedObjects (data not needed).
        uri: the checkpoint, for the message.
        regular_grid_for: the name of the backend about to save, when it needs every
            tensor on a regular grid (zarr): uneven shards are then a violation.

    Raises:
        ShardingValidationError: listing every violation found.
    """
    violations: list[str] = []
    for key, entries in group_by_key(global_shards).items():
        if len(entries) >= _FAST_MIN_SHARDS and even_tensor_is_valid(entries):
            continue  # proven valid at array speed; any doubt: the exact checks below
        kinds = {type(sh).__name__ for _, sh in entries}
        if len(kinds) > 1:
            violations.append(f"key {key!r} is used by {' and '.join(sorted(kinds))} at once")
        elif isinstance(entries[0][1], ShardedTensor):
            violations.extend(_tensor_violations(key, entries, regular_grid_for))
        elif isinstance(entries[0][1], ShardedObject):
            violations.extend(_object_violations(key, entries))
    if violations:
        where = f" for checkpoint {uri!r}" if uri else ""
        message = f"invalid sharding{where} ({len(violations)} problem(s)):\n  - " + "\n  - ".join(
            violations
        )
        raise ShardingValidationError(message, tuple(violations))


#: Keys with fewer shards than this are checked by the exact code only (the fast path's
#: array setup costs more than it saves there).
_FAST_MIN_SHARDS = 16
_FIELDS = operator.attrgetter(
    "dtype",
    "global_shape",
    "local_shape",
    "prepend_axis_num",
    "global_offset",
    "replica_id",
    "flattened_range",
)


def _uniform(column: Sequence[object]) -> bool:
    return column.count(column[0]) == len(column)


def even_tensor_is_valid(entries: Sequence[RankShard]) -> bool:
    """A fast, vectorized proof that the exact checks find no violation for one key:
    ShardedTensors of one type, dtype, global shape, local shape and flattening, on
    the chunk grid, whose main replicas cover each chunk exactly once (flattened ones:
    ranges tiling each chunk). False where it cannot prove that (any violation, uneven
    or empty shards): the caller then runs the exact checks, which word the errors.
    Each shard is read once (one C-level pass), the rest is array work."""
    shards = [sh for _, sh in entries]
    if len(set(map(type, shards))) != 1 or not isinstance(shards[0], ShardedTensor):
        return False
    dtypes, global_shapes, local_shapes, prepends, offsets, replicas, ranges = zip(
        *map(_FIELDS, shards), strict=True
    )
    if not all(map(_uniform, (dtypes, global_shapes, local_shapes, prepends))):
        return False
    shape = chunk_shape(shards[0])
    global_shape = tuple(global_shapes[0])
    if len(shape) != len(global_shape) or not all(shape):
        return False
    unflattened = ranges.count(None)
    if unflattened not in (0, len(ranges)):
        return False
    grid = tuple(math.ceil(g / c) for g, c in zip(global_shape, shape, strict=True))
    at = np.array(offsets, dtype=np.int64)
    if at.shape != (len(shards), len(shape)):
        return False
    index, rest = np.divmod(at, np.array(shape, dtype=np.int64))
    if rest.any() or (index < 0).any() or (index >= np.array(grid, dtype=np.int64)).any():
        return False
    is_main = {r: is_main_replica(r) for r in set(replicas)}  # few distinct ids
    main = np.fromiter(map(is_main.__getitem__, replicas), bool, len(shards))
    cells = (
        np.ravel_multi_index(tuple(index[main].T), grid)
        if len(shape)
        else np.zeros(int(main.sum()), dtype=np.int64)
    )
    count = math.prod(grid)
    if unflattened:
        return bool(len(cells) == count and sorted_unique(cells).size == count)
    mains = list(itertools.compress(ranges, main.tolist()))
    starts = np.fromiter((r.start for r in mains), np.int64, len(mains))
    stops = np.fromiter((r.stop for r in mains), np.int64, len(mains))
    return _ranges_tile(cells, starts, stops, count, math.prod(shape))


def _ranges_tile(
    cells: np.ndarray, starts: np.ndarray, stops: np.ndarray, count: int, numel: int
) -> bool:
    """True when, in every one of ``count`` cells, the non-empty ranges
    ``[start, stop)`` given for it tile ``[0, numel)``."""
    if not len(cells) or (stops <= starts).any():
        return False
    order = np.lexsort((starts, cells))
    cells, starts, stops = cells[order], starts[order], stops[order]
    first = np.ones(len(cells), dtype=bool)
    first[1:] = cells[1:] != cells[:-1]
    last = np.ones(len(cells), dtype=bool)
    last[:-1] = first[1:]
    return bool(
        int(first.sum()) == count
        and (starts[first] == 0).all()
        and (stops[last] == numel).all()
        and (starts[1:][~first[1:]] == stops[:-1][~first[1:]]).all()
    )


def chunk_shape(sh: ShardedTensor) -> tuple[int, ...]:
    """The shape of the global-array chunk one shard covers (prepended axes have size 1)."""
    return (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def chunk_index(sh: ShardedTensor) -> tuple[int, ...] | None:
    """The shard's index in the chunk grid, or None if it is not aligned to the grid."""
    return _grid_indexer(chunk_shape(sh))(tuple(sh.global_offset))


def _grid_indexer(shape: tuple[int, ...]) -> Callable[[tuple[int, ...]], tuple[int, ...] | None]:
    """``offset -> chunk index`` in the grid of chunks of ``shape`` (None when the offset
    is not on the grid), as :func:`chunk_index` computes it for every shard of one local
    shape, without the per-shard setup."""
    if all(shape):

        def index(offset: tuple[int, ...]) -> tuple[int, ...] | None:
            if any(map(operator.mod, offset, shape)):
                return None
            return tuple(map(operator.floordiv, offset, shape))

        return index
    return lambda offset: _chunk_index(offset, shape)


def _chunk_index(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if any(off % size for off, size in zip(offset, shape, strict=True) if size):
        return None
    return tuple(off // size if size else 0 for off, size in zip(offset, shape, strict=True))


def _describe(ranks: Iterable[int]) -> str:
    return "ranks " + ", ".join(map(str, sorted(set(ranks))))


def _metadata_violations(key: str, entries: list[RankShard]) -> list[str]:
    shards: list[ShardedTensor] = [sh for _, sh in entries]  # type: ignore[misc]
    if (
        len({sh.dtype for sh in shards}) == 1
        and len({tuple(sh.global_shape) for sh in shards}) == 1
        and len({sh.flattened_range is None for sh in shards}) == 1
    ):
        return []  # the common case, checked in one pass per attribute
    out = []
    for attr in ("dtype", "global_shape"):
        values: dict[object, list[int]] = defaultdict(list)
        for rank, sh in entries:
            value = getattr(sh, attr)
            values[tuple(value) if attr != "dtype" else value].append(rank)
        if len(values) > 1:
            detail = "; ".join(f"{v} on {_describe(r)}" for v, r in values.items())
            out.append(f"tensor {key!r}: {attr} differs across shards: {detail}")
    flat = {sh.flattened_range is not None for _, sh in entries}  # type: ignore[attr-defined]
    if len(flat) > 1:
        out.append(f"tensor {key!r}: some shards have a flattened_range and some do not")
    return out


def _tensor_violations(
    key: str, entries: list[RankShard], regular_grid_for: str | None = None
) -> list[str]:
    out = _metadata_violations(key, entries)
    if out:
        return out
    if len({tuple(sh.local_shape) for _, sh in entries}) > 1:  # type: ignore[attr-defined]
        return _uneven_violations(key, entries, regular_grid_for)
    first = entries[0][1]
    assert isinstance(first, ShardedTensor)
    shape = chunk_shape(first)
    grid = tuple(
        math.ceil(g / c) if c else 1 for g, c in zip(first.global_shape, shape, strict=True)
    )
    index_of = _grid_indexer(shape)
    cells: dict[tuple[int, ...], list[RankShard]] = defaultdict(list)
    for rank, sh in entries:
        assert isinstance(sh, ShardedTensor)
        index = index_of(sh.global_offset)
        if index is None or not all(map(operator.lt, index, grid)):
            out.append(
                f"tensor {key!r}: shard on rank {rank} at offset {tuple(sh.global_offset)} is not "
                f"aligned to the chunk grid of local shape {shape} in global shape "
                f"{tuple(sh.global_shape)}"
            )
        elif is_main_replica(sh.replica_id):
            cells[index].append((rank, sh))
    if out:
        return out
    if first.flattened_range is None:
        return _coverage_violations(key, grid, {i: [r for r, _ in c] for i, c in cells.items()})
    return _flat_coverage_violations(key, grid, math.prod(shape), cells)


def _uneven_violations(
    key: str, entries: list[RankShard], regular_grid_for: str | None
) -> list[str]:
    """Shards of different local shapes: allowed without a declared grid, unflattened,
    for a backend that stores arbitrary boxes, if the main replicas tile the tensor."""
    shapes: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for rank, sh in entries:
        shapes[tuple(sh.local_shape)].append(rank)  # type: ignore[attr-defined]
    detail = "; ".join(f"{v} on {_describe(r)}" for v, r in shapes.items())
    head = f"tensor {key!r}: local_shape differs across shards: {detail}"
    declared = [r for r, sh in entries if sh.axis_fragmentations is not None]  # type: ignore[attr-defined]
    if declared:
        return [
            f"{head}, but {_describe(declared)} declare a regular grid (axis_fragmentations); "
            "uneven shards need axis_fragmentations=None"
        ]
    if entries[0][1].flattened_range is not None:  # type: ignore[attr-defined]
        return [f"{head}; flattened shards (flattened_range) need a regular grid"]
    if regular_grid_for is not None:
        return [
            f"{head}: uneven sharding, which the {regular_grid_for} backend cannot store (it "
            "needs a regular grid of equal shards, one chunk shape per array); save with the "
            "torch_dist backend (sharded_strategy=('torch_dist', 1)), which stores uneven shards"
        ]
    return _box_coverage_violations(key, entries)


def _box_coverage_violations(key: str, entries: list[RankShard]) -> list[str]:
    """Main-replica boxes of one tensor overlap nowhere and cover every element."""
    global_shape = tuple(entries[0][1].global_shape)  # type: ignore[attr-defined]
    boxes = sorted(
        (tuple(sh.global_offset), chunk_shape(sh), rank)  # type: ignore[attr-defined, arg-type]
        for rank, sh in entries
        if is_main_replica(sh.replica_id) and math.prod(chunk_shape(sh)) > 0  # type: ignore[arg-type]
    )
    overlaps = []
    for i, (offset, shape, rank) in enumerate(boxes):
        for other, other_shape, other_rank in boxes[i + 1 :]:
            if other[0] >= offset[0] + shape[0]:
                break  # sorted by offset: no later box reaches back into this one
            if all(
                o < p + q and p < o + s
                for o, s, p, q in zip(offset, shape, other, other_shape, strict=True)
            ):
                overlaps.append(
                    f"shard on rank {rank} at offset {offset} (shape {shape}) and shard on "
                    f"rank {other_rank} at offset {other} (shape {other_shape})"
                )
    if overlaps:
        return [
            f"tensor {key!r}: {len(overlaps)} pair(s) of main replicas overlap: "
            f"{_listing(overlaps)}; set replica_id so that exactly one is main"
        ]
    total = math.prod(global_shape)
    covered = sum(
        math.prod(max(0, min(o + s, g) - o) for o, s, g in zip(off, shp, global_shape, strict=True))
        for off, shp, _ in boxes
    )
    if covered < total:
        return [
            f"tensor {key!r}: {total - covered} of {total} element(s) have no main replica "
            f"(uneven shards on {_describe(r for _, _, r in boxes)})"
        ]
    return []


def _uncovered_chunks(key: str, grid: tuple[int, ...], cells: Mapping[Any, object]) -> list[str]:
    missing = [i for i in _grid_indices(grid) if i not in cells]
    if not missing:
        return []
    return [f"tensor {key!r}: {len(missing)} chunk(s) have no main replica: {_listing(missing)}"]


def _coverage_violations(
    key: str, grid: tuple[int, ...], cells: dict[tuple[int, ...], list[int]]
) -> list[str]:
    out = _uncovered_chunks(key, grid, cells)
    for index, ranks in sorted(cells.items()):
        if len(ranks) > 1:
            out.append(
                f"tensor {key!r}: chunk {index} is saved by {len(ranks)} main replicas "
                f"({_describe(ranks)}); set replica_id so that exactly one is main"
            )
    return out


def _flat_coverage_violations(
    key: str, grid: tuple[int, ...], numel: int, cells: dict[tuple[int, ...], list[RankShard]]
) -> list[str]:
    out = _uncovered_chunks(key, grid, cells)
    # with Megatron-Core's words for it
    gap = " (Flattened ranges dont cover the whole shard ShardedTensor(key={!r}) of size {})"
    for index, pieces in sorted(cells.items()):
        spans = sorted(
            (sh.flattened_range.start, sh.flattened_range.stop, r)  # type: ignore[attr-defined]
            for r, sh in pieces
        )
        position = 0
        for start, stop, rank in spans:
            if start > position:
                out.append(
                    f"tensor {key!r}: chunk {index} elements [{position}, {start}) are not saved"
                    + gap.format(key, numel)
                )
            elif start < position:
                out.append(
                    f"tensor {key!r}: chunk {index} flattened range [{start}, {stop}) "
                    f"on rank {rank} "
                    f"overlaps another main replica"
                )
            position = max(position, stop)
        if position < numel:
            out.append(
                f"tensor {key!r}: chunk {index} elements [{position}, {numel}) are not saved"
                + gap.format(key, numel)
            )
    return out


def _object_violations(key: str, entries: list[RankShard]) -> list[str]:
    shapes = {tuple(sh.global_shape) for _, sh in entries}  # type: ignore[attr-defined]
    if len(shapes) > 1:
        return [f"object {key!r}: global_shape differs across shards: {sorted(shapes)}"]
    expected = math.prod(next(iter(shapes)))
    owners: dict[str, list[int]] = defaultdict(list)
    for rank, sh in entries:
        if is_main_replica(sh.replica_id):
            owners[sh.unique_key].append(rank)  # type: ignore[attr-defined]
    out = [
        f"object {key!r}: {unique} is saved by {len(ranks)} main replicas ({_describe(ranks)})"
        for unique, ranks in sorted(owners.items())
        if len(ranks) > 1
    ]
    if len(owners) != expected:
        out.append(
            f"object {key!r}: {len(owners)} distinct main-replica shards for global shape "
            f"{next(iter(shapes))}, expected {expected}"
        )
    return out


def _grid_indices(grid: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    return itertools.product(*(range(n) for n in grid))


def _listing(items: Sequence[object]) -> str:
    shown = ", ".join(map(str, items[:_MAX_LISTED]))
    return shown + (f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


#: One rank's sharding metadata: its ShardedBase objects without data.
_LocalMetadata = list[ShardedBase]
#: Every rank's :data:`_LocalMetadata`, indexed by rank.
_GlobalMetadata = list[_LocalMetadata]


def determine_global_metadata(
    sharded_state_dict: Mapping[str, Any],
    process_group: Any = None,
) -> tuple[_LocalMetadata, _GlobalMetadata]:
    """This rank's and every rank's sharding metadata (a collective: ``all_gather_object``).

    Args:
        sharded_state_dict: this rank's sharded state dict; its ShardedBase leaves
            (tensors, objects, factories) are taken, without data. Megatron-Core expects
            only sharded leaves here; other leaves are skipped.
        process_group: gather over this group (Megatron-Core 0.19's parameter; default:
            the default group); every rank of it must call.

    Returns:
        ``(local, global)``: this rank's list, and the list of every rank's lists (in
        group rank order). Without a process group, ``global`` is ``[local]``.
    """
    local = [
        v.without_data()
        for v in nested_values(dict(sharded_state_dict))
        if isinstance(v, ShardedBase)
    ]
    return local, dist.all_gather_object(local, process_group)
