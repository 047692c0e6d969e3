"""Save/load throughput of cloudckpt against baselines measured in the same run.

Baselines:
  memcpy     copying the same bytes in memory (an upper bound for any staging);
  raw put    writing the same tensors' bytes as objects straight through fsspec
             (``fs.pipe_file``, same concurrency), with no cloudckpt on top;
  raw get    reading them back the same way.

Prints throughput and the ratio cloudckpt / raw for save and load (1.0 = no
overhead). Single process, local directory by default:

    .venv/bin/python benchmarks/bench_save_load.py [--uri URI] [--mib 512] [--tensors 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import fsspec
import torch

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.zarr_format import tensor_bytes


def _state(mib: int, count: int) -> dict[str, torch.Tensor]:
    numel = mib * 2**20 // 4 // count
    rows = max(numel // 1024, 1)
    return {f"layer{i}.weight": torch.randn(rows, 1024) for i in range(count)}


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _raw_put_get(uri: str, tensors: dict[str, torch.Tensor], workers: int) -> tuple[float, float]:
    fs, root = fsspec.core.url_to_fs(uri)
    fs.makedirs(root, exist_ok=True)
    paths = {k: f"{root}/{k}" for k in tensors}

    def put() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda k: fs.pipe_file(paths[k], tensor_bytes(tensors[k])), tensors))

    def get() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda k: fs.cat_file(paths[k]), tensors))

    return _timed(put), _timed(get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", default=None, help="base URI (default: a temporary directory)")
    parser.add_argument("--mib", type=int, default=512, help="state size in MiB")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--workers", type=int, default=16, help="requests in flight")
    args = parser.parse_args()
    base = args.uri or tempfile.mkdtemp(prefix="cloudckpt-bench-")
    run = f"{base.rstrip('/')}/{uuid.uuid4().hex[:8]}"
    tensors = _state(args.mib, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    mb = nbytes / 1e6

    sink = {k: torch.empty_like(t) for k, t in tensors.items()}
    t_memcpy = _timed(lambda: [sink[k].copy_(t) for k, t in tensors.items()])
    t_put, t_get = _raw_put_get(f"{run}/raw", tensors, args.workers)
    state = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}
    t_save = _timed(lambda: cloudckpt.save(state, f"{run}/ckpt"))
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t)) for k, t in tensors.items()
    }
    t_load = _timed(lambda: cloudckpt.load(request, f"{run}/ckpt"))

    print(f"state: {args.tensors} tensors, {mb:.0f} MB at {run}")
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


if __name__ == "__main__":
    main()
