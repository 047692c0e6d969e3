#!/usr/bin/env bash
# Install cloudckpt with its test tools (the dev extra, which includes all) and run the
# whole test suite.
# The tests start their own servers; set CLOUDCKPT_TEST_S3_ENDPOINT (+ AWS keys) to
# run the S3 tests against MinIO or another S3-compatible endpoint instead.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh dev
.venv/bin/ruff check cloudckpt tests benchmarks
.venv/bin/ruff format --check cloudckpt tests benchmarks
.venv/bin/mypy cloudckpt
# One test file per worker process (--dist loadfile: a file's module fixtures stay in one
# process); each worker starts the servers and the 4-rank gloo group its files need.
# Workers: CLOUDCKPT_TEST_WORKERS, default the CPU count capped at 4 (more workers mean
# more servers and rank groups than the tests gain from); 0 runs in this process.
workers="${CLOUDCKPT_TEST_WORKERS:-$(nproc)}"
if [ -z "${CLOUDCKPT_TEST_WORKERS:-}" ] && [ "$workers" -gt 4 ]; then workers=4; fi
set +e
.venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
