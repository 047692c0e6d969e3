"""Large-object transfer clients against one S3 server, interleaved A/B rounds.

Which client should move a checkpoint's large objects? Each round
puts one object of ``--mib`` MiB per process and reads it back into a preallocated
buffer, through each client in turn (A B C D A B C D ...), from ``--procs`` processes
at once (started together at a barrier):

  cloudckpt   cloudckpt's S3 transport today: ``CheckpointStorage.write_many`` (a
              multipart upload through s3fs's aiobotocore client, a CRC-32C per part and
              per block, each request retried by cloudckpt's policy) and ``read_into``
              (concurrent ranged GETs straight into the buffer; no manifest, so no
              block check, as for the others);
  boto        the same client with nothing on top: concurrent ``upload_part`` calls on
              its event loop (a CRC-32C header per part) and ranged GETs read into the
              buffer (the "raw" limit of benchmarks/bench_save_load.py);
  crt         the AWS Common Runtime's S3 client (``awscrt``): one PUT_OBJECT meta
              request that it cuts into parts itself, with a CRC-32C per part computed
              in C, and one GET_OBJECT meta request whose ranged parts are copied into
              the buffer as they arrive (plus the block CRCs cloudckpt's manifest
              needs, computed alongside in a thread);
  obstore     obstore (Rust, the object_store crate): ``put`` in multipart chunks (no
              CRC-32C: object_store offers only SHA-256 / CRC64NVME upload checksums;
              block CRCs as for crt) and ``get_range`` per part from threads, copied
              into the buffer.

Throughput is the bytes of all processes over the span from the first start to the
last end. CPU is user+system seconds per GB moved: of the client processes, and of the
server (``weed``, SeaweedFS only) over the same operation. ``--profile`` samples every
thread of a single process during the last round (benchmarks/_sampler.py). Needs the
optional clients (``pip install awscrt obstore``); missing ones are skipped. Note that
botocore signs with the CRT when ``awscrt`` is importable (its ``HAS_CRT``), so the
cloudckpt and boto rows then use CRT signing (no measurable difference here).

    .venv/bin/python benchmarks/bench_transport.py --mib 256 --procs 4 [--profile]
    .venv/bin/python benchmarks/bench_transport.py --uri s3://bucket/prefix  # env settings

On the 2-core development machine (shared, figures provisional) SeaweedFS itself
spends 9-15 CPU-seconds per GB on PUTs against 1-3 for any client, so every client
saves at the server's pace; on GETs the current path used the least client CPU
(about 0.45 s/GB against about 1.1 for crt and obstore). Neither native client won,
so cloudckpt keeps its s3fs/aiobotocore transport; rerun this on a real node and store
before revisiting. Against the benchmarks' server with a 4 GiB Go heap (at the tests'
512 MiB the server spends most of its CPU collecting garbage): PUTs
169-186 MB/s for every client at 9.7-10.2 server CPU s per GB; GETs 1,209 MB/s for
cloudckpt, 844-884 for crt and obstore, which used twice the client CPU: the same choice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec.asyn
from _sampler import Sampler  # benchmarks/_sampler.py
from _seaweedfs import seaweedfs_bucket  # benchmarks/_seaweedfs.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cloudckpt.config import CheckpointConfig
from cloudckpt.storage import open_checkpoint
from cloudckpt.storage.blocks import block_size_for, part_checksum
from cloudckpt.storage.buffers import BufferReader, crc32c, crc32c_base64, plan_parts

MiB = 2**20
Put = Callable[[str, memoryview], None]
Get = Callable[[str, memoryview], None]


def _block_crcs(view: memoryview, part_size: int) -> None:
    """What cloudckpt computes for the manifest besides the transfer: every part's CRC
    and block CRCs (the crc32c package releases the GIL for large buffers)."""
    block = block_size_for(part_size)
    for start, end in plan_parts(view.nbytes, part_size):
        part_checksum(view[start:end], block)


# -- clients -------------------------------------------------------------------------------


def _split(base: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, "prefix/")."""
    bucket, _, prefix = base.removeprefix("s3://").partition("/")
    return bucket, (prefix.strip("/") + "/") if prefix.strip("/") else ""


def _endpoint(options: dict[str, Any]) -> str | None:
    """The endpoint as cloudckpt finds it: storage options, then the environment."""
    return (
        options.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def _region(options: dict[str, Any]) -> str:
    return str(
        options.get("client_kwargs", {}).get("region_name")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
        or "us-east-1"
    )


def cloudckpt_client(
    base: str, options: dict[str, Any], part: int, workers: int
) -> tuple[Put, Get]:
    config = CheckpointConfig(part_size=part, max_in_flight=workers)
    storage = open_checkpoint(base, storage_options=options, config=config)

    def put(key: str, view: memoryview) -> None:
        storage.write_many([(key, view)])

    def get(key: str, out: memoryview) -> None:
        storage.read_into(key, out)

    return put, get


def boto_client(base: str, options: dict[str, Any], part: int, workers: int) -> tuple[Put, Get]:
    storage = open_checkpoint(base, storage_options=options)
    fs, root = storage.fs, storage.root

    async def put_all(key: str, view: memoryview) -> None:
        bucket, path, _ = fs.split_path(f"{root}/{key}")
        slots = asyncio.Semaphore(workers)
        upload = await fs._call_s3(
            "create_multipart_upload", Bucket=bucket, Key=path, ChecksumAlgorithm="CRC32C"
        )

        async def one(number: int, start: int, end: int) -> dict[str, Any]:
            checksum = crc32c_base64(crc32c(view[start:end]))
            async with slots:
                response = await fs._call_s3(
                    "upload_part",
                    Bucket=bucket,
                    Key=path,
                    UploadId=upload["UploadId"],
                    PartNumber=number,
                    Body=BufferReader(view[start:end]),
                    ChecksumCRC32C=checksum,
                )
            return {"PartNumber": number, "ETag": response["ETag"], "ChecksumCRC32C": checksum}

        parts = await asyncio.gather(
            *(one(n, a, b) for n, (a, b) in enumerate(plan_parts(view.nbytes, part), 1))
        )
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=path,
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": list(parts)},
        )

    async def get_all(key: str, out: memoryview) -> None:
        bucket, path, _ = fs.split_path(f"{root}/{key}")
        slots = asyncio.Semaphore(workers)

        async def one(start: int, end: int) -> None:
            async with slots:
                response = await fs._call_s3(
                    "get_object", Bucket=bucket, Key=path, Range=f"bytes={start}-{end - 1}"
                )
                body, got = response["Body"], start
                while got < end and (n := await body.readinto(out[got:end])):
                    got += n
                body.close()

        await asyncio.gather(*(one(a, b) for a, b in plan_parts(out.nbytes, part)))

    return (
        lambda key, view: fsspec.asyn.sync(fs.loop, put_all, key, view),
        lambda key, out: fsspec.asyn.sync(fs.loop, get_all, key, out),
    )


def crt_client(base: str, options: dict[str, Any], part: int, workers: int) -> tuple[Put, Get]:
    from awscrt import auth, http, s3  # noqa: PLC0415

    bucket, prefix = _split(base)
    endpoint, region = _endpoint(options), _region(options)
    if endpoint:  # path-style, as s3fs addresses a custom endpoint
        host, where = endpoint.split("//", 1)[1].rstrip("/"), f"/{bucket}/{prefix}"
    else:
        host, where = f"{bucket}.s3.{region}.amazonaws.com", f"/{prefix}"
    credentials = (
        auth.AwsCredentialsProvider.new_static(options["key"], options["secret"])
        if "key" in options
        else auth.AwsCredentialsProvider.new_default_chain()
    )
    client = s3.S3Client(
        region=region,
        signing_config=s3.create_default_s3_signing_config(
            region=region, credential_provider=credentials
        ),
        tls_mode=s3.S3RequestTlsMode.DISABLED
        if (endpoint or "").startswith("http:")
        else s3.S3RequestTlsMode.ENABLED,
        part_size=part,
        multipart_upload_threshold=part,
        max_active_connections_override=workers,
        memory_limit=max(2 * workers * part, 1024 * MiB),
    )
    crc = s3.S3ChecksumConfig(
        algorithm=s3.S3ChecksumAlgorithm.CRC32C, location=s3.S3ChecksumLocation.HEADER
    )

    def run(request: Any, **kwargs: Any) -> None:
        failure: list[Any] = []

        def on_done(error: Any = None, error_body: Any = None, **_: Any) -> None:
            if error is not None:
                failure.append((error, error_body))

        client.make_request(request=request, on_done=on_done, **kwargs).finished_future.result()
        if failure:
            raise OSError(f"CRT request failed: {failure[0]}")

    def put(key: str, view: memoryview) -> None:
        headers = http.HttpHeaders([("Host", host), ("Content-Length", str(view.nbytes))])
        request = http.HttpRequest("PUT", where + key, headers, BufferReader(view))
        crcs = threading.Thread(target=_block_crcs, args=(view, part))
        crcs.start()
        run(request, type=s3.S3RequestType.PUT_OBJECT, checksum_config=crc)
        crcs.join()

    def get(key: str, out: memoryview) -> None:
        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            out[offset : offset + len(chunk)] = chunk

        headers = http.HttpHeaders([("Host", host)])
        request = http.HttpRequest("GET", where + key, headers)
        run(request, type=s3.S3RequestType.GET_OBJECT, on_body=on_body)

    return put, get


def obstore_client(base: str, options: dict[str, Any], part: int, workers: int) -> tuple[Put, Get]:
    import obstore  # noqa: PLC0415
    from obstore.store import S3Store  # noqa: PLC0415

    bucket, prefix = _split(base)
    endpoint = _endpoint(options)
    keys = {"access_key_id": options.get("key"), "secret_access_key": options.get("secret")}
    store = S3Store(  # the rest from the environment (AWS_*), as S3Store does by default
        bucket,
        prefix=prefix or None,
        region=_region(options),
        client_options={"allow_http": (endpoint or "").startswith("http:")},
        **({"endpoint": endpoint} if endpoint else {}),
        **(keys if "key" in options else {}),
    )

    def put(key: str, view: memoryview) -> None:
        crcs = threading.Thread(target=_block_crcs, args=(view, part))
        crcs.start()
        obstore.put(store, key, view, chunk_size=part, max_concurrency=workers)
        crcs.join()

    def get(key: str, out: memoryview) -> None:
        ranges = plan_parts(out.nbytes, part)
        with ThreadPoolExecutor(min(workers, len(ranges))) as pool:

            def one(r: tuple[int, int]) -> None:
                out[r[0] : r[1]] = memoryview(obstore.get_range(store, key, start=r[0], end=r[1]))

            list(pool.map(one, ranges))

    return put, get


CLIENTS = {
    "cloudckpt": cloudckpt_client,
    "boto": boto_client,
    "crt": crt_client,
    "obstore": obstore_client,
}


def available(names: list[str]) -> list[str]:
    found = []
    for name in names:
        module = {"crt": "awscrt", "obstore": "obstore"}.get(name)
        try:
            if module:
                __import__(module)
            found.append(name)
        except ImportError:
            print(f"skipping {name}: {module} is not installed")
    return found


# -- one process ---------------------------------------------------------------------------


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _server_cpu(pid: int) -> float:
    """User+system CPU seconds of the server process so far (0 when unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_pid() -> int:
    """The ``weed`` process this one started (SeaweedFS), or 0."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text.split(" (", 1)[1].rsplit(") ", 1)
        if name == "weed" and int(rest.split()[1]) == os.getpid():
            return int(stat.parent.name)
    return 0


def worker(
    rank: int,
    args: argparse.Namespace,
    base: str,
    options: dict[str, Any],
    barrier: Any,
    results: Any,
    server: int,
) -> None:
    import numpy as np  # noqa: PLC0415

    nbytes = args.mib * MiB
    data = memoryview(np.random.default_rng(rank).bytes(nbytes))
    out = memoryview(bytearray(nbytes))
    part = args.part_mib * MiB
    clients = {name: CLIENTS[name](base, options, part, args.workers) for name in args.clients}
    for rnd in range(args.rounds):
        for name, (put, get) in clients.items():
            key = f"r{rnd}/{name}/p{rank}-{uuid.uuid4().hex[:6]}"
            for op, fn, view in (("put", put, data), ("get", get, out)):
                barrier.wait()
                cpu, start, server_cpu = _cpu(), time.time(), _server_cpu(server)
                if args.profile and rnd == args.rounds - 1:
                    with Sampler(0.002) as sampler:
                        fn(key, view)
                    print(f"== profile of {name} {op} (rank {rank}) ==\n{sampler.report(10)}")
                else:
                    fn(key, view)
                end, cpu = time.time(), _cpu() - cpu
                barrier.wait()
                server_cpu = _server_cpu(server) - server_cpu if rank == 0 else 0.0
                results.put((rnd, name, op, rank, start, end, cpu, server_cpu))
            if out != data:
                raise AssertionError(f"{name}: the bytes read back differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--uri",
        default=None,
        help="s3://bucket/prefix; endpoint and credentials from the environment",
    )
    where.add_argument("--server", choices=["seaweedfs"], default="seaweedfs")
    parser.add_argument("--mib", type=int, default=256, help="object size per process")
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=16, help="requests in flight per process")
    parser.add_argument("--part-mib", type=int, default=CheckpointConfig().part_size // MiB)
    parser.add_argument("--clients", default="cloudckpt,boto,crt,obstore")
    parser.add_argument(
        "--profile", action="store_true", help="sample every thread during the last round"
    )
    args = parser.parse_args()
    args.clients = available(args.clients.split(","))
    with _store(args.uri) as (base, options):
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(args.procs), ctx.Queue()
        server = _server_pid()
        procs = [
            ctx.Process(target=worker, args=(r, args, base, options, barrier, results, server))
            for r in range(args.procs)
        ]
        for p in procs:
            p.start()
        rows: list[tuple[Any, ...]] = []
        expected = args.rounds * len(args.clients) * 2 * args.procs
        while len(rows) < expected:
            if not any(p.is_alive() for p in procs) and results.empty():
                raise SystemExit("a worker died")
            try:
                rows.append(results.get(timeout=5))
            except Exception:  # noqa: BLE001 - queue.Empty: check the workers again
                continue
        for p in procs:
            p.join()
    _report(args, rows)


@contextlib.contextmanager
def _store(uri: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``--uri`` as given (settings from the environment), else a SeaweedFS bucket."""
    if uri is not None:
        yield f"{uri.rstrip('/')}/bench-{uuid.uuid4().hex[:8]}", {}
        return
    with seaweedfs_bucket() as (base, options, _):
        yield base, options


def _report(args: argparse.Namespace, rows: list[tuple[Any, ...]]) -> None:
    total_mb = args.procs * args.mib * MiB / 1e6
    print(
        f"{args.procs} process(es) x {args.mib} MiB, part {args.part_mib} MiB, "
        f"{args.workers} in flight, {args.rounds} interleaved rounds"
    )
    print(f"{'client':>10} {'op':>4}  MB/s per round (median)   CPU s/GB client / server")
    for name in args.clients:
        for op in ("put", "get"):
            rates, cpus, server = [], [], []
            for rnd in range(args.rounds):
                sel = [r for r in rows if r[0] == rnd and r[1] == name and r[2] == op]
                rates.append(total_mb / (max(r[5] for r in sel) - min(r[4] for r in sel)))
                cpus.append(sum(r[6] for r in sel) / (total_mb / 1e3))
                server.append(sum(r[7] for r in sel) / (total_mb / 1e3))
            per_round = " ".join(f"{x:7.0f}" for x in rates)
            print(
                f"{name:>10} {op:>4}  {per_round}  ({statistics.median(rates):7.0f})"
                f"   {statistics.median(cpus):6.2f} / {statistics.median(server):5.2f}"
            )


if __name__ == "__main__":
    main()
