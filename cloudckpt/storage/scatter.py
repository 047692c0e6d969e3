"""Scatter reads: ranged GETs whose bytes land straight in the caller's buffers.

Reading many buffers out of one object (the tensors of a ``.distcp`` file) costs one
GET per run of needed blocks (:func:`~cloudckpt.storage.blocks.block_runs`: the
blocks the buffers cover, merged where they touch, cut at the part size). A run's
body is streamed, in order, into a list of *segments*: the slices of the caller's
buffers it covers, and small scratch buffers for the bytes no buffer wants (the
partly needed block at either end, the bytes between two items). Every block is then
checked against its CRC-32C across the segments it spans. No intermediate copy of
the run is made, and memory beyond the caller's buffers stays at the scratch bytes.

Bytes wanted by two buffers (overlapping ranges) are received once, into the first,
and copied to the other after the check (:attr:`ScatterRun.copies`).

Pure planning and checking; no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from cloudckpt.storage.blocks import block_runs, covering


@dataclass(frozen=True)
class ScatterRun:
    """One ranged GET ``[start, end)`` of ``path`` and where its bytes go.

    Attributes:
        path: the object (relative to the checkpoint root).
        start: first byte (a block boundary).
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
        """Bytes the GET returns."""
        return self.end - self.start

    def copy_out(self) -> None:
        """Fill every view of :attr:`copies` from the received segments."""
        for offset, view in self.copies:
            gather(self.segments, offset - self.start, view)


def plan_scatter(
    path: str,
    wanted: Sequence[tuple[int, memoryview]],
    size: int,
    block_size: int,
    limit: int,
) -> list[ScatterRun]:
    """The GETs that fill every ``(start, view)`` of ``wanted`` (bytes ``[start,
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
