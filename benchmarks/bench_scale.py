"""Many small tensors on many ranks: objects, requests and manifest size per save.

Each of ``--ranks`` processes (gloo, on this machine) holds ``--tensors`` tensors of
``--bytes`` bytes, each a one-shard ShardedTensor of its own key, saves them, then
loads them back into fresh tensors and checks every value. For every backend and
store it prints the objects stored, their bytes, the size of ``manifest.json``, the
save and load seconds, and on S3 the HTTP requests each issued by method (counted by
a pass-through proxy in front of the server, ``tests/faultproxy.py``, no faults).

    .venv/bin/python benchmarks/bench_scale.py                      # local disk + SeaweedFS
    .venv/bin/python benchmarks/bench_scale.py --ranks 8 --tensors 2000 --bytes 1024
    .venv/bin/python benchmarks/bench_scale.py --stores local --backends torch_dist

The S3 store is a SeaweedFS server started for the run (``tests/servers.py``; needs the
dev extra). Baseline in the same run: the number of tensors (one object per tensor is
zarr's layout, one object per rank is torch_dist's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from _seaweedfs import seaweedfs_bucket  # benchmarks/_seaweedfs.py

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.launch import RankPool


@dataclass(frozen=True)
class Figures:
    """One backend on one store."""

    store: str
    backend: str
    objects: int
    stored_bytes: int
    manifest_bytes: int
    save_s: float
    load_s: float
    save_requests: dict[str, int]
    load_requests: dict[str, int]


def _state(rank: int, tensors: int, nbytes: int, fill: bool) -> dict[str, Any]:
    numel = max(nbytes // 4, 1)
    out: dict[str, Any] = {}
    for i in range(tensors):
        data = torch.full((numel,), float(rank * tensors + i)) if fill else torch.empty(numel)
        key = f"rank{rank}.layer{i}.weight"
        out[key] = ShardedTensor.from_rank_offsets(key, data, replica_id=0)
    return out


def _save(
    rank: int, world: int, uri: str, backend: str, tensors: int, nbytes: int, options: Any
) -> float:
    state = _state(rank, tensors, nbytes, fill=True)
    started = time.perf_counter()
    cloudckpt.save(state, uri, (backend, 1), storage_options=options)
    return time.perf_counter() - started


def _load(rank: int, world: int, uri: str, tensors: int, nbytes: int, options: Any) -> float:
    state = _state(rank, tensors, nbytes, fill=False)
    started = time.perf_counter()
    loaded = cloudckpt.load(state, uri, storage_options=options)
    elapsed = time.perf_counter() - started
    for i in range(tensors):
        value = loaded[f"rank{rank}.layer{i}.weight"]
        if not bool((value == float(rank * tensors + i)).all()):
            raise AssertionError(f"rank {rank}: tensor {i} loaded wrong values")
    return elapsed


def _listing(uri: str, options: Any) -> tuple[int, int, int]:
    """(objects, bytes, manifest.json bytes) stored under ``uri``."""
    fs, root = fsspec.core.url_to_fs(uri, **(options or {}))
    sizes = {path: info["size"] for path, info in fs.find(root, detail=True).items()}
    manifest = next(size for path, size in sizes.items() if path.endswith("/manifest.json"))
    return len(sizes), sum(sizes.values()), manifest


def _measure(
    pool: RankPool,
    store: str,
    base: str,
    backend: str,
    args: argparse.Namespace,
    options: Any,
    proxy: Any,
) -> Figures:
    uri = f"{base}/{backend}-{uuid.uuid4().hex[:6]}"
    if proxy is not None:
        proxy.reset_counters()
    save_s = max(pool.run(_save, uri, backend, args.tensors, args.bytes, options))
    save_requests = dict(proxy.stats().by_method) if proxy is not None else {}
    if proxy is not None:
        proxy.reset_counters()
    load_s = max(pool.run(_load, uri, args.tensors, args.bytes, options))
    load_requests = dict(proxy.stats().by_method) if proxy is not None else {}
    objects, stored, manifest = _listing(uri, options)
    return Figures(
        store, backend, objects, stored, manifest, save_s, load_s, save_requests, load_requests
    )


def _print(rows: list[Figures], args: argparse.Namespace) -> None:
    total = args.ranks * args.tensors
    print(
        f"\n{args.ranks} ranks x {args.tensors} tensors x {args.bytes} B "
        f"({total} tensors, {total * args.bytes / 1e6:.1f} MB of data)"
    )
    head = (
        f"{'store':<10}{'backend':<12}{'objects':>9}{'obj/tensor':>11}{'MB':>8}"
        f"{'manifest kB':>13}{'save s':>9}{'load s':>9}  requests (save | load)"
    )
    print(head)
    for r in rows:

        def fmt(counts: dict[str, int]) -> str:
            if not counts:
                return "-"
            return f"{sum(counts.values())} " + json.dumps(counts, sort_keys=True)

        print(
            f"{r.store:<10}{r.backend:<12}{r.objects:>9}{r.objects / total:>11.3f}"
            f"{r.stored_bytes / 1e6:>8.1f}{r.manifest_bytes / 1e3:>13.1f}{r.save_s:>9.1f}"
            f"{r.load_s:>9.1f}  {fmt(r.save_requests)} | {fmt(r.load_requests)}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=2000, help="per rank")
    parser.add_argument("--bytes", type=int, default=1024, help="per tensor")
    parser.add_argument("--backends", default="zarr,torch_dist")
    parser.add_argument("--stores", default="local,seaweedfs")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    backends = args.backends.split(",")
    stores = args.stores.split(",")
    rows: list[Figures] = []
    with RankPool(args.ranks, timeout_s=1800) as pool, contextlib.ExitStack() as stack:
        for store in stores:
            if store == "local":
                base = stack.enter_context(tempfile.TemporaryDirectory(prefix="scale-"))
                options, proxy = None, None
            elif store == "seaweedfs":
                base, options, proxy = stack.enter_context(seaweedfs_bucket(proxy=True))
            else:
                parser.error(f"unknown store {store!r} (local, seaweedfs)")
            for backend in backends:
                rows.append(_measure(pool, store, base, backend, args, options, proxy))
                print(rows[-1], flush=True)
    _print(rows, args)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
