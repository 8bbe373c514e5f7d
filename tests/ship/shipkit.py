"""Shared pieces of the shipping tests: where the chart is, the release under test, and a Helm runner."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import yaml

from lorajob_devcluster.versions import DEFAULT_VERSIONS

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "qwen3-gsm8k.yaml").read_text())


def example_spec(**changes) -> dict:
    """A copy of the example LoRAJob's spec with changes at `a__b__c` paths (None removes the field)."""
    spec = copy.deepcopy(EXAMPLE["spec"])
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = spec
        for part in parents:
            target = target.setdefault(part, {})
        if value is None:
            target.pop(leaf, None)
        else:
            target[leaf] = value
    return spec
CHART = REPO / "helm" / "lorajob"
RELEASE = "lorajob"
RELEASE_NAMESPACE = "lorajob-system"
FULLNAME = "lorajob"
SERVICE_ACCOUNT = f"system:serviceaccount:{RELEASE_NAMESPACE}:{FULLNAME}"
# `helm template` has no cluster to ask; render for the Kubernetes version the harness runs.
TEMPLATE_KUBE_VERSION = DEFAULT_VERSIONS.kubernetes


class Helm:
    def __init__(self, binary: Path, kubeconfig: Path | None = None):
        self.binary = binary
        self.kubeconfig = kubeconfig

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.binary), *args]
        if self.kubeconfig is not None:
            command.append(f"--kubeconfig={self.kubeconfig}")
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def template(self, *values: str, include_crds: bool = False) -> list[dict]:
        """Rendered objects for `--set`-style values (or `-f FILE` pairs passed through)."""
        args = ["template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--kube-version", TEMPLATE_KUBE_VERSION]
        args += ["--include-crds"] if include_crds else []
        for value in values:
            args += ["--set-json" if value.startswith("json:") else "--set", value.removeprefix("json:")]
        return [doc for doc in yaml.safe_load_all(self.run(*args).stdout) if doc]
