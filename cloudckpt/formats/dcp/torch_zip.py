"""Where a ``torch.save`` item keeps its storage bytes, from its zip directory.

``torch.save`` writes a zip archive: one record per file (``<archive>/data.pkl``,
``<archive>/data/0``, ...), each a local header, the file's bytes uncompressed and a
data descriptor, then the central directory and the end records (zip64 ones
included). A reader (torch's miniz, Python's ``zipfile``) finds a record through the
central directory and skips its local header to reach its bytes; :func:`find_storage`
does the same with :mod:`struct`, reading only the few bytes it needs through a
``read(offset, nbytes)`` callable: the item's memory, or the headers a writer kept
while the item's storage went straight to a file. About 10x cheaper than
``zipfile.ZipFile`` (which builds a ``ZipInfo`` per record).

:class:`ZipLayoutError` says the bytes are not the archive this expects (a reader
then falls back to ``zipfile``, or records nothing).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable

Reader = Callable[[int, int], bytes | bytearray | memoryview | None]
"""``read(offset, nbytes)``: the item's bytes ``[offset, offset + nbytes)``, or None
when they are not at hand."""

STORAGE_NAME = re.compile(rb"[^/]+/data/\d+")
"""A storage record's name: ``<archive>/data/<key>``."""

_EOCD = struct.Struct("<4sHHHHIIH")  # signature, 2 disks, 2 entry counts, cd size/offset, comment
_EOCD_SIGNATURE = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end locator: signature, disk, end record offset, disks
_LOCATOR_SIGNATURE = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")  # zip64 end record, up to the central directory offset
_EOCD64_SIGNATURE = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4s4xHH8xIIHHH8xI")  # sig, flags, method, sizes, lengths, header offset
_CENTRAL_SIGNATURE = b"PK\x01\x02"
_LOCAL = struct.Struct("<4s22xHH")  # signature ... file name length, extra length
_LOCAL_SIGNATURE = b"PK\x03\x04"
_ZIP64_EXTRA = 0x0001
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_STORED = 0


class ZipLayoutError(ValueError):
    """The bytes are not a zip archive laid out as expected (or are not at hand)."""


def find_storage(read: Reader, size: int) -> tuple[int, int] | None:
    """``(start, nbytes)`` of the only storage record of the ``size``-byte archive
    ``read`` gives, stored uncompressed; None when there is not exactly one storage
    record or it is compressed.

    Raises:
        ZipLayoutError: the archive is not laid out as expected (not a zip, a comment
            after the end record, several disks, bytes not at hand).
    """
    entries, cd_size, cd_offset = _directory(read, size)
    directory = _bytes(read, cd_offset, cd_size)
    found: list[tuple[int, int, int, int]] = []
    position = 0
    for _ in range(entries):
        method, csize, usize, header, position, name = _central_entry(directory, position)
        if STORAGE_NAME.fullmatch(name):
            found.append((method, csize, usize, header))
    if len(found) != 1:
        return None
    method, csize, usize, header = found[0]
    if method != _STORED or csize != usize:
        return None
    signature, name_length, extra_length = _LOCAL.unpack(_bytes(read, header, _LOCAL.size))
    if signature != _LOCAL_SIGNATURE:
        raise ZipLayoutError(f"no local header at {header}")
    start = header + _LOCAL.size + name_length + extra_length
    if start + usize > cd_offset:
        raise ZipLayoutError(f"record [{start}, {start + usize}) runs into the directory")
    return start, usize


def _bytes(read: Reader, offset: int, nbytes: int) -> bytes | bytearray | memoryview:
    data = read(offset, nbytes) if offset >= 0 else None
    if data is None or len(data) != nbytes:
        raise ZipLayoutError(f"bytes [{offset}, {offset + nbytes}) are not at hand")
    return data


def _directory(read: Reader, size: int) -> tuple[int, int, int]:
    """Entries, size and offset of the central directory (zip64 end records first)."""
    end = size - _EOCD.size
    signature, disk, cd_disk, _, entries, cd_size, cd_offset, comment = _EOCD.unpack(
        _bytes(read, end, _EOCD.size)
    )
    if signature != _EOCD_SIGNATURE or comment or disk or cd_disk:
        raise ZipLayoutError("no end of central directory record at the end")
    locator = read(end - _LOCATOR.size, _LOCATOR.size) if end >= _LOCATOR.size else None
    if locator is not None and len(locator) == _LOCATOR.size:
        found, _, record, _ = _LOCATOR.unpack(locator)
        if found == _LOCATOR_SIGNATURE:
            fields = _EOCD64.unpack(_bytes(read, record, _EOCD64.size))
            if fields[0] != _EOCD64_SIGNATURE:
                raise ZipLayoutError(f"no zip64 end record at {record}")
            entries, cd_size, cd_offset = fields[7], fields[8], fields[9]
    if cd_offset + cd_size > size:
        raise ZipLayoutError("central directory past the end")
    return entries, cd_size, cd_offset


def _central_entry(
    directory: bytes | bytearray | memoryview, position: int
) -> tuple[int, int, int, int, int, bytes]:
    """One central directory entry at ``position``: method, compressed and plain
    sizes, local header offset (zip64 values applied), the next entry's position and
    the file name."""
    if position + _CENTRAL.size > len(directory):
        raise ZipLayoutError("central directory entry cut short")
    signature, _, method, csize, usize, name_length, extra_length, comment_length, header = (
        _CENTRAL.unpack_from(directory, position)
    )
    if signature != _CENTRAL_SIGNATURE:
        raise ZipLayoutError(f"no central directory entry at {position}")
    name_at = position + _CENTRAL.size
    extra_at = name_at + name_length
    following = extra_at + extra_length + comment_length
    if following > len(directory):
        raise ZipLayoutError("central directory entry cut short")
    name = bytes(directory[name_at:extra_at])
    if _U32_MAX in (csize, usize, header):
        extra = bytes(directory[extra_at : extra_at + extra_length])
        usize, csize, header = _zip64_values(extra, usize, csize, header)
    return method, csize, usize, header, following, name


def _zip64_values(extra: bytes, usize: int, csize: int, header: int) -> tuple[int, int, int]:
    """The sizes and header offset of an entry, with those the zip64 extra field
    holds (in its order: plain size, compressed size, header offset)."""
    position = 0
    while position + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + length]
        position += 4 + length
        if kind != _ZIP64_EXTRA:
            continue
        values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) - len(body) % 8])]
        resolved = []
        for value in (usize, csize, header):
            if value != _U32_MAX:
                resolved.append(value)
            elif values:
                resolved.append(values.pop(0))
            else:
                raise ZipLayoutError("zip64 extra field too short")
        return resolved[0], resolved[1], resolved[2]
    raise ZipLayoutError("zip64 sizes without a zip64 extra field")


__all__ = ["STORAGE_NAME", "Reader", "ZipLayoutError", "find_storage"]
