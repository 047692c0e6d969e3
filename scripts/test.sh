#!/usr/bin/env bash
# Install cloudckpt with its test tools (the dev extra, which includes all) and run the
# whole test suite.
# The tests start their own servers; set CLOUDCKPT_TEST_S3_ENDPOINT (+ AWS keys) to
# run the S3 tests against MinIO or another S3-compatible endpoint instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh dev
.venv/bin/ruff check cloudckpt tests benchmarks
.venv/bin/mypy cloudckpt
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
