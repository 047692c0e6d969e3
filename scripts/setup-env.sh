#!/usr/bin/env bash
# Create (or reuse) .venv and install cloudckpt (editable) with pinned, tested versions.
# Usage: scripts/setup-env.sh [EXTRA]   EXTRA: all (default: S3 and GCS support), dev
# (all + test tools), s3, gcs.
#
# The install is skipped when .venv was already set up for EXTRA from the same
# pyproject.toml and constraints.txt: .venv/.cloudckpt-setup records a hash of both and
# the extras installed under it. The install is editable, so code changes need no
# reinstall. CLOUDCKPT_REINSTALL=1 forces one. A failing pip fails this script.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-all}"
stamp=.venv/.cloudckpt-setup
inputs="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"

# pip with the "WARNING: Location ... is ignored" lines of this machine's pip config
# filtered out, to stderr. pipefail makes pip's exit status the pipeline's; grep -v exits 1 when
# it filtered every line, which is not a failure, hence the `|| true` around grep alone.
pip_install() {
  if ! .venv/bin/python -m pip install --quiet "$@" 2>&1 \
      | { grep -v "^WARNING: Location" >&2 || true; }; then
    echo "setup-env.sh: error: pip install $* failed (see above)" >&2
    exit 1
  fi
}

is_current() {
  [ -z "${CLOUDCKPT_REINSTALL:-}" ] && [ -f "$stamp" ] \
    && [ "$(head -n 1 "$stamp")" = "$inputs" ] \
    && grep -qxF -- "$extra" <(tail -n +2 "$stamp") \
    && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('cloudckpt') is None)"
}

[ -x .venv/bin/python ] || python3 -m venv .venv
if is_current; then
  exit 0
fi
pip_install --upgrade "pip>=24"
# torch first, pinned to the CPU wheel: an unpinned torch pulls GBs of CUDA packages.
pip_install -c constraints.txt "torch==2.13.0"
pip_install -c constraints.txt -e ".[$extra]"
.venv/bin/python -c "import cloudckpt, torch; print('cloudckpt', cloudckpt.__version__, 'torch', torch.__version__)"
# Record the extras installed from these inputs (a new hash starts a new list).
if [ -f "$stamp" ] && [ "$(head -n 1 "$stamp")" = "$inputs" ]; then
  grep -qxF -- "$extra" <(tail -n +2 "$stamp") || echo "$extra" >> "$stamp"
else
  printf '%s\n%s\n' "$inputs" "$extra" > "$stamp"
fi
