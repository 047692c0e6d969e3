"""The raw baselines each rank of ``cloudckpt bench`` times in a round, the same bytes
without cloudckpt (:mod:`.raw`): on a local disk a file write and read and a
``torch.save`` and ``torch.load``; on S3 a PUT and a GET per client setting, with the
HTTP requests each sent (the CRT's are not counted)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from cloudckpt.bench import raw
from cloudckpt.bench.clock import Clock
from cloudckpt.bench.measure import RankFigures
from cloudckpt.bench.options import BenchOptions, _config


def _raw_local_round(
    figures: RankFigures, share: dict[str, torch.Tensor], rank: int, run: str
) -> None:
    directory = raw.local_path(run) / "raw"
    directory.mkdir(parents=True, exist_ok=True)
    payload = raw.payload_of(share)
    path = directory / f"rank{rank}.bin"
    figures.timed("raw_write", lambda: raw.write_file(path, payload))
    sink = bytearray(len(payload))
    figures.timed("raw_read", lambda: raw.read_file(path, sink))
    path.unlink()
    pt = directory / f"rank{rank}.pt"
    figures.timed("torch_save", lambda: raw.torch_save(pt, share))
    figures.timed("torch_load", lambda: raw.torch_load(pt))
    pt.unlink()


def _raw_s3_round(
    figures: RankFigures, share: dict[str, torch.Tensor], rank: int, run: str, options: BenchOptions
) -> None:
    bucket, prefix = raw.split_s3(run)
    payload = raw.payload_of(share)
    part_size = _config(options).part_size
    for setting in raw.s3_settings():
        key = f"{prefix}/raw/{setting.name.replace(' ', '-')}/rank{rank}.bin"
        if setting.crt:
            _raw_crt(figures, setting, options, bucket, key, payload)
            continue
        client = raw.s3_client(options.storage_options, setting)
        config = raw.transfer_config(setting, part_size)
        _raw_s3_setting(figures, setting.name, client, config, bucket, key, payload)
        raw.s3_delete_prefix(client, bucket, [key])
        client.close()


def _raw_s3_setting(
    figures: RankFigures,
    name: str,
    client: Any,
    config: Any,
    bucket: str,
    key: str,
    payload: bytes,
) -> None:
    """One client setting's PUT and GET of the rank's bytes, with their requests."""
    counter = _RequestCounter()
    client.meta.events.register("before-send.s3", counter)
    figures.timed(f"raw_put[{name}]", lambda: raw.s3_put(client, bucket, key, payload, config))
    figures.requests[f"raw_put[{name}]"] = counter.take()
    figures.timed(f"raw_get[{name}]", lambda: raw.s3_get(client, bucket, key, config))
    figures.requests[f"raw_get[{name}]"] = counter.take()


def _raw_crt(
    figures: RankFigures,
    setting: raw.S3Setting,
    options: BenchOptions,
    bucket: str,
    key: str,
    payload: bytes,
) -> None:
    """The CRT's PUT and GET (its requests are not counted). Optional: a failure is
    recorded, not raised, and every rank still passes the same barriers."""
    errors: list[str] = []

    def attempt(fn: Callable[[], object]) -> None:
        if errors:
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - recorded in the figures
            errors.append(f"{type(exc).__name__}: {exc}")

    transfer: list[raw.CrtTransfer] = []
    part_size = setting.part_size or _config(options).part_size
    attempt(lambda: transfer.append(raw.CrtTransfer(options.storage_options, part_size)))
    clock = Clock(figures.server_pid)
    put = clock.span(lambda: attempt(lambda: transfer[0].put(bucket, key, payload)))
    get = clock.span(lambda: attempt(lambda: transfer[0].get(bucket, key)))
    if transfer:
        transfer[0].close()
        with contextlib.suppress(Exception):
            client = raw.s3_client(options.storage_options, raw.S3_SETTINGS[0])
            raw.s3_delete_prefix(client, bucket, [key])
    if errors:
        figures.errors[setting.name] = errors[0]
        return
    figures.record_span(f"raw_put[{setting.name}]", put)
    figures.record_span(f"raw_get[{setting.name}]", get)


class _RequestCounter:
    """A botocore ``before-send`` hook counting the HTTP requests a client sends."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, **kwargs: Any) -> None:
        self.count += 1  # botocore's threads: += on an int is atomic enough under the GIL

    def take(self) -> int:
        """The count since the last take."""
        count, self.count = self.count, 0
        return count
