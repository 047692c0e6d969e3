"""Block CRCs: a CRC-32C per fixed-size block of an object, so that a ranged read can
be verified against the blocks it covers without reading the whole object.

A writer cuts each object into blocks of ``block_size`` bytes (the last one may be
shorter) and checksums every block once, as the bytes stream out; the object's own
CRC-32C is then *combined* from the block CRCs (CRC-32C is linear over GF(2):
``crc(a + b)`` follows from ``crc(a)``, ``crc(b)`` and ``len(b)``), and so is the
CRC-32C of every multipart part (parts are whole numbers of blocks). One pass over the
bytes gives all three. Objects no larger than one block keep only their object CRC.

Pure functions and one frozen value; no I/O.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from cloudckpt.config import MiB
from cloudckpt.storage.buffers import Buffer, as_bytes_view, crc32c

BLOCK_SIZE = MiB
"""Bytes per block: the read amplification of a checked ranged read is at most one
block at each end of the range, and the manifest grows by 4 bytes (5.3 in base64) per
block, about 5.3 KiB per GiB."""

MIN_BLOCK_SIZE = 64 * 1024
"""Below this, blocks are the multipart part size instead (an odd ``part_size`` whose
greatest common divisor with :data:`BLOCK_SIZE` is tiny)."""

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_X0 = 1 << 31  # the polynomial 1 in reflected form (bit 31 is x^0)


@dataclass(frozen=True, slots=True)
class BlockCrcs:
    """The CRC-32C of every ``block_size`` bytes of one object, in order.

    Attributes:
        block_size: bytes per block (the last block of the object may be shorter).
        packed: 4 bytes per block, big-endian, as the manifest stores them (base64).
    """

    block_size: int
    packed: bytes

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if len(self.packed) % 4:
            raise ValueError(f"packed block CRCs must be 4 bytes each, got {len(self.packed)}")

    @classmethod
    def of(cls, block_size: int, crcs: Iterable[int]) -> BlockCrcs:
        """Pack ``crcs`` (unsigned ints)."""
        return cls(block_size, b"".join(c.to_bytes(4, "big") for c in crcs))

    @classmethod
    def from_base64(cls, block_size: int, text: str) -> BlockCrcs:
        """The manifest's form (raises ``ValueError`` when malformed)."""
        return cls(block_size, base64.b64decode(text.encode("ascii"), validate=True))

    def to_base64(self) -> str:
        """The manifest's form."""
        return base64.b64encode(self.packed).decode("ascii")

    def __len__(self) -> int:
        return len(self.packed) // 4

    def crc(self, index: int) -> int:
        """The CRC-32C of block ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        return int.from_bytes(self.packed[4 * index : 4 * index + 4], "big")

    def covers(self, size: int) -> bool:
        """True when these are exactly the blocks of an object of ``size`` bytes."""
        return len(self) == block_count(size, self.block_size)


# -- combining CRCs ----------------------------------------------------------------------


def _times(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the CRC-32C polynomial (both reflected)."""
    product = 0
    bit = _X0
    while bit and a:
        if a & bit:
            product ^= b
            a ^= bit
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1  # b *= x
        bit >>= 1
    return product


def _powers() -> list[int]:
    """``x^(2^k)`` modulo the polynomial, for k = 0..63 (lengths up to 2^60 bytes)."""
    table = [_X0 >> 1]  # x^1
    for _ in range(63):
        table.append(_times(table[-1], table[-1]))
    return table


_X_POW_2K = _powers()


@lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial: appending ``nbytes`` bytes."""
    result, k, n = _X0, 3, nbytes
    while n:
        if n & 1:
            result = _times(_X_POW_2K[k], result)
        n >>= 1
        k += 1
    return result


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32C of ``a + b`` from the CRC-32Cs of ``a`` and ``b`` and ``len(b)``."""
    return _times(_shift(len_b), crc_a) ^ crc_b if len_b else crc_a


# -- writing -----------------------------------------------------------------------------


def block_count(size: int, block_size: int) -> int:
    """Blocks of an object of ``size`` bytes (an empty object has none)."""
    return -(-size // block_size)


def block_size_for(part_size: int) -> int:
    """The block size of an object uploaded in parts of ``part_size`` bytes: a divisor
    of the part size (so each part's blocks are whole and its CRC follows from them),
    :data:`BLOCK_SIZE` whenever the part size is a multiple of it."""
    divisor = math.gcd(part_size, BLOCK_SIZE)
    return divisor if divisor >= MIN_BLOCK_SIZE else part_size


def checksum_blocks(data: Buffer, block_size: int) -> tuple[int, list[int]]:
    """The CRC-32C of ``data`` and of each of its ``block_size`` blocks, in one pass."""
    view = as_bytes_view(data)
    whole, crcs = 0, []
    for start in range(0, view.nbytes, block_size):
        block = view[start : start + block_size]
        crc = crc32c(block)
        crcs.append(crc)
        whole = combine(whole, crc, block.nbytes)
    return whole, crcs


def object_checksum(data: Buffer, block_size: int = BLOCK_SIZE) -> tuple[int, BlockCrcs | None]:
    """An object's CRC-32C, with its block CRCs when it is larger than one block."""
    view = as_bytes_view(data)
    if view.nbytes <= block_size:
        return crc32c(view), None
    whole, crcs = checksum_blocks(view, block_size)
    return whole, BlockCrcs.of(block_size, crcs)


class BlockChecksummer:
    """:func:`object_checksum` of bytes fed in pieces of any size, in order, with each
    byte read once (the block CRCs as they fill, the object's combined from them)."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.size = 0
        self._whole = 0
        self._crcs: list[int] = []
        self._crc = 0  # of the block being filled
        self._fill = 0  # its bytes so far

    def update(self, data: Buffer) -> None:
        """Checksum the next bytes of the object."""
        view = as_bytes_view(data)
        self.size += view.nbytes
        while view.nbytes:
            take = min(self.block_size - self._fill, view.nbytes)
            self._crc = crc32c(view[:take] if take < view.nbytes else view, self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.block_size:
                self._close_block()

    def part(self) -> PartChecksum:
        """The bytes fed so far as one multipart part (its first byte starts a block;
        call once, after the last :meth:`update`)."""
        if self._fill:
            self._close_block()
        return PartChecksum(self._whole, self.size, tuple(self._crcs))

    def _close_block(self) -> None:
        self._crcs.append(self._crc)
        self._whole = combine(self._whole, self._crc, self._fill)
        self._crc, self._fill = 0, 0

    def result(self) -> tuple[int, BlockCrcs | None]:
        """The object's CRC-32C, with its block CRCs when it is larger than one block
        (as :func:`object_checksum`; call once, after the last :meth:`update`)."""
        if self._fill:
            self._close_block()
        if self.size <= self.block_size:
            return self._whole, None
        return self._whole, BlockCrcs.of(self.block_size, self._crcs)


@dataclass(frozen=True, slots=True)
class PartChecksum:
    """One multipart part: its CRC-32C, length and block CRCs."""

    crc: int
    length: int
    blocks: tuple[int, ...]


def part_checksum(part: Buffer, block_size: int) -> PartChecksum:
    """Checksum one part (its first byte starts a block)."""
    view = as_bytes_view(part)
    crc, crcs = checksum_blocks(view, block_size)
    return PartChecksum(crc, view.nbytes, tuple(crcs))


def segments_checksum(segments: Iterable[Buffer], block_size: int) -> PartChecksum:
    """:func:`part_checksum` of the concatenation of ``segments``, without joining them."""
    summer = BlockChecksummer(block_size)
    for segment in segments:
        summer.update(segment)
    return summer.part()


def join_parts(parts: Sequence[PartChecksum], block_size: int) -> tuple[int, BlockCrcs | None]:
    """The object's CRC-32C and block CRCs from its parts' (in part order)."""
    whole = 0
    for part in parts:
        whole = combine(whole, part.crc, part.length)
    size = sum(part.length for part in parts)
    if size <= block_size:
        return whole, None
    return whole, BlockCrcs.of(block_size, (c for part in parts for c in part.blocks))


# -- reading -----------------------------------------------------------------------------


def covering(start: int, end: int, size: int, block_size: int) -> tuple[int, int]:
    """The smallest run of whole blocks containing ``[start, end)`` (``end <= size``)."""
    return start - start % block_size, min(size, -(-end // block_size) * block_size)


def inner(start: int, end: int, size: int, block_size: int) -> tuple[int, int]:
    """The whole blocks inside ``[start, end)`` (a block ending at ``size`` is whole);
    an empty range (``a >= b``) when there are none."""
    first = -(-start // block_size) * block_size
    last = end if end == size else end - end % block_size
    return first, last


def block_mismatches(
    segments: Sequence[Buffer], offset: int, blocks: BlockCrcs
) -> list[tuple[int, int]]:
    """``(block index, CRC-32C received)`` of every block of the concatenated
    ``segments`` (whole blocks from block boundary ``offset``; the last may be the
    object's short last block) that differs from the recorded one."""
    verifier = BlockVerifier(blocks, offset)
    for segment in segments:
        verifier.update(as_bytes_view(segment))
    return verifier.finish()


class BlockVerifier:
    """The CRC-32C of every block of bytes fed in pieces of any size, in order, from
    block boundary ``offset`` (up to ``end``, where a block closes even if short: the
    object's last), compared with the recorded ``blocks`` as soon as the block's last
    byte is fed; :attr:`bad` lists ``(block index, CRC-32C received)`` of those that
    differ. Never raises for a mismatch."""

    def __init__(self, blocks: BlockCrcs, offset: int, end: int | None = None) -> None:
        self.blocks = blocks
        self.end = end
        self.bad: list[tuple[int, int]] = []
        self._index = offset // blocks.block_size
        self._crc = 0
        self._fill = 0  # bytes of the block being fed so far
        self._need = self._length()  # bytes it still lacks

    def _length(self) -> int:
        size = self.blocks.block_size
        return size if self.end is None else min(size, self.end - self._index * size)

    def update(self, view: memoryview) -> None:
        """Feed the next bytes (a flat byte view)."""
        n, pos = view.nbytes, 0
        while pos < n:
            if self._need <= 0:
                raise ValueError(f"bytes fed past the end {self.end}")
            take = min(self._need, n - pos)
            self._crc = crc32c(view if take == n else view[pos : pos + take], self._crc)
            pos += take
            self._fill += take
            self._need -= take
            if not self._need:
                self._close()

    def finish(self) -> list[tuple[int, int]]:
        """:attr:`bad`, a partly fed last block included (call once, at the end)."""
        if self._fill:
            self._close()
        return self.bad

    def _close(self) -> None:
        if self._crc != self.blocks.crc(self._index):
            self.bad.append((self._index, self._crc))
        self._index += 1
        self._crc, self._fill = 0, 0
        self._need = self._length()


def block_runs(
    spans: Iterable[tuple[int, int]], block_size: int, limit: int
) -> list[tuple[int, int]]:
    """The block-aligned ``spans`` of one object merged where they overlap or touch,
    then cut into runs of at most ``limit`` bytes (rounded down to whole blocks): the
    ranged GETs that fetch every needed block once."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    step = whole_blocks(limit, block_size)
    return [(s, min(s + step, end)) for start, end in merged for s in range(start, end, step)]


def whole_blocks(limit: int, block_size: int) -> int:
    """``limit`` rounded down to whole blocks (at least one)."""
    return max(block_size, limit - limit % block_size)
