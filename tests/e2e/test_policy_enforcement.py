"""LoRAJobPolicy enforced by the operator at reconcile time on the simulated cluster. The chart's
ValidatingAdmissionPolicy may be installed in the same API server (tests/ship installs it for the
session), so a violating LoRAJob is created before its policy exists, as one created before a policy
was tightened: admission lets it through whatever ran before, and the operator is the only guard."""

from __future__ import annotations

import pytest
import yaml
from lorajobs import condition, sample

from lorajob_operator import api, names, policy

pytestmark = pytest.mark.cluster
TEAM_QUEUE = "team-queue"


@pytest.fixture
def apply_policy(sim_cluster, namespace):
    """Applies LoRAJobPolicies that govern only the test's namespace; deletes them afterwards."""
    names: list[str] = []

    def apply(suffix: str, spec: dict) -> str:
        name = f"{namespace}-{suffix}"
        body = {
            "apiVersion": f"{api.GROUP}/{api.VERSION}",
            "kind": policy.KIND,
            "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}, **spec},
        }
        sim_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))
        names.append(name)
        return name

    yield apply
    for name in names:
        sim_cluster.kubectl("delete", f"{policy.PLURAL}.{api.GROUP}", name, "--ignore-not-found", "--wait=false")


def test_a_lorajob_on_a_disallowed_tpu_fails_with_policy_violation_and_creates_nothing(lorajobs, start_operator, apply_policy):
    lorajobs.apply(sample("too-big"))
    name = apply_policy("v5e-only", {"tpu": {"allowed": [{"machineType": "ct5lp-hightpu-4t"}]}})
    start_operator()  # only now: it must see the policy before it starts the first step

    failed = lorajobs.wait_phase("too-big", "Failed", timeout=60)

    reason = condition(failed, "Failed")
    assert reason["reason"] == policy.VIOLATION_REASON
    assert reason["message"].startswith(f'LoRAJobPolicy "{name}" rule tpu.allowed: TPU ct6e-standard-4t 4x4')
    assert failed["status"]["resolved"]["policies"] == [name]
    assert [js for js in lorajobs.jobsets() if js["metadata"]["labels"].get(names.LABEL_RUN) == "too-big"] == []
    assert [e["reason"] for e in lorajobs.events("too-big")] == ["Failed"]


def test_the_policy_default_queue_labels_the_jobset_and_is_recorded_in_status(sim_cluster, namespace, lorajobs, operator, apply_policy):
    sim_cluster.create_namespace_with_queue(namespace, TEAM_QUEUE)
    name = apply_policy("defaults", {"queues": {"default": TEAM_QUEUE}})
    body = sample("defaulted")
    del body["spec"]["scheduling"]["queueName"]
    lorajobs.apply(body)

    convert = lorajobs.wait_until(
        lambda: next((js for js in lorajobs.jobsets() if js["metadata"]["labels"].get(names.LABEL_RUN) == "defaulted"), None),
        "the convert JobSet is created",
    )
    assert convert["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == TEAM_QUEUE
    recorded = lorajobs.wait(
        "defaulted", lambda obj: obj.get("status", {}).get("resolved", {}).get("queueName") == TEAM_QUEUE,
        "status.resolved.queueName", timeout=30,
    )
    assert recorded["status"]["resolved"]["policies"] == [name]
    assert "queueName" not in recorded["spec"]["scheduling"]  # the spec is never written
    assert recorded["metadata"]["generation"] == 1
    header, row = lorajobs.kubectl("get", "lj", "defaulted").stdout.splitlines()[:2]
    start = header.index("QUEUE")  # columns are aligned; empty ones (PROGRESS, before training) print nothing
    assert row[start:].split()[0] == TEAM_QUEUE  # the column shows the queue in force
