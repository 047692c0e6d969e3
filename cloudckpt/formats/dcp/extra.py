"""Each rank's extra metadata (``mcore_data``) as its local plan carries it to the
coordinator, and the coordinator's merge of them.

A rank's extra metadata says, per key of a tensor it holds, what the load needs besides
DCP's metadata (the global shape of a flattened tensor, ...): about a hundred bytes per
key, sent by every rank. The ranks of one DP group hold the same keys and send equal
extras, so the coordinator of a large world would unpickle and merge the same entries
once per DP replica (most of its time for the plans). Each rank sends its extra pickled
(:class:`PickledExtra`); the coordinator unpickles each distinct pickle once and merges
them (:func:`merge_extras`) into exactly what merging every rank's, in rank order, gives.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PickledExtra:
    """A rank's extra metadata, pickled and zlib-compressed (its keys repeat the
    tensors' long names: a few times fewer bytes to send, for well under a millisecond
    on the rank). Equal extras give equal bytes: the coordinator looks each distinct
    one up once."""

    raw: bytes

    @classmethod
    def of(cls, extra: dict[str, Any]) -> PickledExtra:
        return cls(zlib.compress(pickle.dumps(extra, protocol=pickle.HIGHEST_PROTOCOL), 1))

    def value(self) -> dict[str, Any]:
        """The extra metadata (unpickled: it came from a rank of this job, as the
        plan that carried it)."""
        out = pickle.loads(zlib.decompress(self.raw))
        if not isinstance(out, dict):
            raise TypeError(f"a rank's extra metadata is a {type(out).__name__}, not a dict")
        return out


def merge_extras(merged: dict[str, Any], sent: Sequence[Any]) -> None:
    """Update ``merged`` with each rank's extra (``sent``, by rank: a
    :class:`PickledExtra`, a dict, or anything else, which carries none) as updating
    it with each in rank order would: the keys in the order they are first sent, each
    key's value the last rank's that sent it. Each distinct pickle is unpickled once."""
    values: dict[Any, dict[str, Any]] = {}
    last: dict[Any, int] = {}
    for rank, data in enumerate(sent):
        if isinstance(data, PickledExtra):
            key: Any = data.raw
            if key not in values:
                values[key] = data.value()
        elif isinstance(data, dict):
            key = rank
            values[key] = data
        else:
            continue
        last[key] = rank
    for extra in values.values():  # in the order each was first sent: the keys' order
        merged.update(extra)
    if len(values) > 1:  # the values of the last rank sending each key
        for key in sorted(last, key=last.__getitem__):
            merged.update(values[key])


__all__ = ["PickledExtra", "merge_extras"]
