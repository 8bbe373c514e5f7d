"""Small builders of LoRAJob objects, JobSets and Workloads (as the API server returns them) for tests."""

from __future__ import annotations

import copy

from lorajob_operator import api, caches, jobsets, validation
from lorajob_operator.settings import RenderSettings

NAMESPACE = "team-a"
UID = "0b9f7f0e-1111-4222-8333-944445555666"

_BASE_SPEC = {
    "model": {"name": "qwen3-0.6b", "huggingFace": "Qwen/Qwen3-0.6B"},
    "credentials": {"huggingFaceToken": {"name": "hf-token"}},
    "dataset": {"name": "openai/gsm8k", "dataDir": "main", "columns": ["question", "answer"]},
    "training": {"steps": 20},
    "compute": {"backend": "pathways", "tpu": {"machineType": "ct6e-standard-4t", "topology": "4x4"}},
    "output": {"baseOutputDirectory": "gs://bucket/runs"},
    "scheduling": {"queueName": "lorajob"},
}
TPU = {"machineType": "ct6e-standard-4t", "topology": "4x4"}
GPU = {"accelerator": "nvidia-h200-141gb", "gpusPerNode": 8, "nodes": 2}


def spec_dict(**overrides) -> dict:
    """The base spec with top-level sections replaced (None removes one)."""
    spec = copy.deepcopy(_BASE_SPEC)
    for key, value in overrides.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    return spec


def compute(backend: str, slices: int = 1, topology: str = "4x4") -> dict:
    if backend == "gpu":
        return {"backend": "gpu", "gpu": dict(GPU)}
    return {"backend": backend, "tpu": {**TPU, "topology": topology, "slices": slices}}


def lorajob(name: str = "qwen3-gsm8k", spec: dict | None = None, status: dict | None = None, **metadata) -> dict:
    body = {
        "apiVersion": f"{api.GROUP}/{api.VERSION}",
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": UID, "generation": 1, **metadata},
        "spec": spec if spec is not None else spec_dict(),
    }
    if status is not None:
        body["status"] = status
    return body


def parsed(body: dict) -> api.LoRAJobSpec:
    spec, errors = validation.parse_spec(body)
    assert spec is not None, errors
    return spec


def cluster_view(*bodies: dict, namespace_labels: dict | None = None) -> caches.Caches:
    """Watch caches holding `bodies` and what the base spec names: its namespace, the hf-token Secret
    (key HF_TOKEN) and the lorajob LocalQueue (of ClusterQueue cq-tpu)."""
    view = caches.Caches([NAMESPACE])
    stores = view.stores
    for body in bodies:
        stores[caches.LORAJOBS].upsert(body)
    stores[caches.LOCAL_QUEUES].upsert({"metadata": {"name": "lorajob", "namespace": NAMESPACE}, "spec": {"clusterQueue": "cq-tpu"}})
    stores[caches.NAMESPACES].upsert({"metadata": {"name": NAMESPACE, "labels": namespace_labels or {}}})
    return view


def owner(body: dict) -> jobsets.Owner:
    return jobsets.Owner(body["metadata"]["name"], body["metadata"]["namespace"], body["metadata"]["uid"])


def condition(condition_type: str, status: str = "True", reason: str = "", message: str = "", at: str = "2026-01-01T00:00:00Z") -> dict:
    return {"type": condition_type, "status": status, "reason": reason, "message": message, "lastTransitionTime": at}


def jobset(
    body: dict, phase: str, *, attempt: int = 0, conditions: list[dict] | None = None,
    suspend: bool = False, deleting: bool = False, owner_uid: str | None = None, uid: str = "js-uid",
) -> dict:
    """A child JobSet as the API server would return it (rendered, plus uid and status)."""
    obj = jobsets.render_phase(phase, parsed(body), owner(body), RenderSettings(), attempt)
    obj["metadata"]["uid"] = uid
    if owner_uid is not None:
        obj["metadata"]["ownerReferences"][0]["uid"] = owner_uid
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj["spec"]["suspend"] = suspend
    obj["status"] = {"conditions": conditions or []}
    return obj


def workload(
    *conditions: dict, cluster_queue: str | None = None, requests: dict[str, dict[str, str]] | None = None,
    name: str = "jobset-x-12345", created: str = "2026-01-01T00:00:00Z", queue_name: str = "lorajob",
    priority: int | None = None,
) -> dict:
    """A Kueue Workload; `requests`: status.resourceRequests as {pod set: {resource: total quantity}}."""
    status: dict = {"conditions": list(conditions)}
    if cluster_queue:
        status["admission"] = {"clusterQueue": cluster_queue}
    if requests:
        status["resourceRequests"] = [{"name": pod_set, "resources": resources} for pod_set, resources in requests.items()]
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created},
        "spec": {"queueName": queue_name, "priority": priority},
        "status": status,
    }


def failed_pod(name: str, container: str, exit_code: int, finished_at: str = "2026-01-01T00:00:00Z") -> dict:
    return {
        "metadata": {"name": name},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": container, "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "finishedAt": finished_at}}}
            ],
        },
    }
