#!/usr/bin/env bash
# Install cloudckpt and run the main job: a 4-rank train/save/reshard/load demo.
# Extra arguments go to `cloudckpt demo` (e.g. --uri s3://bucket/run/iter_0000010).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh all   # quick when .venv is already current
exec .venv/bin/cloudckpt demo "$@"
