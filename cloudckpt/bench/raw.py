"""The raw limit: the checkpoint's bytes through the best plain client, no cloudckpt.

Each rank moves its share of the bytes (:func:`cloudckpt.bench.workload.rank_share`):

* object stores (S3): one object per rank, uploaded as a multipart upload whose parts
  go up concurrently and read back as concurrent ranged GETs, by boto3's transfer
  manager with :data:`S3_SETTINGS` (many threads, a connection pool to match), and by
  the AWS CRT's S3 client (s3transfer's CRT transfer manager, :class:`CrtTransfer`)
  when ``awscrt`` is importable (optional, never required);
* local directories: one file per rank written with ``write()`` and read back with
  ``readinto()`` into preallocated memory, and a ``torch.save`` / ``torch.load`` of the
  rank's tensors.

These baselines talk to the store on purpose without cloudckpt's storage layer: they
are what cloudckpt is measured against. Only ``cloudckpt bench`` uses this module.
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from cloudckpt.storage import MissingDependencyError


@dataclass(frozen=True)
class S3Setting:
    """One configuration of the raw S3 client."""

    name: str
    max_concurrency: int
    max_pool_connections: int
    part_size: int | None = None  # None: cloudckpt's
    crt: bool = False


_MiB = 2**20
S3_SETTINGS: tuple[S3Setting, ...] = (
    # cloudckpt's own part size and requests in flight
    S3Setting("boto3 x16", 16, 32),
    # smaller parts, four times the requests in flight: more concurrency per object
    S3Setting("boto3 x64 8MiB", 64, 128, part_size=8 * _MiB),
    # one large part at a time: the least work for a store bound by its own CPU (the
    # fastest PUT and GET against SeaweedFS on a 2-core host)
    S3Setting("boto3 x1 128MiB", 1, 4, part_size=128 * _MiB),
)
# the AWS CRT's S3 client (C, no GIL): its own connection and part scheduling
CRT_SETTING = S3Setting("crt 8MiB", 0, 0, part_size=8 * _MiB, crt=True)


def crt_available() -> bool:
    """Whether the CRT transfer client can be used (``awscrt`` importable)."""
    return importlib.util.find_spec("awscrt") is not None


def require_boto3() -> None:
    """Raise :class:`MissingDependencyError` unless boto3 is installed."""
    if importlib.util.find_spec("boto3") is None:
        raise MissingDependencyError(
            "cloudckpt bench on S3 needs boto3 for its raw baseline: "
            "pip install 'cloudckpt[bench]'",
            "bench",
        )


def s3_settings() -> tuple[S3Setting, ...]:
    """The settings measured: :data:`S3_SETTINGS`, plus the CRT one when available."""
    return S3_SETTINGS + ((CRT_SETTING,) if crt_available() else ())


def payload_of(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The tensors' bytes, concatenated (one copy, made before any timing)."""
    return b"".join(_bytes_of(t) for t in tensors.values())


def _bytes_of(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().view(-1).view(torch.uint8)
    return flat.numpy().tobytes()


# -- local directories ---------------------------------------------------------------------


def local_path(uri: str) -> Path:
    """The directory of a local URI (a path or ``file://``)."""
    return Path(urlparse(uri).path if uri.startswith("file://") else uri)


def write_file(path: Path, payload: bytes) -> None:
    """Write ``payload`` to a new file with plain ``write()`` calls."""
    with open(path, "wb", buffering=0) as out:
        view = memoryview(payload)
        while view:
            view = view[out.write(view) :]


def read_file(path: Path, into: bytearray) -> int:
    """Read a file into ``into`` (preallocated, its size) with ``readinto``."""
    done = 0
    view = memoryview(into)
    with open(path, "rb", buffering=0) as source:
        while done < len(into):
            got = source.readinto(view[done:])
            if not got:
                break
            done += got
    return done


def torch_save(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """``torch.save`` the rank's tensors to one file."""
    torch.save(dict(tensors), path)


def torch_load(path: Path) -> int:
    """``torch.load`` a file written by :func:`torch_save`; returns the bytes loaded."""
    loaded = torch.load(path, weights_only=True)
    return sum(t.numel() * t.element_size() for t in loaded.values())


# -- S3 ------------------------------------------------------------------------------------


def split_s3(uri: str) -> tuple[str, str]:
    """``(bucket, key prefix)`` of an ``s3://`` URI."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.strip("/")


def s3_client(storage_options: Mapping[str, Any], setting: S3Setting) -> Any:
    """A boto3 S3 client from cloudckpt's (s3fs-style) storage options; endpoint and
    credentials otherwise come from the environment, as for cloudckpt."""
    import boto3  # type: ignore[import-untyped]  # noqa: PLC0415
    from botocore.config import Config  # type: ignore[import-untyped]  # noqa: PLC0415

    client_kwargs = dict(storage_options.get("client_kwargs", {}))
    kwargs: dict[str, Any] = {
        "endpoint_url": storage_options.get("endpoint_url"),
        "aws_access_key_id": storage_options.get("key"),
        "aws_secret_access_key": storage_options.get("secret"),
        "region_name": client_kwargs.get("region_name"),
    }
    # path-style addressing: a bucket name in front of an IP address or localhost is no host
    # name (the CRT client resolves it and fails)
    s3: dict[str, Any] = {"addressing_style": "path"} if kwargs["endpoint_url"] else {}
    # the best setting for the limit, as cloudckpt's own requests: no SHA-256 of payloads
    # (botocore signs them over plain HTTP; over HTTPS it already sends UNSIGNED-PAYLOAD),
    # the body still checked by the store against its CRC
    s3["payload_signing_enabled"] = False
    config = Config(max_pool_connections=setting.max_pool_connections, s3=s3)
    return boto3.client("s3", config=config, **{k: v for k, v in kwargs.items() if v})


def transfer_config(setting: S3Setting, part_size: int) -> Any:
    """boto3's transfer manager settings: parts of the setting's size (else
    ``part_size``), ``max_concurrency`` requests in flight."""
    from boto3.s3.transfer import TransferConfig  # type: ignore[import-untyped]  # noqa: PLC0415

    part_size = setting.part_size or part_size
    return TransferConfig(
        multipart_threshold=part_size,
        multipart_chunksize=part_size,
        max_concurrency=setting.max_concurrency,
    )


def s3_put(client: Any, bucket: str, key: str, payload: bytes, config: Any) -> None:
    """Upload ``payload`` as one object: concurrent multipart parts above the threshold."""
    client.upload_fileobj(io.BytesIO(payload), bucket, key, Config=config)


def s3_get(client: Any, bucket: str, key: str, config: Any) -> int:
    """Download one object as concurrent ranged GETs; returns its size."""
    sink = io.BytesIO()
    client.download_fileobj(bucket, key, sink, Config=config)
    return sink.seek(0, os.SEEK_END)


class CrtTransfer:
    """s3transfer's CRT transfer manager for any endpoint (boto3's own CRT path talks to
    AWS only: it ignores the client's ``endpoint_url``): requests serialized by botocore
    (path-style), sent by the CRT's S3 client with ``part_size`` parts."""

    def __init__(self, storage_options: Mapping[str, Any], part_size: int) -> None:
        import botocore.session  # type: ignore[import-untyped]  # noqa: PLC0415
        from awscrt.auth import AwsCredentialsProvider  # type: ignore[import-not-found]  # noqa: PLC0415
        from botocore.config import Config  # noqa: PLC0415
        from s3transfer.crt import (  # type: ignore[import-untyped]  # noqa: PLC0415
            BotocoreCRTRequestSerializer,
            CRTTransferManager,
            create_s3_crt_client,
        )

        client_kwargs = dict(storage_options.get("client_kwargs", {}))
        region = client_kwargs.get("region_name") or "us-east-1"
        endpoint = storage_options.get("endpoint_url")
        serializer = BotocoreCRTRequestSerializer(
            botocore.session.Session(),
            {
                "region_name": region,
                "endpoint_url": endpoint,
                "aws_access_key_id": storage_options.get("key"),
                "aws_secret_access_key": storage_options.get("secret"),
                "config": Config(s3={"addressing_style": "path"}),
            },
        )
        credentials = AwsCredentialsProvider.new_static(
            storage_options.get("key"), storage_options.get("secret")
        )
        client = create_s3_crt_client(
            region,
            crt_credentials_provider=credentials,
            part_size=part_size,
            use_ssl=bool(endpoint is None or str(endpoint).startswith("https")),
        )
        self.manager = CRTTransferManager(client, serializer)

    def put(self, bucket: str, key: str, payload: bytes) -> None:
        """Upload ``payload`` as one object (the CRT splits it into parts)."""
        self.manager.upload(io.BytesIO(payload), bucket, key).result()

    def get(self, bucket: str, key: str) -> int:
        """Download one object (the CRT issues ranged GETs); returns its size."""
        sink = io.BytesIO()
        self.manager.download(bucket, key, sink).result()
        return sink.seek(0, os.SEEK_END)

    def close(self) -> None:
        """Stop the manager's requests and threads."""
        self.manager.shutdown()


def s3_delete_prefix(client: Any, bucket: str, keys: list[str]) -> None:
    """Delete the baseline's objects."""
    for key in keys:
        client.delete_object(Bucket=bucket, Key=key)
