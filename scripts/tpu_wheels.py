"""The trainer's packages as wheels for a TPU machine without network: `.whl-tpu/`, pinned to what this checkout's
virtualenv installed from scripts/constraints.txt.

    .venv/bin/python scripts/tpu_wheels.py            # fills .whl-tpu/ (ignored by git), prints the install line

The lent TPU machine (the `device` tool) has Python 3.11, JAX, jaxlib, libtpu, numpy and scipy, and a package
index of its own on disk, but no network. The wheels here are the closure of the trainer's requirements (the
`trainer` extra, without the parts a chip run does not use: gs:// access, Pathways, TensorBoard) less what that
machine has, and less the large binaries its own index holds (`FROM_MACHINE_INDEX`, installed there by the printed
line): the working tree that travels there is limited to 64 MiB. The printed line goes first in a command run
there; it puts the wheels at the end of PYTHONPATH so that the machine's JAX stays first.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = REPO_ROOT / ".whl-tpu"
ROOTS = ("google-tunix", "qwix", "flax", "optax", "orbax-checkpoint", "datasets", "transformers", "safetensors",
         "tokenizers", "tqdm", "huggingface-hub", "pydantic", "pyyaml", "etils", "perfetto", "einops", "tensorboardx",
         "cloudpickle", "python-dateutil", "six", "requests", "opentelemetry-api", "zipp")
"""What the trainer imports on a chip (pyproject's trainer extra, less gcsfs and pathwaysutils; Tunix imports
tensorboardX through metrax, and einops, cloudpickle, dateutil, requests and OpenTelemetry's API at import)."""
ON_MACHINE = {"jax", "jaxlib", "libtpu", "numpy", "scipy", "ml-dtypes", "opt-einsum", "setuptools", "pip", "sympy",
              "mpmath", "pytest"}
"""Installed on the TPU machine; its versions are the ones JAX there was built with."""
FROM_MACHINE_INDEX = ("tensorstore", "pyarrow", "pandas", "pillow", "xxhash", "hf-xet", "pytz", "tzdata")
"""Large binaries the machine's own index holds (file:///opt/pypi/simple): installed there with what they need from
that index, not carried."""
SKIPPED = {"gcsfs", "pathwaysutils", "tensorflow-datasets", "torch", "nvidia-*", "triton", "jax-cuda*",
           "grain", "array-record", "kagglehub", "kagglesdk", "hf-transfer", "uvloop", "numba", "llvmlite"}
"""Required by Tunix for its data pipelines, Hub and Kaggle downloads, by datasets and hub for speed-ups: none is
imported by the trainer's step, model or data paths (name patterns)."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
"""The machine's glibc is 2.36 (../shared/notes/tpu-device.md): wheels for 2.36 or older."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def skipped(name: str) -> bool:
    return any(re.fullmatch(pattern.replace("*", ".*"), name) for pattern in SKIPPED)


def closure(roots: tuple[str, ...]) -> dict[str, str]:
    """{canonical name: installed version} of `roots` and everything they require here (no extras; markers as this
    Python 3.11 on Linux reads them), less what the machine has or its index holds."""
    found: dict[str, str] = {}
    pending = [canonical(root) for root in roots]
    while pending:
        name = pending.pop()
        if name in found or name in ON_MACHINE or name in FROM_MACHINE_INDEX or skipped(name):
            continue
        distribution = metadata.distribution(name)
        found[name] = distribution.version
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(canonical(requirement.name))
    return found


def download(pins: dict[str, str]) -> None:
    WHEELS.mkdir(exist_ok=True)
    platforms = [argument for platform in PLATFORMS for argument in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version",
         "3.11", "--implementation", "cp", *platforms, "-d", str(WHEELS),
         *(f"{name}=={version}" for name, version in sorted(pins.items()))],
        check=True,
    )


INSTALL = (
    "PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir "
    "--target /tmp/site .whl-tpu/*.whl && PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q "
    "--no-compile --no-cache-dir --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/index {index} "
    "&& export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/index || exit;"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    pins = closure(ROOTS)
    for stale in WHEELS.glob("*.whl"):
        stale.unlink()
    download(pins)
    size = sum(wheel.stat().st_size for wheel in WHEELS.glob("*.whl"))
    print(f"{len(pins)} wheels, {size / 2**20:.1f} MiB in {WHEELS.relative_to(REPO_ROOT)}/; on the machine, first:")
    print(INSTALL.format(index=" ".join(FROM_MACHINE_INDEX)))


if __name__ == "__main__":
    main()
