"""A save or load opens its checkpoint once and reads the commit records once.

Every storage a session opens is counted (``cloudckpt.session_support.open_checkpoint`` is
wrapped) and gets a local filesystem that counts its requests (opens, stats, listings)
on the commit files (``metadata.json``, ``manifest.json``, the claim). Runs on 4 real
ranks: the counts are per rank.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from typing import Any, ClassVar

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import cloudckpt
from cloudckpt import ShardedObject, ShardedTensor, StrictHandling, session_support
from cloudckpt.core import CONFIG_FNAME
from cloudckpt.formats.protocol import HasSaveFormat, SaveFormat, ShardedLoader
from cloudckpt.manifest import CLAIM_FNAME, MANIFEST_FNAME
from cloudckpt.strategies.common import TorchCommonLoadStrategy
from cloudckpt.strategies.torch import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from cloudckpt.strategies.zarr import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from tests.test_multirank import tp_state

COMMIT_FILES = {CONFIG_FNAME, MANIFEST_FNAME, CLAIM_FNAME}


class _CountingLocalFS(LocalFileSystem):
    """A local filesystem that counts the requests (opens, stats, listings) per object
    name (fsspec's other calls, cat_file or find, go through these)."""

    counts: ClassVar[Counter] = Counter()

    def _count(self, method: str, path: Any) -> None:
        self.counts[(method, posixpath.basename(str(path).rstrip("/")))] += 1

    def open(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        self._count("open", path)
        return super().open(path, *args, **kwargs)

    def info(self, path: Any, **kwargs: Any) -> Any:
        self._count("info", path)
        return super().info(path, **kwargs)

    def isfile(self, path: Any) -> bool:
        self._count("isfile", path)
        return bool(super().isfile(path))

    def exists(self, path: Any, **kwargs: Any) -> bool:
        self._count("exists", path)
        return bool(super().exists(path, **kwargs))

    def ls(self, path: Any, detail: bool = False, **kwargs: Any) -> Any:
        self._count("ls", path)
        return super().ls(path, detail=detail, **kwargs)


def _count_storages(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the storages sessions open, and the requests of their filesystem."""
    counts: ClassVar[Counter] = Counter()
    real = session_support.open_checkpoint

    def counting_open(uri: Any, fs: Any = None, *args: Any, **kwargs: Any) -> Any:
        counts["storages"] += 1
        return real(uri, fs or _CountingLocalFS(skip_instance_cache=True), *args, **kwargs)

    monkeypatch.setattr(_CountingLocalFS, "counts", counts)
    monkeypatch.setattr(session_support, "open_checkpoint", counting_open)
    return counts


def _commit_file_requests(counts: Counter) -> int:
    return sum(n for key, n in counts.items() if isinstance(key, tuple) and key[1] in COMMIT_FILES)


def _state(rank: int, empty: bool = False, tp: int = 2) -> dict:
    state = tp_state(rank, tp=tp, empty=empty)
    state["obj"] = ShardedObject(
        "obj", {"rank": rank % tp}, (tp,), (rank % tp,), replica_id=rank // tp
    )
    state["iteration"] = 3
    return state


def _counted_scenario(rank: int, world: int, uri: str, backend: str) -> dict:
    monkeypatch = pytest.MonkeyPatch()
    try:
        counts = _count_storages(monkeypatch)
        cloudckpt.save(_state(rank), uri, sharded_strategy=(backend, 1))
        out = {"save": counts["storages"]}
        for strict in StrictHandling:
            counts.clear()
            cloudckpt.load(_state(rank, empty=True), uri, strict=strict)
            out[strict.value] = (counts["storages"], _commit_file_requests(counts))
        return out
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("backend", ["zarr", "torch_dist"])
def test_one_storage_per_save_and_load_and_at_most_3_commit_file_requests(
    rank_pool, tmp_path, backend
):
    results = rank_pool.run(_counted_scenario, str(tmp_path / "ckpt"), backend)
    for rank, counts in enumerate(results):
        assert counts.pop("save") == 1, rank
        assert len(counts) == len(StrictHandling)
        for strict, (storages, commit_requests) in counts.items():
            assert storages == 1, (rank, strict)
            # metadata.json and manifest.json, read once each
            assert commit_requests == 2, (rank, strict, commit_requests)


def test_a_foreign_checkpoint_costs_one_more_request(tmp_path, monkeypatch):
    uri = str(tmp_path / "ckpt")
    cloudckpt.save(_state(0, tp=1), uri)
    (tmp_path / "ckpt" / MANIFEST_FNAME).unlink()  # as Megatron-Core writes it: no manifest,
    (tmp_path / "ckpt" / CLAIM_FNAME).unlink()  # no claim
    counts = _count_storages(monkeypatch)
    loaded = cloudckpt.load(_state(0, empty=True, tp=1), uri, strict="raise_all")
    assert loaded["iteration"] == 3 and loaded["obj"] == {"rank": 0}
    assert counts["storages"] == 1 and _commit_file_requests(counts) == 3


def test_cloudckpt_strategies_declare_their_format_and_seed_signatures_still_work(tmp_path):
    for strategy in (ZarrSaveShardedStrategy(), TorchDistSaveShardedStrategy()):
        assert isinstance(strategy, HasSaveFormat)
        assert isinstance(strategy.save_format(), SaveFormat)
    for loader in (ZarrLoadShardedStrategy(), TorchDistLoadShardedStrategy()):
        assert isinstance(loader, ShardedLoader)
    uri = str(tmp_path / "direct")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
    written = ZarrSaveShardedStrategy().save(state, uri)  # the seeds' signature
    assert sorted(r.path for r in written) == ["w/.zarray", "w/0"]
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(6))}
    assert torch.equal(ZarrLoadShardedStrategy().load(request, uri)["w"], torch.arange(6.0))
    assert set(ZarrLoadShardedStrategy().load_tensors_metadata(uri)) == {"w"}
    assert TorchCommonLoadStrategy().load_sharded_metadata(uri) == {}
