"""Save or load the compatibility state with a real Megatron-Core (run in its own venv).

    python tests/compat/mcore_ckpt.py save --dir D --world 4 --tp 2 --backend zarr --out R
    python tests/compat/mcore_ckpt.py load --dir D --world 2 --tp 2 --object-world 4 \
        --loaders default,zarr,plain [--strict raise_all] --out R

``save`` writes the state of :mod:`spec` (TP=``tp`` layout over ``world`` gloo ranks)
with ``dist_checkpointing.save``: ``("zarr", 1)`` or Megatron's default (torch_dist).
``load`` reads it back on every rank with each loader: ``default`` (the checkpoint's
default strategy: TensorStore for zarr in 0.15, torch_dist in 0.19), ``zarr``
(0.15's ZarrLoadShardedStrategy), ``plain`` (``load_plain_tensors``, whole tensors),
and writes, per rank and loader, the digest of every loaded tensor, the loaded object
pieces, the common values and the missing / unexpected keys to ``--out`` (JSON). The
pytest side compares them with the values it derives from :mod:`spec` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # after the path set-up: a script in a foreign venv
import spec


def _megatron() -> tuple[Any, str]:
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing, package_info  # noqa: PLC0415

    return dist_checkpointing, package_info.__version__


def _save(rank: int, world: int, directory: str, tp: int, backend: str) -> dict[str, Any]:
    dc, version = _megatron()
    from megatron.core.dist_checkpointing.mapping import (  # noqa: PLC0415
        ShardedObject,
        ShardedTensor,
    )

    state = spec.build_state(ShardedTensor, ShardedObject, rank, tp, object_world=world)
    if backend == "torch_dist" and not version.startswith("0.15."):
        dc.save(state, directory, verify_integrity=True)  # 0.19: writes integrity.json
    elif backend == "torch_dist":
        dc.save(state, directory)
    else:
        dc.save(state, directory, sharded_strategy=(backend, 1))
    return {"megatron_version": version, "rank": rank}


def _loader(dc: Any, name: str) -> Any:
    if name == "zarr":
        from megatron.core.dist_checkpointing.strategies.zarr import (  # noqa: PLC0415
            ZarrLoadShardedStrategy,
        )

        return ZarrLoadShardedStrategy()
    return None


def _load(
    rank: int,
    world: int,
    directory: str,
    tp: int,
    object_world: int,
    loaders: list[str],
    strict: str | None,
    verify_integrity: bool = False,
) -> dict[str, Any]:
    dc, version = _megatron()
    from megatron.core.dist_checkpointing.mapping import (  # noqa: PLC0415
        ShardedObject,
        ShardedTensor,
    )

    out: dict[str, Any] = {"megatron_version": version, "rank": rank, "loads": {}}
    for name in loaders:
        if name == "plain":
            out["loads"][name] = spec.describe_loaded(dc.load_plain_tensors(directory))
            continue
        request = spec.build_state(
            ShardedTensor, ShardedObject, rank, tp, object_world, empty=True, common=False
        )
        kwargs: dict[str, Any] = {}
        if strict is not None:
            kwargs["strict"] = strict
        if verify_integrity:  # 0.19: checks integrity.json before loading
            kwargs["verify_integrity"] = True
        strategy = _loader(dc, name)
        if strategy is not None:
            kwargs["sharded_strategy"] = strategy
        result = dc.load(request, directory, **kwargs)
        missing: set[str] = set()
        unexpected: set[str] = set()
        if isinstance(result, tuple):
            result, missing, unexpected = result
        described = spec.describe_loaded(result)
        described["missing"] = sorted(missing)
        described["unexpected"] = sorted(unexpected)
        out["loads"][name] = described
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["save", "load"])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--object-world", type=int, default=1)
    parser.add_argument("--backend", default="zarr", choices=["zarr", "torch_dist"])
    parser.add_argument("--loaders", default="default")
    parser.add_argument("--strict", default=None)
    parser.add_argument("--verify-integrity", action="store_true")
    parser.add_argument("--out", required=True, help="JSON result file")
    args = parser.parse_args(argv)
    if args.action == "save":
        os.makedirs(args.dir, exist_ok=True)
        results = harness.run_ranks(_save, args.world, args.dir, args.tp, args.backend)
    else:
        loaders = [name for name in args.loaders.split(",") if name]
        results = harness.run_ranks(
            _load, args.world, args.dir, args.tp, args.object_world, loaders, args.strict,
            args.verify_integrity,
        )  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"action": args.action, "world": args.world, "ranks": results}, f, indent=1)
    harness.log(f"{args.action} on {args.world} rank(s) done: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
