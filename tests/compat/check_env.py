"""Check a compatibility environment (run with its python by scripts/compat-env.sh).

    python tests/compat/check_env.py 0.15.3

Exits 0 when the installed Megatron-Core is the pinned release and the checkpointing
parts the tests use import and are functional on this machine; otherwise prints why
and exits 1.
"""

from __future__ import annotations

import sys
import warnings


def main(expected: str) -> int:
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing, package_info  # noqa: PLC0415

    problems = []
    if package_info.__version__ != expected:
        problems.append(f"megatron-core is {package_info.__version__}, expected {expected}")
    if not hasattr(dist_checkpointing, "load_plain_tensors"):
        problems.append("megatron.core.dist_checkpointing has no load_plain_tensors")
    if expected.startswith("0.15."):
        from megatron.core.dist_checkpointing.strategies import (  # noqa: PLC0415
            tensorstore,
            zarr,
        )

        if not zarr.HAVE_ZARR:
            problems.append("zarr is not importable (the zarr backend needs zarr 2.x)")
        if not zarr.HAS_BFLOAT16:
            problems.append("tensorstore is not importable (bfloat16 arrays need it)")
        if not tensorstore.HAVE_TENSORSTORE:
            problems.append("tensorstore is not importable (the default zarr loader)")
    else:
        from megatron.core.dist_checkpointing.strategies.torch import (  # noqa: PLC0415, F401
            TorchDistLoadShardedStrategy,
            TorchDistSaveShardedStrategy,
        )
    for problem in problems:
        print(f"compat env check: {problem}", file=sys.stderr)
    if not problems:
        print(f"megatron-core {package_info.__version__}: dist_checkpointing OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
