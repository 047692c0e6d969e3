"""Save/load throughput of cloudckpt against baselines measured in the same run.

Baselines (the same tensors' bytes, the same filesystem client and settings, the same
number of requests in flight, no cloudckpt on top):
  memcpy     copying the bytes in memory (an upper bound for any staging);
  raw put    writing them as objects: on S3, every tensor larger than the part size
             is a multipart upload whose parts all go up concurrently (one semaphore of
             ``--workers`` over every request of every object, on the filesystem's
             event loop); elsewhere ``fs.pipe_file`` per object from ``--workers``
             threads;
  raw get    reading them back as concurrent ranged GETs of part size (one GET per
             object on local disks), ``--workers`` in flight.

Prints throughput and the ratio cloudckpt / raw for save and load (1.0 = no
overhead). Single process; a local temporary directory by default:

    .venv/bin/python benchmarks/bench_save_load.py [--uri URI] [--mib 512] [--tensors 16]
    .venv/bin/python benchmarks/bench_save_load.py --server seaweedfs --mib 256

``--uri s3://bucket/prefix`` takes the endpoint and credentials from the environment
(``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ...) as cloudckpt does. ``--server
seaweedfs`` starts a SeaweedFS S3 server on a loopback port for the run (the one the
tests use, ``tests/servers.py``; needs the dev extra), in a fresh bucket.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import fsspec.asyn
import torch
from _seaweedfs import seaweedfs_bucket  # benchmarks/_seaweedfs.py
from fsspec.implementations.local import LocalFileSystem

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import CheckpointConfig
from cloudckpt.storage import open_checkpoint

MiB = 2**20


def _state(mib: int, count: int) -> dict[str, torch.Tensor]:
    numel = mib * MiB // 4 // count
    rows = max(numel // 1024, 1)
    return {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(count)}


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's memory as bytes, without a copy (float32: numpy can view it)."""
    return memoryview(tensor.contiguous().numpy()).cast("B")


def plan_parts(nbytes: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each part of an object of ``nbytes``."""
    return [(start, min(start + part_size, nbytes)) for start in range(0, nbytes, part_size)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the raw baselines -------------------------------------------------------------------


async def _s3_put_all(
    fs: Any, items: list[tuple[str, memoryview]], part_size: int, workers: int
) -> None:
    """Every object as one PUT, or as a multipart upload with concurrent parts; at most
    ``workers`` requests in flight over all of them."""
    slots = asyncio.Semaphore(workers)

    async def call(method: str, **kwargs: Any) -> Any:
        async with slots:
            return await fs._call_s3(method, **kwargs)

    async def put(path: str, view: memoryview) -> None:
        bucket, key, _ = fs.split_path(path)
        if view.nbytes <= part_size:
            await call("put_object", Bucket=bucket, Key=key, Body=bytes(view))
            return
        upload = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        upload_id = upload["UploadId"]

        async def part(number: int, start: int, end: int) -> dict[str, Any]:
            response = await call(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=bytes(view[start:end]),
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        parts = await asyncio.gather(
            *(part(n, a, b) for n, (a, b) in enumerate(plan_parts(view.nbytes, part_size), 1))
        )
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": list(parts)},
        )

    await asyncio.gather(*(put(path, view) for path, view in items))


def _raw_put_get(
    fs: Any, root: str, tensors: dict[str, torch.Tensor], part_size: int, workers: int
) -> tuple[float, float]:
    items = [(f"{root}/{k}", _bytes_of(t)) for k, t in tensors.items()]
    is_s3 = "s3" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    is_local = isinstance(fs, LocalFileSystem)
    if is_local:
        fs.makedirs(root, exist_ok=True)

    def put() -> None:
        if is_s3:
            fsspec.asyn.sync(fs.loop, _s3_put_all, fs, items, part_size, workers)
            return
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda item: fs.pipe_file(item[0], item[1]), items))

    ranges = [
        (path, start, end)
        for path, view in items
        for start, end in ([(0, view.nbytes)] if is_local else plan_parts(view.nbytes, part_size))
    ]

    def get() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda r: fs.cat_file(r[0], start=r[1], end=r[2]), ranges))

    return _timed(put), _timed(get)


def _run(args: argparse.Namespace, base: str, options: dict[str, Any]) -> None:
    run = f"{base.rstrip('/')}/{uuid.uuid4().hex[:8]}"
    config = CheckpointConfig(part_size=args.part_mib * MiB, max_in_flight=args.workers)
    tensors = _state(args.mib, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    mb = nbytes / 1e6

    sink = {k: torch.empty_like(t) for k, t in tensors.items()}
    t_memcpy = _timed(lambda: [sink[k].copy_(t) for k, t in tensors.items()])
    # the filesystem cloudckpt would use (client settings, connection pool), used raw
    raw = open_checkpoint(f"{run}/raw", storage_options=options, config=config)
    t_put, t_get = _raw_put_get(raw.fs, raw.root, tensors, config.part_size, args.workers)
    state = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}
    ckpt = f"{run}/ckpt"
    t_save = _timed(lambda: cloudckpt.save(state, ckpt, storage_options=options, config=config))
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t)) for k, t in tensors.items()
    }
    t_load = _timed(lambda: cloudckpt.load(request, ckpt, storage_options=options, config=config))

    print(
        f"state: {args.tensors} tensors, {mb:.0f} MB at {run}; part size {args.part_mib} MiB, "
        f"{args.workers} requests in flight"
    )
    for name, secs in [
        ("memcpy", t_memcpy),
        ("raw put", t_put),
        ("cloudckpt save", t_save),
        ("raw get", t_get),
        ("cloudckpt load", t_load),
    ]:
        print(f"{name:>15}: {secs:7.3f} s  {mb / secs:9.1f} MB/s")
    print(f"save / raw put throughput ratio: {t_put / t_save:.2f}")
    print(f"load / raw get throughput ratio: {t_get / t_load:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--uri", default=None, help="base URI (default: a temporary directory)")
    where.add_argument(
        "--server",
        choices=["seaweedfs"],
        default=None,
        help="start this S3 server on a loopback port for the run (needs the dev extra)",
    )
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--workers", type=int, default=16, help="requests in flight")
    parser.add_argument(
        "--part-mib",
        type=int,
        default=CheckpointConfig().part_size // MiB,
        help="multipart part size and ranged-read size in MiB (S3: at least 5)",
    )
    args = parser.parse_args()
    if args.server == "seaweedfs":
        with seaweedfs_bucket() as (base, options, _):
            _run(args, base, options)
    else:
        _run(args, args.uri or tempfile.mkdtemp(prefix="cloudckpt-bench-"), {})


if __name__ == "__main__":
    main()
