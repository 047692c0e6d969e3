"""benchmarks/bench_simulate.py agrees with the real thing: the manifest (zarr) and the
DCP ``.metadata`` (torch_dist) it simulates for a 4-rank TP x DP layout are those a real
4-rank save of that layout writes, and the validation it runs catches an overlap and a
missing shard injected into the simulated ranks' metadata."""

from __future__ import annotations

import copy
import os
import sys

import pytest

import cloudckpt
from cloudckpt import huge_pages
from cloudckpt.errors import ShardingValidationError
from cloudckpt.formats.dcp.ranges import TENSOR_DATA_KEY
from cloudckpt.formats.dcp.storage import read_metadata
from cloudckpt.manifest import MANIFEST_FNAME, Manifest
from cloudckpt.mapping import ShardedTensor
from cloudckpt.storage import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_simulate as sim

WORLD = sim.World(tp=2, pp=1, dp=2, hidden=16)  # the rank pool's 4 ranks
TENSORS = 13  # one layer and a bit: every kind of weight and moment
OWN_FILES = {MANIFEST_FNAME, ".cloudckpt-claim.json", "common.pt", "metadata.json"}


def _save_layout(rank: int, world: int, uri: str, backend: str) -> None:
    assert world == WORLD.size
    shards = sim.rank_shards(WORLD, TENSORS)(rank)
    cloudckpt.save(sim.materialize(shards), uri, sharded_strategy=(backend, 1))


def _stored(manifest: Manifest, sizes: bool) -> dict[str, int]:
    """Path -> size of the data objects (sizes of pickled objects left out: -1)."""
    return {
        e.path: e.size if sizes and not e.path.endswith(".pt") else -1
        for e in manifest.objects
        if e.path not in OWN_FILES
    }


def test_simulated_zarr_manifest_is_the_real_one(rank_pool, tmp_path):
    uri = str(tmp_path / "zarr")
    rank_pool.run(_save_layout, uri, "zarr")
    real = Manifest.from_json(open_checkpoint(uri).read(MANIFEST_FNAME))
    simulated = sim.simulate("zarr", WORLD, TENSORS).artifacts["manifest"]
    assert _stored(simulated, sizes=True) == _stored(real, sizes=True)
    assert simulated.tensors == real.tensors
    assert simulated.world_size == real.world_size == 4
    flat_chunks = {
        (path.rpartition("/")[0], tuple(int(i) for i in path.rpartition("/")[2].split(".")))
        for path in _stored(real, sizes=False)
        if path.startswith("optimizer.") and not path.endswith(".zarray")
    }
    plans = sim.simulate("zarr", WORLD, TENSORS).artifacts["flat_plans"]
    assert {(p.key, p.index) for p in plans} == flat_chunks


def test_simulated_dcp_metadata_is_the_real_one(rank_pool, tmp_path):
    uri = str(tmp_path / "dcp")
    rank_pool.run(_save_layout, uri, "torch_dist")
    real = read_metadata(open_checkpoint(uri))
    row = sim.simulate("torch_dist", WORLD, TENSORS)
    simulated = row.artifacts["dcp_metadata"]
    assert simulated.state_dict_metadata == real.state_dict_metadata

    # the real save also records where each item's elements lie in its bytes, which
    # only serializing the data tells (the simulation has none): compare the rest
    def unrecorded(extra: dict) -> dict:
        return {
            key: rest
            for key, entry in extra.items()
            if (rest := {k: v for k, v in entry.items() if k != TENSOR_DATA_KEY})
        }

    assert unrecorded(simulated.mcore_data) == unrecorded(real.mcore_data)  # type: ignore[attr-defined]
    assert all(TENSOR_DATA_KEY in e for e in real.mcore_data.values())  # type: ignore[attr-defined]
    # the simulated records are made up, for the same items
    for key, entry in real.mcore_data.items():  # type: ignore[attr-defined]
        simulated_records = simulated.mcore_data[key][TENSOR_DATA_KEY]  # type: ignore[attr-defined]
        assert set(simulated_records) == set(entry[TENSOR_DATA_KEY])
    assert set(simulated.storage_data) == set(real.storage_data)
    manifest = row.artifacts["manifest"]
    assert manifest.tensors == Manifest.from_json(open_checkpoint(uri).read(MANIFEST_FNAME)).tensors


@pytest.mark.parametrize("backend", ["zarr", "torch_dist"])
def test_simulated_layout_is_valid(backend):
    sim.check(sim.gathered_metadata(sim.World(tp=4, pp=2, dp=4), 40), backend)


def test_each_step_reports_its_kernel_time_and_the_memory_settings():
    """The kernel's share of each step (page faults of new arrays: large where numpy's
    huge-page advice makes the kernel compact memory) is reported beside its time."""
    row = sim.simulate("torch_dist", sim.World(tp=2, pp=2, dp=2), 20)
    assert set(row.kernel_seconds) == set(row.seconds) == {"gather", "validate", "plan", "merge"}
    assert all(v >= 0 for v in row.kernel_seconds.values())
    settings = sim.memory_settings()
    assert "transparent huge pages: enabled=" in settings
    assert "numpy advises huge pages: " in settings


def test_validation_catches_an_injected_overlap_and_a_missing_shard():
    world = sim.World(tp=4, pp=2, dp=4)
    gathered = sim.gathered_metadata(world, 40)
    victim = next(s for s in gathered[0] if isinstance(s, ShardedTensor) and not s.flattened_range)
    replica = copy.copy(victim)
    replica.replica_id = 0  # a DP replica that claims to be main as well
    gathered[world.tp].append(replica)  # dp = 1, same tp and pp
    flat = next(s for s in gathered[1] if isinstance(s, ShardedTensor) and s.flattened_range)
    gathered[1].remove(flat)
    with pytest.raises(ShardingValidationError) as err:
        sim.check(gathered, "zarr")
    problems = err.value.violations
    assert len(problems) == 2, problems
    assert any(
        f"tensor {victim.key!r}: chunk " in p and "saved by 2 main replicas (ranks 0, 4)" in p
        for p in problems
    ), problems
    rng = flat.flattened_range
    assert any(
        f"tensor {flat.key!r}" in p and f"elements [{rng.start}, {rng.stop}) are not saved" in p
        for p in problems
    ), problems


def test_dcp_own_global_step_writes_the_fast_paths_metadata():
    """DCP's own coordinator step (the stock planner's ``create_global_plan`` on the plans
    as objects, the writer's ``prepare_global_plan``, whole plans scattered, ``finish``)
    and cloudckpt's fast path (columns) write equal ``.metadata`` and manifests for
    16 ranks x 20 tensors; each reports its plan and finish parts."""
    world = sim.World(tp=2, pp=2, dp=4)
    fast = sim.simulate("torch_dist", world, 20)
    own = sim.simulate("torch_dist", world, 20, global_step="dcp")
    assert (fast.global_step, own.global_step) == ("columns", "dcp")
    ours, dcps = fast.artifacts["dcp_metadata"], own.artifacts["dcp_metadata"]
    assert dcps.state_dict_metadata == ours.state_dict_metadata
    assert list(dcps.state_dict_metadata) == list(ours.state_dict_metadata)
    for key, value in dcps.state_dict_metadata.items():
        chunks = getattr(ours.state_dict_metadata[key], "chunks", None)
        assert getattr(value, "chunks", None) == chunks, key
    tensors = [v for v in dcps.state_dict_metadata.values() if hasattr(v, "chunks")]
    assert sum(len(v.chunks) for v in tensors) > len(tensors)  # chunks from several ranks
    assert dcps.storage_data == ours.storage_data
    assert dcps.mcore_data == ours.mcore_data  # type: ignore[attr-defined]
    assert dcps.planner_data == ours.planner_data
    assert own.artifacts["manifest"].tensors == fast.artifacts["manifest"].tensors
    # the same objects (the two pickles of one .metadata may differ in length)
    stored = [_stored(r.artifacts["manifest"], sizes=True) for r in (own, fast)]
    assert [s.pop(".metadata") > 0 for s in stored] == [True, True]
    assert stored[0] == stored[1]
    for row in (fast, own):
        assert set(row.seconds) == {"gather", "validate", "plan", "merge"}
        assert row.parts["plan"] + row.parts["finish"] == pytest.approx(row.seconds["plan"])
        pieces = ("gather", "global", "scatter")
        assert sum(row.parts[f"plan.{p}"] for p in pieces) == pytest.approx(row.parts["plan"])
        assert row.parts["finish.gather"] + row.parts["finish.metadata"] == pytest.approx(
            row.parts["finish"]
        )
        assert row.peak_rss > 0
    # DCP's step scatters whole plans; the fast path what its step changed in each
    assert own.bytes_received["dcp_plans"] > fast.bytes_received["dcp_plans"]


def test_the_linear_step_on_objects_writes_the_fast_paths_metadata():
    """cloudckpt's linear step on the plans as objects (``--global-step linear``: each
    rank's update scattered, item results as objects, ``finish``) writes the fast path's
    ``.metadata``, scattering updates (not whole plans)."""
    world = sim.World(tp=2, pp=2, dp=4)
    fast = sim.simulate("torch_dist", world, 20)
    linear = sim.simulate("torch_dist", world, 20, global_step="linear")
    own = sim.simulate("torch_dist", world, 20, global_step="dcp")
    ours, theirs = fast.artifacts["dcp_metadata"], linear.artifacts["dcp_metadata"]
    assert theirs.state_dict_metadata == ours.state_dict_metadata
    for key, value in theirs.state_dict_metadata.items():
        chunks = getattr(ours.state_dict_metadata[key], "chunks", None)
        assert getattr(value, "chunks", None) == chunks, key
    assert theirs.storage_data == ours.storage_data
    assert theirs.mcore_data == ours.mcore_data  # type: ignore[attr-defined]
    assert linear.artifacts["manifest"].tensors == fast.artifacts["manifest"].tensors
    assert linear.bytes_received["dcp_plans"] < own.bytes_received["dcp_plans"]
    assert linear.bytes_per_rank["dcp_plan"] > fast.bytes_per_rank["dcp_plan"]  # objects
    assert linear.parts["plan"] + linear.parts["finish"] == pytest.approx(linear.seconds["plan"])
    with pytest.raises(ValueError, match="global_step"):
        sim.simulate("torch_dist", world, 20, global_step="other")


def test_the_huge_page_switch_can_be_left_off(monkeypatch):
    """A simulated save turns numpy's huge page advice off throughout, as the
    coordinator's save does; ``huge_page_switch=False`` (``--no-huge-page-switch``)
    leaves it as the process has it. Seen from the merge step, which runs last."""
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    if huge_pages.numpy_advises_huge_pages() is None or huge_pages._advice_setter() is None:
        pytest.skip("numpy has no huge page switch here")
    before = huge_pages._multiarray()._set_madvise_hugepage(True)
    try:
        seen: list[bool | None] = []
        merge = sim.merge

        def noting(*args, **kwargs):
            seen.append(huge_pages.numpy_advises_huge_pages())
            return merge(*args, **kwargs)

        monkeypatch.setattr(sim, "merge", noting)
        sim.simulate("zarr", WORLD, TENSORS)
        sim.simulate("zarr", WORLD, TENSORS, huge_page_switch=False)
        assert seen == [False, True]
        assert huge_pages.numpy_advises_huge_pages()
    finally:
        huge_pages._multiarray()._set_madvise_hugepage(before)
