"""What block CRCs cost: save time, manifest size, bytes read by a resharded load, CRC
throughput, each against its baseline measured in the same run.

  CRC throughput   CRC-32C of whole buffers, block CRCs (1 MiB blocks, combined into
                   the object's CRC) and memcpy of the same bytes, in GB/s;
  save             cloudckpt.save with block CRCs vs with the object CRC only (the
                   block functions swapped for whole-object ones in this process), zarr
                   and torch_dist, alternating, median of ``--repeat``;
  manifest         bytes per GiB of data that block CRCs add to manifest.json;
  bytes read       a TP2-saved checkpoint loaded as TP4 (each quarter in turn, as four
                   ranks would), counting the bytes every GET returned, with block
                   CRCs vs a version-1 manifest of the same checkpoint (ranges checked
                   against sizes only), for tensors whose quarters fall on block
                   boundaries ("aligned") and tensors whose quarters do not.

Single process. SeaweedFS (started on a loopback port for the run, as the tests do) or
a local temporary directory:

    .venv/bin/python benchmarks/bench_block_crc.py --server seaweedfs --mib 128
    .venv/bin/python benchmarks/bench_block_crc.py --mib 128          # local disk
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _seaweedfs import seaweedfs_bucket  # benchmarks/_seaweedfs.py

import cloudckpt
from cloudckpt import ShardedTensor
from cloudckpt.config import CheckpointConfig
from cloudckpt.manifest import MANIFEST_FNAME, Manifest
from cloudckpt.storage import blocks, crc32c, open_checkpoint, reads
from cloudckpt.storage import checkpoint as checkpoint_mod
from cloudckpt.storage import pool as pool_mod

MiB = 2**20
GiB = 2**30


# -- CRC throughput ------------------------------------------------------------------------


def _best(fn: Callable[[], object], repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def crc_throughput(mib: int) -> None:
    data = torch.randint(0, 255, (mib * MiB,), dtype=torch.uint8)
    view = memoryview(data.numpy()).cast("B")
    sink = torch.empty_like(data)
    t_copy = _best(lambda: sink.copy_(data))
    t_whole = _best(lambda: crc32c(view))
    t_blocks = _best(lambda: blocks.object_checksum(view))
    gb = mib * MiB / 1e9
    print(f"\nCRC-32C over {mib} MiB in memory (best of 5):")
    for name, secs in [("memcpy", t_copy), ("object CRC", t_whole), ("block CRCs", t_blocks)]:
        print(f"{name:>12}: {secs * 1e3:8.2f} ms  {gb / secs:7.2f} GB/s")
    print(f"block CRCs vs object CRC: {100 * (t_blocks / t_whole - 1):+.1f} % CPU time")


# -- save with and without block CRCs --------------------------------------------------


def _object_crc_only(view: Any, block_size: int = blocks.BLOCK_SIZE) -> tuple[int, None]:
    return crc32c(view), None


def _part_crc_only(part: Any, block_size: int) -> blocks.PartChecksum:
    return blocks.PartChecksum(crc32c(part), memoryview(part).nbytes, ())


def _join_crc_only(parts: Any, block_size: int) -> tuple[int, None]:
    return blocks.join_parts([dataclasses.replace(p, blocks=()) for p in parts], 2**62)[0], None


@contextlib.contextmanager
def object_crc_only() -> Iterator[None]:
    """This process writes as before block CRCs: one CRC per object (and per part)."""
    patches: list[tuple[Any, str, Any]] = [
        (checkpoint_mod, "object_checksum", _object_crc_only),
        (pool_mod, "join_parts", _join_crc_only),
    ]
    with contextlib.suppress(ImportError):
        from cloudckpt.storage import s3  # noqa: PLC0415 - needs s3fs

        patches.append((s3, "part_checksum", _part_crc_only))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def _state(mib: int, count: int) -> dict[str, ShardedTensor]:
    rows = max(mib * MiB // 4 // count // 1000, 4)
    gen = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", torch.randn(rows, 1000, generator=gen)
        )
        for i in range(count)
    }


def save_overhead(base: str, options: dict[str, Any], args: argparse.Namespace) -> None:
    config = CheckpointConfig(part_size=args.part_mib * MiB, max_in_flight=args.workers)
    state = _state(args.mib, args.tensors)
    nbytes = sum(sh.data.numel() * 4 for sh in state.values() if sh.data is not None)
    print(f"\nsave of {args.tensors} tensors, {nbytes / 1e6:.0f} MB, part size {args.part_mib} "
          f"MiB, median of {args.repeat} alternating runs:")  # fmt: skip
    for backend in ("zarr", "torch_dist"):
        times: dict[str, list[float]] = {"object CRC": [], "block CRCs": []}
        manifest = b""
        for i in range(args.repeat):
            for mode, measured in times.items():
                uri = f"{base}/save-{backend}-{mode[:5]}-{i}"
                with object_crc_only() if mode == "object CRC" else contextlib.nullcontext():
                    start = time.perf_counter()
                    cloudckpt.save(state, uri, storage_options=options, config=config,
                                   sharded_strategy=(backend, 1))  # fmt: skip
                    measured.append(time.perf_counter() - start)
                if mode == "block CRCs":
                    manifest = open_checkpoint(uri, storage_options=options).read(MANIFEST_FNAME)
        whole, block = (statistics.median(times[m]) for m in ("object CRC", "block CRCs"))
        v1 = dataclasses.replace(Manifest.from_json(manifest), version=1).to_json()
        growth = (len(manifest) - len(v1)) / (nbytes / GiB)
        print(f"  {backend:>10}: object CRC {whole:6.3f} s, block CRCs {block:6.3f} s "
              f"({100 * (block / whole - 1):+.1f} %); manifest {len(v1)} -> {len(manifest)} "
              f"bytes, +{growth:.0f} bytes per GiB")  # fmt: skip


# -- bytes read by a resharded load ----------------------------------------------------------


class ReadCounter:
    """Bytes returned by every GET of this process (ranged or whole)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._read = reads.StorageReads._read
        self._into = reads.StorageReads._read_range_into

    def __enter__(self) -> ReadCounter:
        counter, read, into = self, self._read, self._into

        def counted_read(self: Any, relpath: str, *args: Any, **kwargs: Any) -> bytes:
            data = read(self, relpath, *args, **kwargs)
            counter.nbytes += len(data)
            return data

        def counted_into(self: Any, relpath: str, out: memoryview, start: int, *rest: Any) -> None:
            into(self, relpath, out, start, *rest)
            counter.nbytes += out.nbytes

        reads.StorageReads._read = counted_read  # type: ignore[method-assign]
        reads.StorageReads._read_range_into = counted_into  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        reads.StorageReads._read = self._read  # type: ignore[method-assign]
        reads.StorageReads._read_range_into = self._into  # type: ignore[method-assign]


def _tp(shapes: dict[str, tuple[int, int]], rank: int, tp: int, empty: bool) -> dict[str, Any]:
    state = {}
    for key, shape in shapes.items():
        full = torch.randn(*shape, generator=torch.Generator().manual_seed(len(key)))
        local = full.chunk(tp)[rank].clone()
        state[f"{key}.{rank}"] = ShardedTensor.from_rank_offsets(
            key, torch.empty_like(local) if empty else local, (0, rank, tp)
        )
    return state


def resharded_reads(base: str, options: dict[str, Any], args: argparse.Namespace) -> None:
    config = CheckpointConfig(part_size=args.part_mib * MiB, max_in_flight=args.workers)
    per = args.mib * MiB // args.tensors
    aligned = {f"a{i}": (per // 4096, 1024) for i in range(args.tensors // 2)}  # 4 KiB rows
    unaligned = {f"u{i}": (per // 4000 // 4 * 4, 1000) for i in range(args.tensors // 2)}
    print(f"\nbytes read: TP2 saved, TP4 loaded (4 quarters), {args.tensors} tensors of "
          f"{per / 1e6:.1f} MB; every GET's bytes counted:")  # fmt: skip
    for backend in ("zarr", "torch_dist"):
        for name, shapes in (("aligned", aligned), ("unaligned", unaligned)):
            uri = f"{base}/tp-{backend}-{name}"
            both = {**_tp(shapes, 0, 2, False), **_tp(shapes, 1, 2, False)}  # one writer
            cloudckpt.save(both, uri, storage_options=options, config=config,
                           sharded_strategy=(backend, 1))  # fmt: skip
            storage = open_checkpoint(uri, storage_options=options)
            v2 = storage.read(MANIFEST_FNAME)
            counts = []
            for manifest in (v2, dataclasses.replace(Manifest.from_json(v2), version=1).to_json()):
                storage.write(MANIFEST_FNAME, manifest)
                with ReadCounter() as counter:
                    for rank in range(4):
                        cloudckpt.load(_tp(shapes, rank, 4, True), uri, storage_options=options,
                                       config=config, validate_access_integrity=False)  # fmt: skip
                counts.append(counter.nbytes)
            data = sum(r * c * 4 for r, c in shapes.values())
            print(f"  {backend:>10} {name:>9}: {counts[0] / 1e6:8.2f} MB with block CRCs, "
                  f"{counts[1] / 1e6:8.2f} MB version 1 ({data / 1e6:.2f} MB of tensors): "
                  f"ratio {counts[0] / counts[1]:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--server", choices=["seaweedfs"], default=None)
    parser.add_argument("--mib", type=int, default=128, help="state size in MiB")
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--workers", type=int, default=16, help="requests in flight")
    parser.add_argument("--part-mib", type=int, default=8, help="multipart part size, MiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    crc_throughput(args.mib)
    with contextlib.ExitStack() as stack:
        if args.server == "seaweedfs":
            base, options, _ = stack.enter_context(seaweedfs_bucket())
        else:
            base, options = stack.enter_context(tempfile.TemporaryDirectory()), {}
        run = f"{base}/{uuid.uuid4().hex[:8]}"
        save_overhead(run, options, args)
        resharded_reads(run, options, args)


if __name__ == "__main__":
    main()
