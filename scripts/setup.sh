#!/usr/bin/env bash
# All set-up on a fresh machine, idempotent and quick when warm: the Python environment (.venv with
# every extra) and the Go-built control-plane binaries (cached outside the repo, keyed by version).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-system-packages.sh

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip setuptools wheel
fi

# The installed packages take 7.8 GB (torch's CUDA libraries 4 GB, libtpu 0.7 GB), and pip unpacks each wheel
# beside them: refuse at once, saying so, rather than fail half-way with "No space left on device".
PYTHON_PACKAGES_GB=10
require_free_gb() {
  local need_gb=$1 what=$2 free_kb
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $((need_gb * 1024 * 1024)) ]; then
    echo "error: $what needs about $need_gb GB free on $(df -P . | awk 'NR == 2 {print $6}'), which has" \
      "$((free_kb / 1024 / 1024)) GB; free some space (pip's cache: pip cache purge) and run this again" >&2
    exit 1
  fi
}

stamp=.venv/.lorajob-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  require_free_gb "$PYTHON_PACKAGES_GB" "installing the Python packages"
  echo "==> installing Python packages (lorajob[operator,trainer,dev])"
  start=$(date +%s)
  .venv/bin/pip install --quiet -c scripts/constraints.txt -e ".[operator,trainer,dev]"
  touch "$stamp"
  echo "==> Python packages installed in $(( $(date +%s) - start ))s"
fi

echo "==> control-plane binaries"
.venv/bin/python -m lorajob_devcluster build
