"""One ``cloudckpt bench`` run's options (:class:`BenchOptions`) and the checkpoint
config its saves and loads use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cloudckpt.config import CheckpointConfig


@dataclass(frozen=True)
class BenchOptions:
    """One ``cloudckpt bench`` run.

    Attributes:
        uri: a prefix to write under (a fresh child of it is used and removed after).
        size_bytes: the requested state size (the workload's actual size is close).
        world_size: number of rank processes.
        backend: cloudckpt's sharded backend, ``torch_dist`` or ``zarr``.
        storage_options: fsspec options for the URI (endpoint, credentials).
        repeat: rounds of every phase; each figure is the best round's.
        timeout_s: the longest the ranks may take, all phases together.
        fully_parallel: also save and load with the fully parallel wrappers over the
            data-parallel group, interleaved with the plain save and load.
        constant_structure: also make repeated async saves through one torch_dist
            strategy with ``cached_metadata=True`` (first and later saves timed apart).
        server_pid: the store's process when it runs on this host (``--server``): its
            CPU time in every phase is measured too (rank 0's figure is reported).
    """

    uri: str
    size_bytes: int
    world_size: int = 4
    backend: str = "torch_dist"
    storage_options: dict[str, Any] = field(default_factory=dict)
    repeat: int = 1
    timeout_s: float = 3600.0
    fully_parallel: bool = False
    constant_structure: bool = False
    server_pid: int | None = None

    @property
    def is_s3(self) -> bool:
        """Whether the URI is on S3 (else a local directory)."""
        return self.uri.startswith("s3://")


def _config(options: BenchOptions) -> CheckpointConfig:
    return CheckpointConfig(backend=options.backend)
