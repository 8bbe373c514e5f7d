"""What exists, as small frozen values: `observe_*` turn a LoRAJob's child JobSets, their Workloads and failed pods
(API objects, dicts) into `ChildState`s, and `Observed` holds everything one reconcile pass decides from."""

from __future__ import annotations

import dataclasses
import functools
from datetime import datetime
from collections.abc import Mapping

from lorajob_operator import api, policy
from lorajob_operator.names import (
    COMPLETION_INDEX_LABEL, JOB_INDEX_LABEL, JOBSET_NAME_LABEL, LABEL_ATTEMPT, LABEL_PHASE, REPLICATED_JOB_LABEL,
    TRAINER_CONTAINER,
)
from lorajob_operator.reconcile.conditions import find_condition, is_true, parse_time
from lorajob_operator.reconcile.kueue import QueuePosition, WorkloadState, observe_workload
from lorajob_operator.settings import RenderSettings
from lorajob_trainer.contract import exit_codes
from lorajob_trainer.contract.records import ProgressRecord, last_progress


DISRUPTED_POD_REASONS = ("Evicted", "NodeLost", "Preempting", "Shutdown", "Terminated", "UnexpectedAdmissionError")
"""status.reason of a pod the node or kubelet stopped (the pod's DisruptionTarget condition says the same, when set)."""


@dataclasses.dataclass(frozen=True)
class ContainerFailure:
    pod: str
    container: str
    exit_code: int
    reason: str
    message: str

    def describe(self) -> str:
        text = f"pod {self.pod} container {self.container} exited with code {self.exit_code}"
        if self.reason:
            text += f" ({self.reason})"
        return text + (f": {self.message}" if self.message else "")


@dataclasses.dataclass(frozen=True)
class ChildState:
    name: str
    phase: str
    attempt: int
    owned: bool
    """Controlled by this LoRAJob (same name, other owner: a name clash)."""
    deleting: bool
    completed: bool
    failed: bool
    failed_at: datetime | None
    failure_reason: str
    failure_message: str
    suspended: bool
    workload: WorkloadState | None = None
    container_failure: ContainerFailure | None = None
    disruption: str = ""
    """Set when the cluster stopped one of its pods (see observe_disruption)."""
    uid: str = ""
    lead_pod_selector: str | None = None
    """Label selector of the pod whose trainer is process 0 (None: no pod runs the trainer)."""
    created: str | None = None
    """metadata.creationTimestamp."""

    @property
    def active(self) -> bool:
        return self.owned and not (self.deleting or self.completed or self.failed)

    @property
    def finished(self) -> bool:
        return self.completed or self.failed


@dataclasses.dataclass(frozen=True)
class Observed:
    name: str
    namespace: str
    generation: int
    spec: api.LoRAJobSpec | None
    spec_errors: tuple[str, ...]
    """Why the spec cannot be used (it bypassed or predates the CRD's rules)."""
    status: dict
    children: dict[str, ChildState]
    problems: tuple[tuple[str, str], ...]
    """(reason, message) of operator-visible spec problems, e.g. a missing Secret."""
    cluster_queue: str | None
    """The ClusterQueue behind the effective queue name (from the LocalQueue)."""
    now: datetime
    policies: tuple[policy.LoRAJobPolicy, ...] = ()
    """Every LoRAJobPolicy in the cluster (the namespace's labels pick the ones that govern it)."""
    namespace_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    render: RenderSettings = RenderSettings()
    """The operator's own defaults, used where neither the LoRAJob nor a policy sets a value."""
    train_log: str | None = None
    """The tail of the lead trainer's log when this pass read it (see `train_log_wanted`)."""
    checks_log: str | None = None
    """The check or convert pod's log when this pass read it, for the checks' figures (see `checks_log_wanted`)."""
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The LoRAJob's links to its tracker runs (names.tracker_link; the caches keep no other annotation)."""

    @functools.cached_property
    def progress_record(self) -> ProgressRecord | None:
        """The last progress record in this pass's train log (None: the log was not read, or holds none)."""
        return last_progress(self.train_log) if self.train_log else None

    @property
    def defaults(self) -> policy.ResolvedDefaults:
        return policy.resolve_defaults(self.policies, self.namespace_labels, self.spec)

    @property
    def effective_spec(self) -> api.LoRAJobSpec:
        return effective_spec(self.spec, self.defaults)


def effective_spec(spec: api.LoRAJobSpec, defaults: policy.ResolvedDefaults) -> api.LoRAJobSpec:
    """The spec the steps run with: the LoRAJob's values, else the policies' defaults (a copy; never written back)."""
    return spec.model_copy(update={
        "scheduling": spec.scheduling.model_copy(update={"queue_name": defaults.queue_name}),
        "compute": spec.compute.model_copy(update={"cpu_node_pool": defaults.cpu_node_pool}),
        "images": defaults.images,
        "tracking": spec.tracking.model_copy(update={"mlflow": defaults.mlflow}),
    })


def resolved_status(spec: api.LoRAJobSpec, defaults: policy.ResolvedDefaults, settings: RenderSettings) -> dict:
    """status.resolved: what the steps run with, the operator's settings filling what nobody set."""
    images = {
        field: getattr(defaults.images, field) or getattr(settings.images, field) for field in api.ImagesSpec.model_fields
    }
    resolved = api.Resolved(
        queue_name=defaults.queue_name,
        cpu_node_pool=defaults.cpu_node_pool or settings.cpu_node_pool,
        images=api.ResolvedImages(**images),
        mlflow_tracking_uri=defaults.mlflow.tracking_uri if defaults.mlflow else None,
        policies=list(defaults.policies),
    )
    return resolved.model_dump(by_alias=True, exclude_none=True)


def observe_container_failure(pods: list[dict]) -> ContainerFailure | None:
    """The container that failed the step: the first non-zero exit, preferring real errors to SIGTERM."""
    failures = []
    for pod in pods:
        for status in pod.get("status", {}).get("containerStatuses") or []:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if terminated.get("exitCode", 0) != 0:
                failures.append((
                    terminated["exitCode"] == exit_codes.TERMINATED_BY_SIGTERM,
                    terminated.get("finishedAt") or "",
                    ContainerFailure(
                        pod["metadata"]["name"], status["name"], terminated["exitCode"],
                        terminated.get("reason", ""), _last_line(terminated.get("message") or "")[-300:],
                    ),
                ))
    return min(failures, key=lambda f: (f[0], f[1]))[2] if failures else None


def _last_line(text: str) -> str:
    """The termination message's last line: the trainer's own error line (the rest is the log before it)."""
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


def observe_disruption(pods: list[dict]) -> str:
    """Why the cluster stopped one of these pods ("" when none was disrupted): its DisruptionTarget
    condition's reason (preemption, eviction, node lost) or the pod's status.reason (kubelet eviction)."""
    for pod in pods:
        target = find_condition(pod, "DisruptionTarget")
        if target is not None and target.get("status") == "True":
            return f"pod {pod['metadata']['name']}: {target.get('reason') or 'DisruptionTarget'}"
        reason = pod.get("status", {}).get("reason") or ""
        if reason in DISRUPTED_POD_REASONS:
            return f"pod {pod['metadata']['name']}: {reason}"
    return ""


def lead_pod_selector(jobset: dict) -> str | None:
    """The pod whose trainer is process 0: pod 0 of Job 0 of the replicated job that runs the trainer
    container (the Pathways head; the first worker on mcjax and gpu)."""
    for replicated in jobset.get("spec", {}).get("replicatedJobs") or []:
        containers = replicated["template"]["spec"]["template"]["spec"].get("containers") or []
        if any(container.get("name") == TRAINER_CONTAINER for container in containers):
            return ",".join((
                f"{JOBSET_NAME_LABEL}={jobset['metadata']['name']}",
                f"{REPLICATED_JOB_LABEL}={replicated['name']}",
                f"{JOB_INDEX_LABEL}=0",
                f"{COMPLETION_INDEX_LABEL}=0",
            ))
    return None


def observe_child(
    jobset: dict, owner_uid: str, workload: dict | None = None, failed_pods: list[dict] | None = None,
    queue: QueuePosition | None = None,
) -> ChildState:
    metadata = jobset["metadata"]
    labels = metadata.get("labels") or {}
    failed = find_condition(jobset, "Failed")
    is_failed = failed is not None and failed.get("status") == "True"
    owners = metadata.get("ownerReferences") or []
    return ChildState(
        name=metadata["name"],
        phase=labels.get(LABEL_PHASE, ""),
        attempt=int(labels.get(LABEL_ATTEMPT, "0")),
        owned=any(ref.get("uid") == owner_uid and ref.get("controller") for ref in owners),
        deleting=bool(metadata.get("deletionTimestamp")),
        completed=is_true(jobset, "Completed"),
        failed=is_failed,
        failed_at=parse_time(failed.get("lastTransitionTime")) if is_failed else None,
        failure_reason=failed.get("reason", "") if is_failed else "",
        failure_message=failed.get("message", "") if is_failed else "",
        suspended=bool(jobset.get("spec", {}).get("suspend")) or is_true(jobset, "Suspended"),
        workload=observe_workload(workload, queue) if workload else None,
        container_failure=observe_container_failure(failed_pods or []),
        disruption=observe_disruption(failed_pods or []),
        uid=metadata.get("uid", ""),
        lead_pod_selector=lead_pod_selector(jobset),
        created=metadata.get("creationTimestamp"),
    )
