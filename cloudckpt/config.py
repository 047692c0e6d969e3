"""Checkpoint configuration: defaults and limits shared by storage and strategies."""

from __future__ import annotations

MiB = 2**20
GiB = 2**30

# S3's multipart limits (also those of MinIO and GCS's XML API).
S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000

DEFAULT_PART_SIZE = 32 * MiB
"""Objects larger than this go up as multipart uploads of parts this size."""
DEFAULT_MAX_IN_FLIGHT = 16
"""The most storage requests (whole objects, parts or ranges) one process keeps in flight."""
DEFAULT_CHUNK_SIZE = 256 * MiB
"""Shards larger than this are split into several zarr chunks (objects)."""
