"""Where should an async save upload: a thread of the training process, or a persistent
worker process? Both are measured here.

Both modes upload the same staged bytes with the same cloudckpt storage
(``CheckpointStorage.write_many``) while the training process keeps stepping:

  thread   the staged buffers are uploaded by a thread of the training process (what
           ``AsyncCallsQueue`` does): no copy, but the upload's Python (event loop,
           signing, CRC-32C calls) shares the GIL with the training loop;
  process  the staged bytes are copied into shared memory and a persistent worker
           process (started once, as Megatron-Core's ``PersistentAsyncCaller``) uploads
           them: its own GIL, but one more copy of the state in the blocking part.

A "training step" is Python-heavy on purpose (hundreds of small tensor ops, the
dispatch overhead a real step's Python pays, plus one matmul), because that is what
the GIL taxes. Printed per mode: blocking time (staging), upload time, and the
training loop's step time while the upload runs relative to an idle baseline measured
in the same run (1.00 = the upload costs training nothing).

    .venv/bin/python benchmarks/bench_async_worker.py [--mib 256] [--uri URI]
    .venv/bin/python benchmarks/bench_async_worker.py --server seaweedfs --mib 256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing as mp
import queue
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch
from _seaweedfs import seaweedfs_bucket  # benchmarks/_seaweedfs.py

from cloudckpt.storage import CheckpointStorage

OBJECT_MIB = 16


def _step(small: list[torch.Tensor], big: torch.Tensor) -> None:
    acc = small[0]
    for t in small:  # dispatch-bound: the interpreter holds the GIL most of the time
        acc = acc * 0.5 + t
    torch.mm(big, big)


def _steps_while(
    busy: Callable[[], bool], small: list[torch.Tensor], big: torch.Tensor
) -> list[float]:
    times = []
    while busy():
        started = time.perf_counter()
        _step(small, big)
        times.append(time.perf_counter() - started)
    return times


def _baseline(small: list[torch.Tensor], big: torch.Tensor, seconds: float) -> float:
    end = time.perf_counter() + seconds
    return statistics.median(_steps_while(lambda: time.perf_counter() < end, small, big))


def _objects(mib: int) -> list[tuple[str, bytes]]:
    count = max(1, mib // OBJECT_MIB)
    return [(f"obj_{i}", torch.randn(OBJECT_MIB * 2**18).numpy().tobytes()) for i in range(count)]


def _worker(inbox: Any, outbox: Any, uri: str, options: dict[str, Any]) -> None:
    """The persistent worker: uploads what each message names, from shared memory."""
    while (job := inbox.get()) is not None:
        prefix, name, layout = job
        block = shared_memory.SharedMemory(name=name)
        storage = CheckpointStorage(f"{uri}/{prefix}", storage_options=options)
        view = block.buf
        storage.write_many([(path, view[start:end]) for path, start, end in layout])
        del view, storage
        gc.collect()  # the S3 client's last references to the views
        with contextlib.suppress(BufferError):  # a view still referenced: it goes with us
            block.close()
        outbox.put(prefix)


def _thread_mode(
    storage_of: Callable[[str], CheckpointStorage], objects: list[tuple[str, bytes]]
) -> tuple[float, Callable[[], bool], Callable[[], None]]:
    started = time.perf_counter()
    staged = [(path, memoryview(data)) for path, data in objects]  # staging: handed over
    blocking = time.perf_counter() - started
    storage = storage_of(f"thread-{uuid.uuid4().hex[:6]}")
    thread = threading.Thread(target=storage.write_many, args=(staged,))
    thread.start()
    return blocking, thread.is_alive, thread.join


def _process_mode(
    objects: list[tuple[str, bytes]], inbox: Any, outbox: Any, worker: Any
) -> tuple[float, Callable[[], bool], Callable[[], None], shared_memory.SharedMemory]:
    started = time.perf_counter()
    total = sum(len(data) for _, data in objects)
    block = shared_memory.SharedMemory(create=True, size=total)
    layout, offset = [], 0
    for path, data in objects:  # staging: one more copy, into shared memory
        block.buf[offset : offset + len(data)] = data
        layout.append((path, offset, offset + len(data)))
        offset += len(data)
    inbox.put((f"process-{uuid.uuid4().hex[:6]}", block.name, layout))
    blocking = time.perf_counter() - started
    done = threading.Event()

    def wait() -> None:
        while True:  # a worker that died answers nothing: fail instead of waiting forever
            try:
                outbox.get(timeout=1.0)
                break
            except queue.Empty as empty:
                if not worker.is_alive():
                    died = f"the worker process died (exit {worker.exitcode})"
                    raise RuntimeError(died) from empty
        done.set()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    return blocking, lambda: not done.is_set(), waiter.join, block


def _run(args: argparse.Namespace, uri: str, options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    small = [torch.randn(64) for _ in range(400)]
    big = torch.randn(256, 256)
    objects = _objects(args.mib)
    total = sum(len(d) for _, d in objects)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=_worker, args=(inbox, outbox, uri, options), daemon=True)
    worker.start()
    *_, join, block = _process_mode([("warm-up", b"0")], inbox, outbox, worker)
    join()  # the worker's imports and first connection: not timed
    block.close()
    block.unlink()

    def storage_of(prefix: str) -> CheckpointStorage:
        return CheckpointStorage(f"{uri}/{prefix}", storage_options=options)

    rows: dict[str, list[tuple[float, float, float]]] = {"thread": [], "process": []}
    for _ in range(args.rounds):
        idle = _baseline(small, big, 2.0)
        for mode in ("thread", "process"):
            block = None
            started = time.perf_counter()
            if mode == "thread":
                blocking, busy, join = _thread_mode(storage_of, objects)
            else:
                blocking, busy, join, block = _process_mode(objects, inbox, outbox, worker)
            steps = _steps_while(busy, small, big)
            join()
            upload = time.perf_counter() - started
            if block is not None:
                block.close()
                block.unlink()
            slowdown = statistics.median(steps) / idle if steps else float("nan")
            rows[mode].append((blocking, upload, slowdown))
    inbox.put(None)
    worker.join(30)
    where = uri.split("://", maxsplit=1)[0] if "://" in uri else "local disk"
    print(f"{total / 2**20:.0f} MiB in {len(objects)} objects to {where}, {args.rounds} round(s)")
    print(f"{'mode':8} {'blocking s':>11} {'upload s':>9} {'MB/s':>7} {'step time x idle':>17}")
    for mode, figures in rows.items():
        blocking, upload, slowdown = (statistics.median(col) for col in zip(*figures, strict=True))
        print(
            f"{mode:8} {blocking:11.3f} {upload:9.2f} {total / upload / 1e6:7.0f} {slowdown:17.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--uri", help="where to upload (default: a temporary local directory)")
    parser.add_argument("--server", choices=["seaweedfs"], help="start a local S3 server")
    args = parser.parse_args()
    if args.server:
        with seaweedfs_bucket() as (bucket_uri, options, _):
            _run(args, bucket_uri, options)
    elif args.uri:
        _run(args, args.uri, {})
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _run(args, tmp, {})


if __name__ == "__main__":
    main()
