"""The longest object paths a store holds below a checkpoint root.

A write past them fails on the store - S3 answers ``KeyTooLongError``, a local disk
``ENAMETOOLONG`` - after the save claimed its URI, so the corrected retry to the same
URI would meet a claim. A save therefore checks every path it derives from its keys
against :func:`path_limits` before the claim (:mod:`cloudckpt.keys`), like the rules
that hold on every store (:func:`~cloudckpt.storage.location.relpath_problem`).

Limits, in UTF-8 bytes: S3 1,024 per key (the bucket not counted, the checkpoint's
prefix counted); GCS 1,024 per object name; a local disk its filesystem's
``NAME_MAX`` per path segment and ``PATH_MAX`` per path (``os.pathconf``; 255 and
4,096 where it cannot tell). ``memory://`` and other stores: none known.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cloudckpt.storage.location import Location, StoreKind

S3_MAX_KEY_BYTES = 1024  # an object key, the bucket not counted
GCS_MAX_NAME_BYTES = 1024  # an object name
LOCAL_NAME_MAX = 255  # per path segment where pathconf cannot tell (ext4, xfs, tmpfs)
LOCAL_PATH_MAX = 4096  # per path, the terminating NUL included (Linux's PATH_MAX)


@dataclass(frozen=True)
class PathLimits:
    """The longest object paths a store holds below one checkpoint root, in UTF-8 bytes.

    Attributes:
        store: the store, for messages (``"S3"``, ``"GCS"``, ``"this filesystem"``).
        prefix_bytes: what the root adds to every path counted by ``max_path_bytes``,
            its ``/`` included: on S3 and GCS the key prefix after the bucket, on a
            local disk the absolute path of the root.
        max_path_bytes: the longest whole path (None: no limit).
        max_segment_bytes: the longest path segment between two ``/`` (None: no limit).
    """

    store: str
    prefix_bytes: int = 0
    max_path_bytes: int | None = None
    max_segment_bytes: int | None = None

    @property
    def bounded(self) -> bool:
        """Whether some path is too long for the store."""
        return self.max_path_bytes is not None or self.max_segment_bytes is not None

    def problem(self, relpath: str) -> str | None:
        """Why the store cannot hold ``relpath`` below the root, or None when it can."""
        if self.max_segment_bytes is not None:
            longest = max(utf8_len(segment) for segment in relpath.split("/"))
            if longest > self.max_segment_bytes:
                return (
                    f"it has a path segment of {longest} bytes; {self.store} holds at most "
                    f"{self.max_segment_bytes} bytes per segment"
                )
        if self.max_path_bytes is not None:
            total = self.prefix_bytes + utf8_len(relpath)
            if total > self.max_path_bytes:
                return (
                    f"it is {total} bytes long with the checkpoint's prefix; {self.store} "
                    f"holds at most {self.max_path_bytes} bytes per path"
                )
        return None


NO_PATH_LIMITS = PathLimits("")
"""A store that holds paths of any length (``memory://``, or limits unknown)."""


def path_limits(location: Location) -> PathLimits:
    """The limits of ``location``'s store below its root."""
    if location.kind in (StoreKind.S3, StoreKind.GCS):
        prefix = location.root.partition("/")[2]  # the key's part after the bucket
        s3 = location.kind is StoreKind.S3
        return PathLimits(
            "S3" if s3 else "GCS",
            utf8_len(prefix) + 1 if prefix else 0,
            S3_MAX_KEY_BYTES if s3 else GCS_MAX_NAME_BYTES,
        )
    if location.kind is StoreKind.LOCAL:
        root = os.path.abspath(location.root or ".")
        name_max, path_max = _local_limits(root)
        # a path handed to a syscall ends with a NUL, which PATH_MAX counts
        return PathLimits("this filesystem", utf8_len(root) + 1, path_max - 1, name_max)
    return NO_PATH_LIMITS


def utf8_len(text: str) -> int:
    """Bytes of ``text`` as a store receives it (UTF-8)."""
    return len(text.encode("utf-8", "surrogatepass"))


def _local_limits(root: str) -> tuple[int, int]:
    """``(NAME_MAX, PATH_MAX)`` of the filesystem that holds (or will hold) ``root``,
    asked of its nearest existing ancestor; Linux's defaults where it cannot tell."""
    existing = root
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    found = []
    for name, default in (("PC_NAME_MAX", LOCAL_NAME_MAX), ("PC_PATH_MAX", LOCAL_PATH_MAX)):
        try:
            value = os.pathconf(existing, name)
        except (OSError, ValueError, AttributeError):  # no pathconf, or no such name here
            value = -1
        found.append(value if value > 0 else default)
    return found[0], found[1]
