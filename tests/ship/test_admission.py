"""LoRAJobPolicy enforced at admission by the chart's ValidatingAdmissionPolicy, on a real API server,
with the same verdicts and messages as the operator's Python checks (policy.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from shipkit import EXAMPLE, example_spec

from lorajob_operator import api, policy

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
GOVERNED = "ship-policy-team"
UNGOVERNED = "ship-policy-other"
TEAM_LABEL = "lorajob.dev/ship-team"
DENIED = "denied request: "

POLICIES = [
    {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": policy.KIND,
        "metadata": {"name": "ship-team-limits"},
        "spec": {
            "namespaceSelector": {"matchLabels": {TEAM_LABEL: "a"}},
            "queues": {"allowed": ["lorajob", "team-a-batch"]},
            "tpu": {
                "allowed": [{"machineType": "ct6e-standard-4t", "topologies": ["2x2", "4x4"]}, {"machineType": "ct5p-hightpu-4t"}],
                "maxSlices": 2,
                "maxChipsPerJob": 32,
            },
            "outputs": {"allowedPrefixes": ["gs://my-bucket/lorajob", "/mnt/team-a/"]},
        },
    },
    {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": policy.KIND,
        "metadata": {"name": "ship-team-default-queue"},
        "spec": {
            "namespaceSelector": {"matchExpressions": [{"key": TEAM_LABEL, "operator": "In", "values": ["a", "b"]}]},
            "queues": {"default": "team-a-batch"},
            "defaults": {"cpuNodePool": "team-cpu"},
        },
    },
]


def lorajob(name: str, namespace: str, **changes) -> dict:
    return {**EXAMPLE, "metadata": {"name": name, "namespace": namespace}, "spec": example_spec(**changes)}


def server_verdict(kube, job: dict) -> str | None:
    """None when the API server would create the LoRAJob, else the policy's message."""
    result = kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(job), check=False)
    if result.returncode == 0:
        return None
    assert DENIED in result.stderr, result.stderr
    return result.stderr.split(DENIED, 1)[1].strip()


@pytest.fixture(scope="module")
def governed(kube, installed_release):
    for namespace, labels in ((GOVERNED, f"{TEAM_LABEL}=a"), (UNGOVERNED, "purpose=other")):
        kube.kubectl("create", "namespace", namespace, check=False)
        kube.kubectl("label", "--overwrite", "namespace", namespace, labels)
    kube.apply_documents(POLICIES)
    probe = lorajob("probe", GOVERNED, scheduling__queueName="not-allowed")
    deadline = time.monotonic() + 60
    while server_verdict(kube, probe) is None:  # the admission plugin picks up policy, binding and params
        assert time.monotonic() < deadline, "the ValidatingAdmissionPolicy never started denying"
        time.sleep(0.5)
    stored = json.loads(kube.kubectl("get", "lorajobpolicies", "-o", "json").stdout)["items"]
    labels = json.loads(kube.kubectl("get", "namespace", GOVERNED, "-o", "json").stdout)["metadata"]["labels"]
    yield [policy.LoRAJobPolicy.from_object(p) for p in stored], labels
    kube.kubectl("delete", "lorajobpolicies", *(p["metadata"]["name"] for p in POLICIES), check=False)


CASES = {
    "compliant": {},
    "no-queue-and-no-default-in-that-policy": {"scheduling__queueName": None},
    "queue-not-allowed": {"scheduling__queueName": "other"},
    "topology-not-allowed": {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "2x4"}},
    "machine-not-allowed": {"compute__tpu": {"machineType": "ct5lp-hightpu-4t", "topology": "2x2"}},
    "too-many-slices": {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "2x2", "slices": 3}},
    "chips-at-limit": {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "4x4", "slices": 2}},
    "too-many-chips-3d": {"compute__tpu": {"machineType": "ct5p-hightpu-4t", "topology": "4x4x4"}},
    "output-outside": {"output__baseOutputDirectory": "gs://my-bucket/lorajob-other"},
    "output-prefix-itself": {"output__baseOutputDirectory": "/mnt/team-a"},
    "export-outside": {"export": {"path": "gs://elsewhere/adapter"}},
    "compilation-cache-outside": {"output__compilationCache": "gs://shared/jax-cache"},
    "compilation-cache-inside": {"output__compilationCache": "gs://my-bucket/lorajob/jax-cache"},
    "gpu-ignores-tpu-rules": {"compute": {"backend": "gpu", "gpu": {"accelerator": "nvidia-h100-80gb", "nodes": 2}}},
}


@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_admission_and_operator_agree(kube, governed, changes):
    policies, labels = governed
    job = lorajob("parity", GOVERNED, **changes)
    expected = [v.message for v in policy.violations(policies, labels, api.LoRAJobSpec.model_validate(job["spec"]))]
    verdict = server_verdict(kube, job)
    if not expected:
        assert verdict is None
    else:
        # The API server reports the first failing validation; the operator reports all of them.
        assert verdict in expected, f"server: {verdict!r}\noperator: {expected}"


def test_a_violating_lorajob_is_rejected_naming_the_rule(kube, governed):
    result = kube.kubectl("apply", "-f", "-", input=json.dumps(lorajob("too-big", GOVERNED, compute__tpu={
        "machineType": "ct6e-standard-4t", "topology": "2x2", "slices": 4})), check=False)
    assert result.returncode != 0
    assert 'LoRAJobPolicy "ship-team-limits" rule tpu.maxSlices: spec.compute.tpu.slices is 4; at most 2 slices' in result.stderr
    assert kube.kubectl("get", "lorajob", "too-big", "-n", GOVERNED, check=False).returncode != 0


def test_a_compliant_lorajob_is_created(kube, governed):
    kube.kubectl("apply", "-f", "-", input=json.dumps(lorajob("fits", GOVERNED)))
    stored = json.loads(kube.kubectl("get", "lorajob", "fits", "-n", GOVERNED, "-o", "json").stdout)
    assert "cpuNodePool" not in stored["spec"]["compute"], "policy defaults must never be written into spec"
    kube.kubectl("delete", "lorajob", "fits", "-n", GOVERNED)


def test_namespaces_outside_the_selector_are_not_governed(kube, governed):
    assert server_verdict(kube, lorajob("elsewhere", UNGOVERNED, scheduling__queueName="anything")) is None


TRACKED = {"ship-policy-tracked": "tracked", "ship-policy-tracked-default": "tracked-default"}
"""Namespaces (and their TEAM_LABEL value) governed by TRACKING_POLICIES."""
TRACKING_POLICIES = [
    {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": policy.KIND,
        "metadata": {"name": "ship-tracking-required"},
        "spec": {"namespaceSelector": {"matchLabels": {TEAM_LABEL: "tracked"}}, "tracking": {"required": ["mlflow", "wandb"]}},
    },
    {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": policy.KIND,
        "metadata": {"name": "ship-tracking-default"},
        "spec": {
            "namespaceSelector": {"matchLabels": {TEAM_LABEL: "tracked-default"}},
            "tracking": {"required": ["mlflow"]},
            "defaults": {"mlflow": {"trackingUri": "https://mlflow.example.com"}},
        },
    },
]
MLFLOW = {"trackingUri": "https://mlflow.example.com"}
WANDB = {"project": "gsm8k", "mode": "offline"}


@pytest.fixture(scope="module")
def tracked(kube, installed_release):
    for namespace, team in TRACKED.items():
        kube.kubectl("create", "namespace", namespace, check=False)
        kube.kubectl("label", "--overwrite", "namespace", namespace, f"{TEAM_LABEL}={team}")
    kube.apply_documents(TRACKING_POLICIES)
    probe = lorajob("probe", "ship-policy-tracked")
    deadline = time.monotonic() + 60
    while server_verdict(kube, probe) is None:
        assert time.monotonic() < deadline, "the ValidatingAdmissionPolicy never started denying"
        time.sleep(0.5)
    stored = json.loads(kube.kubectl("get", "lorajobpolicies", "-o", "json").stdout)["items"]
    yield [policy.LoRAJobPolicy.from_object(p) for p in stored]
    kube.kubectl("delete", "lorajobpolicies", *(p["metadata"]["name"] for p in TRACKING_POLICIES), check=False)


@pytest.mark.parametrize("namespace, tracking", [
    ("ship-policy-tracked", {}),
    ("ship-policy-tracked", {"mlflow": MLFLOW}),
    ("ship-policy-tracked", {"wandb": WANDB}),
    ("ship-policy-tracked", {"mlflow": MLFLOW, "wandb": WANDB}),
    ("ship-policy-tracked-default", {}),  # the policy's default MLflow server meets its requirement
], ids=["none", "mlflow-only", "wandb-only", "both", "mlflow-by-default"])
def test_admission_and_operator_agree_on_required_trackers(kube, tracked, namespace, tracking):
    job = lorajob("tracking", namespace, tracking=tracking)
    labels = json.loads(kube.kubectl("get", "namespace", namespace, "-o", "json").stdout)["metadata"]["labels"]
    expected = [v.message for v in policy.violations(tracked, labels, api.LoRAJobSpec.model_validate(job["spec"]))]
    verdict = server_verdict(kube, job)
    assert (verdict is None) == (not expected) and (verdict is None or verdict in expected), (verdict, expected)


@pytest.mark.cluster  # the status (type-checking) controller runs in kube-controller-manager
def test_policy_expressions_type_check_cleanly(sim_cluster, kube, installed_release, governed):
    name = "lorajob-policy"
    deadline = time.monotonic() + 60
    while True:
        vap = json.loads(kube.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout)
        status = vap.get("status", {})
        if status.get("observedGeneration") == vap["metadata"]["generation"]:
            break
        assert time.monotonic() < deadline, f"type checking never ran: {status}"
        time.sleep(1)
    assert status.get("typeChecking", {}).get("expressionWarnings", []) == []
