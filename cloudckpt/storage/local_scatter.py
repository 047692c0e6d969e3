"""Many ranges of local files read straight into their buffers, and checked in place.

A load of a torch_dist checkpoint reads, of each ``.distcp`` file, the elements of
many items into as many tensors. The items' ranges do not fall on the 1 MiB blocks
that the manifest's CRC-32Cs cover (an item's zip headers lie between two tensors'
elements), so reading each range alone cannot check its first and last block without
reading those blocks again. Here every run of blocks that the ranges of one object
touch is read as one request (one open, ``readinto`` buffer after buffer, through the
location's filesystem): the ranges' bytes straight into their buffers, the few bytes
between them (headers) into scratch buffers, in pieces cut where
the blocks end; each block's CRC-32C is computed across the pieces that hold it, in
order (CRC-32C continues from one piece into the next), as soon as they are filled
(still in the CPU's cache), and compared with the manifest's. One copy per byte, as
``torch.load`` makes, plus one CRC pass over cached bytes; no byte read twice.

Used for transports that read in place (local files), when the ranges of one object
do not overlap and checksums are not to be verified whole (then
:meth:`~cloudckpt.storage.reads.StorageReads.read_into_many` reads as before).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage.blocks import BlockCrcs
from cloudckpt.storage.buffers import crc32c
from cloudckpt.storage.checked import Expected
from cloudckpt.storage.retry import current_rank
from cloudckpt.storage.types import ReadRequest

Segment = tuple[int, memoryview]  # (offset in the object, buffer to fill)


@dataclass(frozen=True)
class Run:
    """One read: ``segments`` fill bytes ``[start, end)`` of ``path`` contiguously;
    ``blocks``: the CRCs to check them against (None: unchecked)."""

    path: str
    start: int
    end: int
    segments: tuple[Segment, ...]
    blocks: BlockCrcs | None


def plan_runs(
    expected: Expected, items: Sequence[tuple[ReadRequest, memoryview]], max_run: int
) -> list[Run] | None:
    """The reads that fill every buffer (empty ones excepted), or None when two
    ranges of one object overlap. Runs of a checked object cover whole blocks and
    are at most ``max_run`` bytes (whole blocks) long.

    Raises:
        CorruptObjectError: a range goes past the object's recorded size.
    """
    by_path: dict[str, list[tuple[int, memoryview]]] = {}
    for request, view in items:
        expected.check_range(request.path, request.start, request.start + view.nbytes)
        if view.nbytes:
            by_path.setdefault(request.path, []).append((request.start, view))
    runs: list[Run] = []
    for path, ranges in by_path.items():
        ranges.sort(key=lambda r: r[0])
        if any(a[0] + a[1].nbytes > b[0] for a, b in itertools.pairwise(ranges)):
            return None
        blocks, size = expected.blocks_of(path), expected.size(path)
        if blocks is None or size is None:
            runs += [Run(path, s, s + v.nbytes, ((s, v),), None) for s, v in ranges]
            continue
        runs += _checked_runs(path, ranges, blocks, size, max_run)
    return runs


def _checked_runs(
    path: str, ranges: list[tuple[int, memoryview]], blocks: BlockCrcs, size: int, max_run: int
) -> list[Run]:
    """Runs of whole blocks covering ``ranges`` (sorted, disjoint), gaps filled with
    scratch buffers, cut into pieces of at most ``max_run`` bytes."""
    bs = blocks.block_size
    step = max(bs, max_run - max_run % bs)
    spans: list[tuple[int, int, list[tuple[int, memoryview]]]] = []
    for start, view in ranges:
        first, last = start - start % bs, min(size, -(-(start + view.nbytes) // bs) * bs)
        if spans and first <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(last, spans[-1][1]), spans[-1][2] + [(start, view)])
        else:
            spans.append((first, last, [(start, view)]))
    runs = []
    for first, last, members in spans:
        for start, end, piece in _cut(_filled(first, last, members), first, last, step):
            runs.append(Run(path, start, end, piece, blocks))
    return runs


def _filled(first: int, last: int, members: list[tuple[int, memoryview]]) -> list[Segment]:
    """``members`` with scratch buffers for the bytes of ``[first, last)`` between them."""
    segments: list[Segment] = []
    cursor = first
    for start, view in members:
        if start > cursor:
            segments.append((cursor, memoryview(bytearray(start - cursor))))
        segments.append((start, view))
        cursor = start + view.nbytes
    if cursor < last:
        segments.append((cursor, memoryview(bytearray(last - cursor))))
    return segments


def _cut(
    segments: list[Segment], first: int, last: int, step: int
) -> list[tuple[int, int, tuple[Segment, ...]]]:
    """Contiguous ``segments`` covering ``[first, last)`` cut into runs of ``step``
    bytes (the last shorter), a segment crossing a cut split in two; one pass."""
    runs: list[tuple[int, int, tuple[Segment, ...]]] = []
    current: list[Segment] = []
    start = first
    for offset, segment in segments:
        at, view = offset, segment
        while view.nbytes:
            end = min(start + step, last)
            take = min(end - at, view.nbytes)
            current.append((at, view[:take] if take < view.nbytes else view))
            at += take
            view = view[take:]
            if at == end:
                runs.append((start, end, tuple(current)))
                current, start = [], end
    if current:
        runs.append((start, min(start + step, last), tuple(current)))
    return runs


def block_pieces(run: Run) -> list[memoryview]:
    """The run's buffers cut where its CRC blocks end: read one after the other, each
    piece is checked right after it is filled, while its bytes are still in the CPU's
    cache (a second pass over the run from memory costs about half again as much)."""
    if run.blocks is None:
        return [view for _, view in run.segments]
    bs = run.blocks.block_size
    pieces: list[memoryview] = []
    for offset, segment in run.segments:
        at, view = offset, segment
        while view.nbytes:
            take = min(bs - at % bs, view.nbytes)
            pieces.append(view[:take] if take < view.nbytes else view)
            at += take
            view = view[take:]
    return pieces


class RunCheck:
    """The CRC-32C of every block of a run, computed piece by piece as the pieces of
    :func:`block_pieces` are filled, in order, and compared with the manifest's.

    :meth:`add` never raises (it may run inside a read, whose errors are translated);
    :meth:`finish` raises for the first block that differed.
    """

    def __init__(self, run: Run, expected: Expected) -> None:
        self.run = run
        self.expected = expected
        self._crc = 0
        self._position = run.start
        self._failure: CorruptObjectError | None = None

    def add(self, piece: memoryview) -> None:
        """Fold one filled piece (within one block) into its block's CRC-32C."""
        blocks = self.run.blocks
        if blocks is None or self._failure is not None:
            return
        bs = blocks.block_size
        block_end = min(self._position - self._position % bs + bs, self.run.end)
        self._crc = crc32c(piece, self._crc)
        self._position += piece.nbytes
        if self._position == block_end:
            index = (self._position - 1) // bs
            if self._crc != blocks.crc(index):
                self._failure = _corrupt(self.expected, self.run.path, blocks, index, self._crc)
            self._crc = 0

    def finish(self) -> None:
        """Raise :class:`CorruptObjectError` naming the first block that differed."""
        if self._failure is not None:
            raise self._failure


def check_run(run: Run, expected: Expected) -> None:
    """Compare the CRC-32C of every block of a filled run with the manifest's.

    Raises:
        CorruptObjectError: naming the first block that differs.
    """
    check = RunCheck(run, expected)
    for piece in block_pieces(run):
        check.add(piece)
    check.finish()


def _corrupt(
    expected: Expected, path: str, blocks: BlockCrcs, index: int, crc: int
) -> CorruptObjectError:
    recorded = blocks.crc(index)
    first = index * blocks.block_size
    return CorruptObjectError(
        f"{expected.child_uri(path)}: block {index} of {len(blocks)} (bytes from "
        f"{first}, {blocks.block_size}-byte blocks) read on rank {current_rank()} has "
        f"CRC-32C {crc:#010x}; the manifest recorded {recorded:#010x}; the object is "
        "corrupt or was damaged in transit"
    )


__all__ = ["Run", "RunCheck", "block_pieces", "check_run", "plan_runs"]
