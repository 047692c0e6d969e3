#!/usr/bin/env bash
# Build (or reuse) a cached virtual environment with a real Megatron-Core release,
# for the compatibility tests (tests/test_megatron_compat.py). cloudckpt itself is not
# installed there: the tests exchange checkpoints through directories.
#
# Usage: scripts/compat-env.sh NAME        NAME: a tests/compat/mcore-*.txt, without .txt
#
# The environment is <cache>/NAME, cache = ${CLOUDCKPT_COMPAT_CACHE:-$HOME/.cache/cloudckpt-compat};
# its packages are pinned by tests/compat/NAME.txt (megatron-core is installed last, with
# --no-deps --ignore-requires-python). It is rebuilt only when that file's hash changes,
# so running this again is cheap. The python that builds it: ${CLOUDCKPT_COMPAT_PYTHON:-python3},
# unless the pins file has a line `# python: X.Y`: then a Python X.Y, the first of
# $CLOUDCKPT_COMPAT_PYTHON (when it is X.Y), pythonX.Y on PATH, and pyenv's X.Y.* (newest first).
#
# Prints the environment's directory as the last line of stdout. Exit status:
#   0 ready;  2 usage;  3 an install was impossible here (no index, no wheel for this
#   platform, no Python X.Y: the tests skip, quoting the error);  4 installed, but the
#   check of tests/compat/check_env.py failed (a wrong pin: the tests fail).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

name="${1:-}"
pins="$repo/tests/compat/$name.txt"
usage() {
  local names=() pins_file
  for pins_file in "$repo"/tests/compat/mcore-*.txt; do
    names+=("$(basename "$pins_file" .txt)")
  done
  echo "usage: scripts/compat-env.sh NAME   (NAME: one of ${names[*]})" >&2
}
if [ -z "$name" ] || [ "$name" = "-h" ] || [ "$name" = "--help" ]; then
  usage
  exit 2
fi
if [ ! -f "$pins" ]; then
  echo "error: unknown environment $name (no pins file $pins)" >&2
  usage
  exit 2
fi

cache="${CLOUDCKPT_COMPAT_CACHE:-$HOME/.cache/cloudckpt-compat}"
venv="$cache/$name"
stamp="$venv/.cloudckpt-pins.sha256"
log="$cache/$name.build.log"
python="${CLOUDCKPT_COMPAT_PYTHON:-python3}"
# `# python: X.Y` in the pins file: the Python version the environment must be built with.
want_python="$(sed -nE 's/^#[[:space:]]*python:[[:space:]]*([0-9]+\.[0-9]+)[[:space:]]*$/\1/p' "$pins" | head -n1)"
mkdir -p "$cache"

# One build at a time per environment (concurrent test runs wait here).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$cache/$name.lock"
  flock 9
fi

want="$(sha256sum "$pins" | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$name: up to date ($pins unchanged)" >&2
  echo "$venv"
  exit 0
fi

fail_install() {
  echo "error: building $name failed: $1 (full log: $log); last lines:" >&2
  grep -v "^WARNING: Location" "$log" | tail -n 25 >&2 || true
  exit 3
}

# Prints a python command of version $1 (X.Y), or fails: $CLOUDCKPT_COMPAT_PYTHON when it is
# X.Y, else pythonX.Y on PATH (a pyenv shim there may refuse to run: it is tried), else the
# newest of pyenv's X.Y.* installs.
find_python() {
  local version="$1" candidate root
  local candidates=()
  if [ -n "${CLOUDCKPT_COMPAT_PYTHON:-}" ]; then
    candidates+=("$CLOUDCKPT_COMPAT_PYTHON")
  fi
  candidates+=("python$version")
  if command -v pyenv >/dev/null 2>&1 && root="$(pyenv root 2>/dev/null)"; then
    while IFS= read -r candidate; do
      candidates+=("$candidate/bin/python$version")
    done < <(ls -d "$root/versions/$version".* 2>/dev/null | sort -rV)
  fi
  for candidate in "${candidates[@]}"; do
    if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$version" ]; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

started=$SECONDS
if [ -n "$want_python" ]; then
  python="$(find_python "$want_python")" || {
    echo "error: building $name failed: $pins asks for Python $want_python, and none was found" \
      "(tried \$CLOUDCKPT_COMPAT_PYTHON, python$want_python on PATH, pyenv's $want_python.*)" >&2
    exit 3
  }
fi
echo "$name: building $venv from $pins with $python (log: $log)" >&2
rm -rf "$venv"
: >"$log"
"$python" -m venv "$venv" >>"$log" 2>&1 || fail_install "cannot create a venv with $python"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
deps="$(mktemp)"
trap 'rm -f "$deps"' EXIT
grep -v '^megatron-core' "$pins" >"$deps"
megatron="$(grep -m1 '^megatron-core==' "$pins")" || {
  echo "error: $pins pins no megatron-core==VERSION" >&2
  exit 2
}
# Dependencies first (torch pinned: the local CPU wheel where there is one for this Python),
# then Megatron-Core alone.
"${pip[@]}" install -r "$deps" >>"$log" 2>&1 || fail_install "pip install -r $pins"
"${pip[@]}" install --no-deps --ignore-requires-python "$megatron" >>"$log" 2>&1 ||
  fail_install "pip install --no-deps --ignore-requires-python $megatron"

# From a neutral directory, so that nothing of the repository shadows the installed packages.
if ! (cd "$cache" && "$venv/bin/python" "$repo/tests/compat/check_env.py" "${megatron#megatron-core==}") >>"$log" 2>&1; then
  echo "error: $name installed, but its check failed (full log: $log):" >&2
  tail -n 25 "$log" >&2
  exit 4
fi
echo "$want" >"$stamp"
echo "$name: built in $((SECONDS - started)) s" >&2
echo "$venv"
