"""The pieces the columned ``.metadata`` pickle (:mod:`.metadata_pickle`) is written
from: a stream of opcodes with its memo in the form the standard pickler takes
(:class:`_Stream`), the opcodes of ints, strings, classes, tuples and ``torch.Size``
values, blocks of fixed-width records built with numpy (:func:`_record_array`), and the
record of one plain ``storage_data`` item (:func:`_record_parts`)."""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

PROTOCOL = 4  # pickle.dumps's default protocol here: what the writer wrote before
_INT32 = (-(1 << 31), (1 << 31) - 1)
_LONG_GET = pickle.LONG_BINGET

#: the field names the records refer to (memoized once)
_NAMES = {
    name: name for name in ("fqn", "offset", "index", "relative_path", "length", "offsets", "sizes")
}


class _Stream:
    """The pickle being written and what it memoized, as the pickler's memo expects
    it (``{id(obj): (memo index, obj)}``)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.write = self.buffer.write
        self.memo: dict[int, tuple[int, Any]] = {}

    def memoize(self, obj: Any, push: Callable[[Any], bytes]) -> int:
        """Memoize ``obj`` (pushed by the opcodes ``push(obj)``, then popped) unless it
        is; its memo index."""
        known = self.memo.get(id(obj))
        if known is not None:
            return known[0]
        index = len(self.memo)
        self.write(push(obj) + pickle.MEMOIZE + pickle.POP)
        self.memo[id(obj)] = (index, obj)
        return index

    def get(self, obj: Any) -> bytes:
        """The opcode pushing memoized ``obj``."""
        return _get(self.memo[id(obj)][0])


def _get(index: int) -> bytes:
    if index < 256:
        return pickle.BINGET + bytes([index])
    return pickle.LONG_BINGET + struct.pack("<I", index)


def _string(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    if _INT32[0] <= value <= _INT32[1]:
        return pickle.BININT + struct.pack("<i", value)
    return pickle.LONG1 + _long_bytes(value)


def _long_bytes(value: int) -> bytes:
    """LONG1's operand: a length byte and the little-endian two's complement."""
    raw = value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    return bytes([len(raw)]) + raw


def _global(cls: type) -> bytes:
    return _string(cls.__module__) + _string(cls.__qualname__) + pickle.STACK_GLOBAL


def _push_size(out: _Stream, size: torch.Size) -> bytes:
    elements = b"".join(_int(int(v)) for v in size)
    return (
        out.get(torch.Size) + pickle.MARK + elements + pickle.TUPLE + pickle.TUPLE1 + pickle.REDUCE
    )


def _push_point(point: tuple[int, ...]) -> bytes:
    """A tuple of ints (a record table's key)."""
    return pickle.MARK + b"".join(_int(int(v)) for v in point) + pickle.TUPLE


def _record_array(parts: list[tuple[str, bytes | str]], n: int) -> Any:
    """``n`` fixed-width records of ``parts``: (name, constant bytes or numpy type)."""
    dtype = np.dtype(
        [(f, p if isinstance(p, str) else f"S{len(p)}") for f, p in parts], align=False
    )
    template = np.zeros(1, dtype=dtype)
    for name, part in parts:
        if isinstance(part, bytes):
            template[name] = part
    rec = np.empty(n, dtype=dtype)
    whole = f"V{dtype.itemsize}"  # the constants copied as one record (not field by field)
    rec.view(whole)[:] = template.view(whole)[0]
    return rec


def _record_parts(
    out: _Stream, wide: bool, names: dict[str, str] | None = None
) -> list[tuple[str, bytes | str]]:
    """The fields of a plain item's record: (name, constant opcodes or numpy type)."""
    names = names or _NAMES
    int_op, int_type = (pickle.LONG1 + b"\x08", "<i8") if wide else (pickle.BININT, "<i4")
    key_cls, info_cls = out.get(MetadataIndex), out.get(_StorageInfo)
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ + pickle.EMPTY_DICT + pickle.MARK
    end = pickle.SETITEMS + pickle.BUILD
    return [
        ("c0", key_cls + new + out.get(names["fqn"]) + pickle.LONG_BINGET),
        ("fqn", "<u4"),
        ("c1", out.get(names["index"]) + int_op),
        ("index", int_type),
        ("c2", out.get(names["offset"]) + pickle.LONG_BINGET),
        ("offset", "<u4"),
        ("c3", end + info_cls + new + out.get(names["relative_path"]) + pickle.LONG_BINGET),
        ("path", "<u4"),
        ("c4", out.get(names["offset"]) + int_op),
        ("start", int_type),
        ("c5", out.get(names["length"]) + int_op),
        ("length", int_type),
        ("c6", end),
    ]
