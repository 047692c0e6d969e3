"""Scatter reads: many byte ranges of a checkpoint's objects read straight into the
caller's buffers, in runs of whole blocks, every block checked against its CRC-32C.

The ranges of one object do not fall on the 1 MiB blocks the manifest's CRC-32Cs cover
(an item's zip headers lie between two tensors' elements), so reading each range alone
could not check its first and last block without reading them again. Instead every run
of blocks the ranges touch is read as one request (:func:`plan_reads`: the blocks merged
where they touch, cut at ``limit`` bytes on block boundaries), into a list of *segments*:
the slices of the caller's buffers it covers, and small scratch buffers for the bytes no
buffer wants (the partly needed block at either end, the bytes between two items). Bytes
wanted by two buffers (overlapping ranges) are received once, into the first, and copied
to the other once checked (:attr:`ScatterRun.copies`). One copy per byte into the
buffers, no byte read twice, memory beyond the buffers only the scratch bytes.

:class:`RunCheck` computes each block's CRC-32C across the segments that hold it, in
order, from pieces of any size, and compares it with the manifest's. Each transport has
its fill, next to it: on object stores one ranged GET whose body is streamed into the
segments, then checked (:meth:`~cloudckpt.storage.reads.StorageReads.read_into_many`);
on local files ``readinto`` piece by piece (:meth:`RunCheck.pieces`: the segments cut
where blocks end), each block checked as soon as it is filled, while its bytes are in the
CPU's cache (:meth:`~cloudckpt.storage.checkpoint.CheckpointStorage.read_into_many`).

Pure planning and checking; no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from cloudckpt.errors import CorruptObjectError
from cloudckpt.storage.blocks import BlockCrcs, BlockVerifier, block_runs, covering
from cloudckpt.storage.checked import Expected
from cloudckpt.storage.retry import current_rank
from cloudckpt.storage.types import ReadRequest


@dataclass(frozen=True)
class ScatterRun:
    """One read ``[start, end)`` of ``path`` (one request) and where its bytes go.

    Attributes:
        path: the object (relative to the checkpoint root).
        start: first byte (a block boundary, for an object with block CRCs).
        end: one past the last byte (a block boundary, or the object's end).
        segments: consecutive views that together take the ``end - start`` bytes.
        copies: ``(object offset, view)``: bytes of the run also wanted by another
            buffer, copied out of :attr:`segments` once they are checked.
    """

    path: str
    start: int
    end: int
    segments: tuple[memoryview, ...]
    copies: tuple[tuple[int, memoryview], ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes the read returns."""
        return self.end - self.start

    def copy_out(self) -> None:
        """Fill every view of :attr:`copies` from the received segments."""
        for offset, view in self.copies:
            gather(self.segments, offset - self.start, view)


def plan_reads(
    expected: Expected, items: Sequence[tuple[ReadRequest, memoryview]], limit: int
) -> list[ScatterRun]:
    """The reads that fill every buffer of ``items`` (empty ones excepted): for an
    object with block CRCs, runs of whole blocks of at most ``limit`` bytes
    (:func:`plan_scatter`); for any other, one read per range, as it is.

    Raises:
        CorruptObjectError: a range goes past the object's recorded size.
    """
    by_path: dict[str, list[tuple[int, memoryview]]] = {}
    for request, view in items:
        expected.check_range(request.path, request.start, request.start + view.nbytes)
        by_path.setdefault(request.path, []).append((request.start, view))
    runs: list[ScatterRun] = []
    for path, wanted in by_path.items():
        blocks, size = expected.blocks_of(path), expected.size(path)
        if blocks is None or size is None:
            runs += [ScatterRun(path, s, s + v.nbytes, (v,)) for s, v in wanted if v.nbytes]
        else:
            runs += plan_scatter(path, wanted, size, blocks.block_size, limit)
    return runs


def plan_scatter(
    path: str,
    wanted: Sequence[tuple[int, memoryview]],
    size: int,
    block_size: int,
    limit: int,
) -> list[ScatterRun]:
    """The reads that fill every ``(start, view)`` of ``wanted`` (bytes ``[start,
    start + view.nbytes)`` of ``path``, an object of ``size`` bytes whose blocks are
    ``block_size``), at most ``limit`` bytes each (rounded down to whole blocks)."""
    ordered = sorted(((s, v) for s, v in wanted if v.nbytes), key=lambda item: item[0])
    spans = [covering(s, s + v.nbytes, size, block_size) for s, v in ordered]
    runs = block_runs(spans, block_size, limit)
    starts = [a for a, _ in runs]
    pieces: list[list[tuple[int, memoryview]]] = [[] for _ in runs]
    for start, view in ordered:  # in order of start: each run's pieces come sorted
        end = start + view.nbytes
        index = bisect.bisect_right(starts, start) - 1
        while index < len(runs) and runs[index][0] < end:
            a, b = runs[index]
            lo, hi = max(start, a), min(end, b)
            if lo < hi:
                pieces[index].append((lo, view[lo - start : hi - start]))
            index += 1
    return [_run(path, a, b, p) for (a, b), p in zip(runs, pieces, strict=True)]


def _run(path: str, start: int, end: int, pieces: list[tuple[int, memoryview]]) -> ScatterRun:
    """The segments of one run: its pieces in order, scratch for the gaps; bytes a
    piece shares with an earlier one become copies."""
    segments: list[memoryview] = []
    copies: list[tuple[int, memoryview]] = []
    pos = start
    for lo, view in pieces:
        hi = lo + view.nbytes
        if hi <= pos:  # all already placed
            copies.append((lo, view))
            continue
        head = max(pos - lo, 0)  # bytes already placed: copied, the rest received
        if head:
            copies.append((lo, view[:head]))
        elif lo > pos:
            segments.append(memoryview(bytearray(lo - pos)))
        segments.append(view[head:])
        pos = hi
    if pos < end:
        segments.append(memoryview(bytearray(end - pos)))
    return ScatterRun(path, start, end, tuple(segments), tuple(copies))


def gather(segments: Sequence[memoryview], offset: int, out: memoryview) -> None:
    """Copy ``out.nbytes`` bytes from ``offset`` of the concatenated ``segments``."""
    pos, done = 0, 0
    for segment in segments:
        if done == out.nbytes:
            return
        seg_end = pos + segment.nbytes
        if seg_end > offset + done:
            a = offset + done - pos
            take = min(segment.nbytes - a, out.nbytes - done)
            out[done : done + take] = segment[a : a + take]
            done += take
        pos = seg_end
    if done != out.nbytes:
        raise ValueError(f"segments hold {pos} bytes; {offset}+{out.nbytes} asked")


class RunCheck:
    """The CRC-32C of every block of a run, computed from its bytes fed in order, in
    pieces of any size, and compared with the manifest's (:meth:`Expected.blocks_of
    <cloudckpt.storage.checked.Expected.blocks_of>`; an object without them is not
    checked). A block is compared as soon as its last byte is fed.

    :meth:`add` never raises (it may run inside a read, whose errors are translated);
    :meth:`finish` raises for the first block that differed.
    """

    def __init__(self, run: ScatterRun, expected: Expected) -> None:
        self.run = run
        self.expected = expected
        self.blocks = expected.blocks_of(run.path)
        self._verifier = (
            None if self.blocks is None else BlockVerifier(self.blocks, run.start, run.end)
        )

    @property
    def failed(self) -> bool:
        """Whether a block fed so far differed."""
        return self._verifier is not None and bool(self._verifier.bad)

    def add(self, piece: memoryview) -> None:
        """Fold the next filled bytes of the run into its blocks' CRC-32Cs."""
        if self._verifier is not None:
            self._verifier.update(piece)

    def pieces(self) -> list[memoryview]:
        """The run's segments cut where its blocks end: filled one after the other and
        each passed to :meth:`add`, every block is checked right after it is read, while
        its bytes are still in the CPU's cache (a second pass over the run from memory
        costs about half again as much)."""
        if self.blocks is None:
            return list(self.run.segments)
        bs = self.blocks.block_size
        pieces: list[memoryview] = []
        at = self.run.start
        for segment in self.run.segments:
            view = segment
            while view.nbytes:
                take = min(bs - at % bs, view.nbytes)
                pieces.append(view[:take] if take < view.nbytes else view)
                at += take
                view = view[take:]
        return pieces

    def finish(self) -> None:
        """Raise :class:`CorruptObjectError` naming the first block that differed."""
        if self._verifier is None or self.blocks is None:
            return
        bad = self._verifier.finish()
        if bad:
            raise _corrupt(self.expected, self.run, self.blocks, bad)


def check_run(run: ScatterRun, expected: Expected) -> None:
    """Compare the CRC-32C of every block of a filled run with the manifest's.

    Raises:
        CorruptObjectError: naming the first block that differs.
    """
    check = RunCheck(run, expected)
    for segment in run.segments:
        check.add(segment)
    check.finish()


def _corrupt(
    expected: Expected, run: ScatterRun, blocks: BlockCrcs, bad: list[tuple[int, int]]
) -> CorruptObjectError:
    """The error :meth:`Expected.check_segments
    <cloudckpt.storage.checked.Expected.check_segments>` raises for the same blocks."""
    size = blocks.block_size
    index, actual = bad[0]
    first = index * size
    length = min(size, run.end - first)
    return CorruptObjectError(
        f"{expected.child_uri(run.path)}: bytes {first}-{first + length} (block "
        f"{index} of {len(blocks)}, {size}-byte blocks) read on rank {current_rank()} "
        f"have CRC-32C {actual:#010x}; the manifest recorded "
        f"{blocks.crc(index):#010x}; the object is corrupt or was damaged in transit"
        + (f" ({len(bad)} blocks differ)" if len(bad) > 1 else "")
    )


__all__ = ["RunCheck", "ScatterRun", "check_run", "gather", "plan_reads", "plan_scatter"]
