"""Shared pieces of the shipping tests: where the chart is, the release under test, and a Helm runner."""

from __future__ import annotations

import copy
import json
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
API_FULLNAME = f"{FULLNAME}-api"
API_SERVICE_ACCOUNT = f"system:serviceaccount:{RELEASE_NAMESPACE}:{API_FULLNAME}"
# `helm template` has no cluster to ask; render for the Kubernetes version the harness runs.
TEMPLATE_KUBE_VERSION = DEFAULT_VERSIONS.kubernetes


def set_args(*values: str) -> list[str]:
    """Helm arguments for `a.b=c` values (`--set`), or `json:a.b=JSON` ones (`--set-json`)."""
    args = []
    for value in values:
        args += ["--set-json" if value.startswith("json:") else "--set", value.removeprefix("json:")]
    return args


def api_values(*namespaces: str) -> list[str]:
    """Values turning the fine-tuning API on for these namespaces, offering the example's model (its spec less
    what each request decides)."""
    template = example_spec(dataset=None, output=None, training__steps=None)
    config = {"storage": "gs://ship-bucket/api", "namespaces": list(namespaces),
              "models": {"qwen3-0.6b": {"template": template, "ownedBy": "ship"}}}
    return ["api.enabled=true", f"json:api.config={json.dumps(config)}"]


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
        """Rendered objects for `--set`-style values (set_args)."""
        args = ["--include-crds"] if include_crds else []
        return [doc for doc in yaml.safe_load_all(self._template(*args, *set_args(*values)).stdout) if doc]

    def refusal(self, *values: str) -> str:
        """What `helm template` says when it refuses these values; "" when it renders them."""
        result = self._template(*set_args(*values), check=False)
        return result.stderr if result.returncode != 0 else ""

    def _template(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
                        "--kube-version", TEMPLATE_KUBE_VERSION, *args, check=check)
