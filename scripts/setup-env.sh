#!/usr/bin/env bash
# Create (or reuse) .venv and install cloudckpt with pinned, tested versions.
# Usage: scripts/setup-env.sh [EXTRA]   e.g. scripts/setup-env.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
python3 -m venv .venv
spec="."
[ -n "$extra" ] && spec=".[$extra]"
.venv/bin/python -m pip install --quiet --upgrade "pip>=24" 2>&1 | grep -v "^WARNING: Location" || true
# torch first, pinned to the CPU wheel: an unpinned torch pulls GBs of CUDA packages.
.venv/bin/python -m pip install --quiet -c constraints.txt "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet -c constraints.txt -e "$spec" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import cloudckpt, torch; print('cloudckpt', cloudckpt.__version__, 'torch', torch.__version__)"
