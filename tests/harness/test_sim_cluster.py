"""The simulated cluster really queues, schedules, runs and fails TPU JobSets through Kueue and JobSet."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
import yaml

from lorajob_devcluster import RUN_DURATION_ANNOTATION, SLOW_IMAGE, condition_is_true, failing_image, wait_for
from lorajob_devcluster.topology import (
    ACCELERATOR_LABEL,
    CLUSTER_QUEUE_NAME,
    CPU_NP,
    NODEPOOL_LABEL,
    QUEUE_NAME_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    TPU_V6E_4X4,
)

pytestmark = pytest.mark.cluster
NAMESPACE = "harness-sim"
TIMEOUT = 90.0


@pytest.fixture(scope="module")
def queue_namespace(sim_cluster):
    return sim_cluster.create_namespace_with_queue(NAMESPACE)


def tpu_jobset(name: str, image: str = "sim.lorajob.dev/train", annotations: dict | None = None) -> dict:
    """A v6e-16 JobSet shaped like a GKE multi-host TPU job: 4 hosts x 4 chips on a 4x4 slice."""
    hosts, chips = TPU_V6E_4X4.node_count, TPU_V6E_4X4.tpu_chips_per_node
    resources = {TPU_RESOURCE: str(chips), "cpu": "1", "memory": "1Gi"}
    pod_spec = {
        "restartPolicy": "Never",
        "nodeSelector": {ACCELERATOR_LABEL: TPU_V6E_4X4.tpu_accelerator, TOPOLOGY_LABEL: TPU_V6E_4X4.tpu_topology},
        "containers": [{"name": "main", "image": image, "resources": {"requests": resources, "limits": resources}}],
    }
    job_spec = {
        "parallelism": hosts,
        "completions": hosts,
        "backoffLimit": 0,
        "completionMode": "Indexed",
        "template": {"metadata": {"annotations": annotations or {}}, "spec": pod_spec},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {QUEUE_NAME_LABEL: "lorajob"}},
        "spec": {"failurePolicy": {"maxRestarts": 0}, "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job_spec}}]},
    }


def create(sim_cluster, manifest: dict) -> dict:
    """Create and return the object as stored, i.e. after the mutating webhooks ran."""
    return json.loads(sim_cluster.kubectl("create", "-o", "json", "-f", "-", input=yaml.safe_dump(manifest)).stdout)


def jobset_condition(sim_cluster, name: str, condition: str) -> bool:
    return condition_is_true(sim_cluster.get_json("jobsets.jobset.x-k8s.io", name, "-n", NAMESPACE), condition)


def workload_of(sim_cluster, jobset_name: str) -> dict | None:
    for workload in sim_cluster.get_json("workloads.kueue.x-k8s.io", "-n", NAMESPACE)["items"]:
        if any(o["kind"] == "JobSet" and o["name"] == jobset_name for o in workload["metadata"].get("ownerReferences", [])):
            return workload
    return None


def workload_admitted(sim_cluster, jobset_name: str) -> bool:
    return condition_is_true(workload_of(sim_cluster, jobset_name) or {}, "Admitted")


def quota_pending(workload: dict) -> dict | None:
    """Kueue's QuotaReserved=False/Pending condition on a Workload it tried and could not fit."""
    return next(
        (c for c in workload.get("status", {}).get("conditions", [])
         if c["type"] == "QuotaReserved" and c["status"] == "False" and c["reason"] == "Pending"),
        None,
    )


def jobset_pods(sim_cluster, name: str) -> list[dict]:
    return sim_cluster.get_json("pods", "-n", NAMESPACE, "-l", f"jobset.sigs.k8s.io/jobset-name={name}")["items"]


def bound_pods(sim_cluster, name: str, count: int) -> list[dict] | None:
    pods = jobset_pods(sim_cluster, name)
    return pods if len(pods) == count and all(p["spec"].get("nodeName") for p in pods) else None


def delete_jobset(sim_cluster, name: str) -> None:
    sim_cluster.kubectl("delete", "jobsets.jobset.x-k8s.io", name, "-n", NAMESPACE, "--wait=true", "--timeout=60s")


def test_queued_tpu_jobset_is_admitted_scheduled_on_tpu_nodes_and_completes(sim_cluster, queue_namespace):
    stored = create(sim_cluster, tpu_jobset("train-ok"))
    assert stored["spec"]["suspend"] is True, "Kueue's webhook must suspend a queued JobSet at creation"

    wait_for(lambda: workload_admitted(sim_cluster, "train-ok"), TIMEOUT, "Workload of train-ok admitted")
    hosts = TPU_V6E_4X4.node_count
    pods = wait_for(lambda: bound_pods(sim_cluster, "train-ok", hosts), TIMEOUT, f"{hosts} pods of train-ok bound")
    assert {p["spec"]["nodeName"] for p in pods} == set(TPU_V6E_4X4.node_names())
    for pod in pods:
        assert any(t["key"] == TPU_RESOURCE for t in pod["spec"].get("tolerations", [])), "flavor toleration injected"

    wait_for(lambda: jobset_condition(sim_cluster, "train-ok", "Completed"), TIMEOUT, "JobSet train-ok Completed")
    finished = jobset_pods(sim_cluster, "train-ok")
    assert {p["status"]["phase"] for p in finished} == {"Succeeded"}
    delete_jobset(sim_cluster, "train-ok")


def test_second_tpu_jobset_waits_for_quota_until_the_first_is_gone(sim_cluster, queue_namespace):
    create(sim_cluster, tpu_jobset("first", image=SLOW_IMAGE))
    wait_for(lambda: workload_admitted(sim_cluster, "first"), TIMEOUT, "Workload of first admitted")
    create(sim_cluster, tpu_jobset("second"))
    wait_for(lambda: workload_of(sim_cluster, "second"), TIMEOUT, "Workload of second created")

    # Kueue has tried `second` and said why it waits: QuotaReserved=False, Pending, with the missing quota.
    pending = wait_for(lambda: quota_pending(workload_of(sim_cluster, "second") or {}), TIMEOUT, "Kueue's verdict on second")
    assert "couldn't assign flavors" in pending["message"] or "insufficient" in pending["message"], pending
    assert not workload_admitted(sim_cluster, "second")
    assert sim_cluster.get_json("jobsets.jobset.x-k8s.io", "second", "-n", NAMESPACE)["spec"]["suspend"] is True
    assert not jobset_condition(sim_cluster, "first", "Completed"), "the slow image must still be running"

    delete_jobset(sim_cluster, "first")
    wait_for(lambda: workload_admitted(sim_cluster, "second"), TIMEOUT, "Workload of second admitted after first is gone")
    wait_for(lambda: jobset_condition(sim_cluster, "second", "Completed"), TIMEOUT, "JobSet second Completed")
    delete_jobset(sim_cluster, "second")


def test_failing_image_fails_the_jobset_with_its_exit_code(sim_cluster, queue_namespace):
    create(sim_cluster, tpu_jobset("train-fails", image=failing_image(3)))
    wait_for(lambda: jobset_condition(sim_cluster, "train-fails", "Failed"), TIMEOUT, "JobSet train-fails Failed")
    failed = [p for p in jobset_pods(sim_cluster, "train-fails") if p["status"]["phase"] == "Failed"]
    assert failed
    terminated = failed[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (3, "Error")
    delete_jobset(sim_cluster, "train-fails")


def with_coordinator(manifest: dict) -> dict:
    manifest["spec"]["coordinator"] = {"replicatedJob": "workers", "jobIndex": 0, "podIndex": 0}
    return manifest


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        # <name>-workers-0 exceeds 63 characters.
        (tpu_jobset("j" * 60), "job names generated for this JobSet will exceed 63 characters"),
        # The coordinator label <name>-workers-0-0.<subdomain = name> exceeds 63 characters.
        (with_coordinator(tpu_jobset("c" * 30)), "coordinator label"),
    ],
    ids=["job-name", "coordinator-label"],
)
def test_jobset_webhook_rejects_names_too_long_for_generated_labels(sim_cluster, queue_namespace, manifest, expected):
    result = sim_cluster.kubectl("create", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert result.returncode != 0
    assert 'admission webhook "vjobset.kb.io" denied the request' in result.stderr
    assert expected in result.stderr
    listed = sim_cluster.kubectl("get", "jobsets.jobset.x-k8s.io", "-n", NAMESPACE, "-o", "name").stdout
    assert manifest["metadata"]["name"] not in listed


def test_kueue_converts_between_its_served_versions_through_the_loopback_webhook(sim_cluster):
    # Stored as v1beta2 with conversion strategy Webhook: a v1beta1 read fails unless Kueue's /convert answers.
    old = sim_cluster.get_json(f"clusterqueues.v1beta1.kueue.x-k8s.io/{CLUSTER_QUEUE_NAME}")
    assert old["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    assert old["spec"]["resourceGroups"][0]["coveredResources"] == ["cpu", "memory", TPU_RESOURCE]


def cpu_jobset(name: str, run_duration: str) -> dict:
    """A CPU-only queued JobSet (like the convert/export phases): no nodeSelector, no TPU request."""
    resources = {"cpu": "2", "memory": "4Gi"}
    pod_spec = {"restartPolicy": "Never", "containers": [{"name": "main", "image": "sim.lorajob.dev/convert", "resources": {"requests": resources}}]}
    template = {"metadata": {"annotations": {RUN_DURATION_ANNOTATION: run_duration}}, "spec": pod_spec}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {QUEUE_NAME_LABEL: "lorajob"}},
        "spec": {"replicatedJobs": [{"name": "convert", "replicas": 1, "template": {"spec": {"backoffLimit": 0, "template": template}}}]},
    }


def test_cpu_jobset_lands_on_cpu_nodes_and_runs_for_its_annotated_duration(sim_cluster, queue_namespace):
    create(sim_cluster, cpu_jobset("convert", run_duration="4s"))
    wait_for(lambda: jobset_condition(sim_cluster, "convert", "Completed"), TIMEOUT, "JobSet convert Completed")
    (pod,) = jobset_pods(sim_cluster, "convert")
    assert pod["spec"]["nodeName"] in CPU_NP.node_names(), "CPU flavor comes first, so CPU-only pods avoid TPU hosts"
    assert pod["spec"]["nodeSelector"] == {NODEPOOL_LABEL: CPU_NP.name}
    started = datetime.fromisoformat(pod["status"]["startTime"])
    finished = datetime.fromisoformat(pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"])
    assert (finished - started).total_seconds() >= 4
    delete_jobset(sim_cluster, "convert")
