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

stamp=.venv/.lorajob-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  echo "==> installing Python packages (lorajob[operator,trainer,dev])"
  start=$(date +%s)
  .venv/bin/pip install --quiet -c scripts/constraints.txt -e ".[operator,trainer,dev]"
  touch "$stamp"
  echo "==> Python packages installed in $(( $(date +%s) - start ))s"
fi

echo "==> control-plane binaries"
.venv/bin/python -m lorajob_devcluster build
