"""``python -m cloudckpt.megatron SCRIPT [ARGS...]``: a Megatron-LM script on cloudckpt.

Installs :func:`cloudckpt.megatron.install` and runs ``SCRIPT`` as ``__main__`` with
``ARGS`` as its ``sys.argv[1:]`` and its directory first on ``sys.path``, as ``python
SCRIPT`` would; ``-m MODULE`` runs a module instead. Under ``torchrun``::

    torchrun --nproc-per-node 8 -m cloudckpt.megatron pretrain_gpt.py \\
        --save s3://bucket/run --load s3://bucket/run --ckpt-format torch_dist ...
"""

from __future__ import annotations

import os
import runpy
import sys

from cloudckpt.megatron import install

USAGE = "usage: python -m cloudckpt.megatron SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str]) -> int:
    """Run the script or module ``argv`` names; returns an exit status for usage errors."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.isfile(script):
        print(f"cloudckpt.megatron: no such script: {script!r}\n{USAGE}", file=sys.stderr)
        return 2
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
