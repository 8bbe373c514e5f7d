"""The reconcile decision: what exists -> what the LoRAJob's status is and what to do next (pure).

Level-based: every pass recomputes the phase from the child JobSets that exist, their conditions
and the Kueue Workloads that own their quota, so a restarted operator picks up where the last one
stopped. `observe_*` turn API objects (dicts) into small frozen values; `decide` turns those into
a `Decision` that `kube.apply` carries out (status first, then deletions, creations and events).

Mechanisms, in one place:

* Steps run in order; a step's JobSet is created only when every earlier step's JobSet is Completed.
  Children are never given a TTL: a completed child is the record that its step is done.
* Kueue is never fought: a JobSet is created with its queue label and then only read (suspend and
  pod templates belong to Kueue). Its Workload (label kueue.x-k8s.io/job-uid) says whether the step
  is queued, admitted or evicted. A queued step's message gives its place among the pending Workloads of
  its ClusterQueue, in Kueue's order, worked out from the watched Workloads (`caches.queue_positions`), and
  what it waits for (the resources Kueue's pending message names, with the Workload's requests of them).
* Retries: a failed try N of a step (label lorajob.dev/attempt) is deleted once its backoff has
  passed and `status.restarts` records try N+1; the next pass, seeing no child, creates try N+1
  under the same name. Failures are classed (`failure_kind`): a user error (the trainer's documented
  exit codes, lorajob_trainer.exit_codes) fails the LoRAJob at once with the trainer's message; an
  infrastructure failure (a pod disrupted: evicted, preempted, node lost; a container killed by a
  signal; the trainer stopped by SIGTERM) is retried up to `scheduling.infrastructureRetryLimit`
  times, counted in `status.infrastructureRestarts`; anything else up to `scheduling.retryLimit`.
* Stall watchdog (opt-in, `scheduling.progressDeadlineSeconds`): a running train step whose step has not
  changed for that long, counted from status.progress.advancedTime (when it started running or its step
  last changed), is restarted at once as an infrastructure failure with reason Stalled.
* suspend: the running step's JobSet is deleted (foreground, so its pods are gone before a new one
  can take its name) and recreated on resume; training restarts from its latest checkpoint.
* activeDeadlineSeconds counts from the later of startTime and the last resume.
* ttlSecondsAfterFinished deletes the LoRAJob; its children follow through their ownerReferences.
* Succeeded and Failed are final.
* LoRAJobPolicy: the policies governing the namespace are checked until the first step's JobSet exists
  (status.startTime unset); a violation fails the LoRAJob with reason PolicyViolation and creates
  nothing. A policy changed later does not stop a running LoRAJob (as admission would not): its
  steps keep going. The policies' defaults (queue, images, CPU node pool) are resolved on every pass
  into an in-memory copy of the spec (`effective_spec`) that the steps are rendered from, and
  recorded in status.resolved; the object's spec is never written.
* Training progress: the trainer's lead process prints a progress line per step to stdout; the tail
  of its pod's log (read by kube.py while the train step runs, and once after it finished) is lifted
  into status.progress. Best effort: it never changes the phase, and a log that is missing or holds
  no readable line keeps the progress already recorded.
* Data and plan figures: the data check and the fit check (the check step, or first in the convert step) print
  one data line and (TPU backends) one plan line; the completed step's pod log is read once (on a resync
  pass, while status.data is unset) and the lines lifted into status.data and status.plan.
* Evaluation (spec.evaluation): the train step evaluates base and adapter after its last step (progress state
  evaluating, which is not final, so the log is read again after the step ends) and prints one evaluation line,
  lifted into status.evaluation. The export gate is the export step's: it exits NoImprovement (a user error, so
  the LoRAJob fails with the trainer's message, both scores in it) before writing anything.
"""

from __future__ import annotations

import dataclasses
import math
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Mapping

from lorajob_operator import api, policy, rules
from lorajob_operator.render import (
    JOB_INDEX_LABEL, JOBSET_NAME_LABEL, LABEL_ATTEMPT, LABEL_PHASE, REPLICATED_JOB_LABEL, TRAINER_CONTAINER, run_name,
    run_paths,
)
from lorajob_operator.settings import ReconcileSettings, RenderSettings
from lorajob_trainer import exit_codes
from lorajob_trainer.contract import (
    EVALUATING, FINISHED_STATES, STOPPED_EARLY, CheckpointRecord, ProgressRecord, RunLayout, choose_checkpoint,
    last_data, last_evaluation, last_plan, last_progress,
)

RUNNING_PHASE = {step: api.Phase(phase) for step, phase in rules.PHASE_WHILE_RUNNING.items()}
TERMINAL_PHASES = (api.Phase.Succeeded.value, api.Phase.Failed.value)
STALLED = "Stalled"
"""Reason of a train step restarted (or the LoRAJob failed) by the stall watchdog."""
# Labels JobSet and the Job controller put on every pod (with render.JOB_INDEX_LABEL): which JobSet,
# replicated job and pod of its Job it is.
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
DISRUPTED_POD_REASONS = ("Evicted", "NodeLost", "Preempting", "Shutdown", "Terminated", "UnexpectedAdmissionError")
"""status.reason of a pod the node or kubelet stopped (the pod's DisruptionTarget condition says the same, when set)."""


# --- What exists -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class QueuePosition:
    """Where a pending Workload stands among the pending Workloads of its ClusterQueue, in Kueue's order."""

    position: int
    """1 for the Workload Kueue considers next."""
    namespaces: tuple[str, ...] = ()
    """The namespaces whose Workloads were counted when the operator watches only some (empty: all)."""


@dataclasses.dataclass(frozen=True)
class WorkloadState:
    name: str
    quota_reserved: bool
    admitted: bool
    cluster_queue: str | None
    """The ClusterQueue that admitted it (None while pending)."""
    pending_reason: str
    pending_message: str
    evicted_reason: str | None
    """Set while an eviction (preemption, deactivation, ...) is in effect."""
    evicted_message: str
    requests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What its pod sets request in all, by resource (Kueue's status.resourceRequests of a pending Workload)."""
    short_of: tuple[tuple[str, str], ...] = ()
    """(resource, flavor) pairs whose quota Kueue's pending message says is used up, in its order."""
    queue: QueuePosition | None = None


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
        policies=list(defaults.policies),
    )
    return resolved.model_dump(by_alias=True, exclude_none=True)


def parse_time(value: str | None) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, `Z`), or None."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: datetime) -> str:
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(obj: dict, condition_type: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == condition_type), None)


def _is_true(obj: dict, condition_type: str) -> bool:
    condition = _condition(obj, condition_type)
    return condition is not None and condition.get("status") == "True"


# Kueue's flavor assigner: "insufficient unused quota [in cohort] for <resource> in flavor <flavor>, <n> more needed"
# (quota in use by others: it may free up), "insufficient quota for <resource> in flavor <flavor>, ..." (never enough).
_QUOTA_IN_USE = re.compile(r"insufficient unused quota (?:in cohort )?for (\S+) in flavor ([^\s,;]+), \S+ more needed")
_ANY_QUOTA = re.compile(r"quota (?:in cohort )?for (\S+) in flavor ([^\s,;]+)")


def short_of(pending_message: str) -> tuple[tuple[str, str], ...]:
    """The (resource, flavor) pairs Kueue's pending message names: those whose quota is in use, else any."""
    pairs = _QUOTA_IN_USE.findall(pending_message) or _ANY_QUOTA.findall(pending_message)
    return tuple(dict.fromkeys(pairs))


def _quantity_text(value: Decimal) -> str:
    if value != value.to_integral_value():
        return str(value.normalize())
    for suffix, size in (("Gi", 2**30), ("Mi", 2**20)):
        if value >= size and value % size == 0:
            return f"{int(value) // size}{suffix}"
    return str(int(value))


def total_requests(pod_set_requests: list[dict]) -> dict[str, str]:
    """status.resourceRequests (one entry per pod set, totals of its pods) summed by resource."""
    # Imported here: `kubernetes.utils` loads the whole client, which `lorajob render` and `validate` never need.
    from kubernetes.utils.quantity import parse_quantity  # noqa: PLC0415

    totals: dict[str, Decimal] = {}
    for pod_set in pod_set_requests:
        for resource, quantity in (pod_set.get("resources") or {}).items():
            totals[resource] = totals.get(resource, Decimal(0)) + parse_quantity(quantity)
    return {resource: _quantity_text(total) for resource, total in totals.items()}


def observe_workload(workload: dict, queue: QueuePosition | None = None) -> WorkloadState:
    quota = _condition(workload, "QuotaReserved") or {}
    evicted = _condition(workload, "Evicted")
    active_eviction = evicted is not None and evicted.get("status") == "True"
    status = workload.get("status", {})
    admission = status.get("admission") or {}
    return WorkloadState(
        name=workload["metadata"]["name"],
        quota_reserved=_is_true(workload, "QuotaReserved"),
        admitted=_is_true(workload, "Admitted"),
        cluster_queue=admission.get("clusterQueue"),
        pending_reason=quota.get("reason", ""),
        pending_message=quota.get("message", ""),
        evicted_reason=evicted.get("reason") if active_eviction else None,
        evicted_message=evicted.get("message", "") if active_eviction else "",
        requests=total_requests(status.get("resourceRequests") or []),
        short_of=short_of(quota.get("message", "")),
        queue=queue,
    )


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
        target = _condition(pod, "DisruptionTarget")
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
    failed = _condition(jobset, "Failed")
    is_failed = failed is not None and failed.get("status") == "True"
    owners = metadata.get("ownerReferences") or []
    return ChildState(
        name=metadata["name"],
        phase=labels.get(LABEL_PHASE, ""),
        attempt=int(labels.get(LABEL_ATTEMPT, "0")),
        owned=any(ref.get("uid") == owner_uid and ref.get("controller") for ref in owners),
        deleting=bool(metadata.get("deletionTimestamp")),
        completed=_is_true(jobset, "Completed"),
        failed=is_failed,
        failed_at=parse_time(failed.get("lastTransitionTime")) if is_failed else None,
        failure_reason=failed.get("reason", "") if is_failed else "",
        failure_message=failed.get("message", "") if is_failed else "",
        suspended=bool(jobset.get("spec", {}).get("suspend")) or _is_true(jobset, "Suspended"),
        workload=observe_workload(workload, queue) if workload else None,
        container_failure=observe_container_failure(failed_pods or []),
        disruption=observe_disruption(failed_pods or []),
        uid=metadata.get("uid", ""),
        lead_pod_selector=lead_pod_selector(jobset),
        created=metadata.get("creationTimestamp"),
    )


# --- Training progress, from the trainer's log ---------------------------------------------------------

def progress_summary(step: int, total_steps: int | None) -> str:
    """What `kubectl get lj` shows, e.g. `120/500 (24%)`."""
    if not total_steps:
        return str(step)
    return f"{step}/{total_steps} ({100 * step // total_steps}%)"


def parse_progress_line(line: str) -> api.Progress | None:
    """The progress of one trainer progress line; None for any other line, or one cut short or garbled."""
    record = ProgressRecord.from_line(line)
    return None if record is None else _status_progress(record)


def progress_from_log(log: str) -> api.Progress | None:
    """The progress of the last readable progress line in a log tail (None when it holds none)."""
    record = last_progress(log)
    return None if record is None else _status_progress(record)


def _four_digits(loss: float | None) -> float | None:
    """A loss as `kubectl get lj` prints it: 4 significant digits (metrics.jsonl keeps every digit)."""
    return loss if loss is None or not math.isfinite(loss) else float(f"{loss:.4g}")


def _status_progress(record: ProgressRecord) -> api.Progress:
    eta = record.eta_seconds
    return api.Progress(
        step=record.step,
        total_steps=record.total_steps,
        loss=_four_digits(record.loss),
        tokens_per_second=record.tokens_per_second,
        eta_seconds=None if eta is None else max(0, round(eta)),
        eval_loss=_four_digits(record.eval_loss),
        eval_step=record.eval_step,
        state=record.state,
        message=record.message[:4096] or None,
        summary=progress_summary(record.step, record.total_steps),
    )


def _final_progress(progress: dict) -> bool:
    """Whether the trainer reported the end of its step (its last step, or an early stop; an evaluation after the
    last step still to come)."""
    if progress.get("state") in FINISHED_STATES:
        return True
    if progress.get("state") == EVALUATING:
        return False
    return bool(progress.get("totalSteps")) and progress.get("step") == progress.get("totalSteps")


def train_log_wanted(status: dict, train: ChildState | None) -> bool:
    """Whether the lead trainer's log may hold news for status.progress: its step runs (admitted), or it
    finished and status.progress does not show the last step yet (the trainer's last line may)."""
    if train is None or not train.owned or train.deleting or train.lead_pod_selector is None:
        return False
    if train.finished:
        return not _final_progress(status.get("progress") or {})
    return not train.suspended


def checks_step(children: dict[str, ChildState]) -> ChildState | None:
    """The step that ran the data and fit checks: check, or convert."""
    return next((children[phase] for phase in rules.CPU_FIRST_STEPS if phase in children), None)


def checks_log_wanted(status: dict, step: ChildState | None) -> bool:
    """Whether the checks step's pod log may hold the figures that status.data lacks: the step completed."""
    return (
        step is not None and step.owned and step.completed and not step.deleting
        and step.lead_pod_selector is not None and not status.get("data")
    )


def _data(o: Observed) -> dict | None:
    """status.data: the data check's line in this pass's checks log, else kept."""
    record = last_data(o.checks_log) if o.checks_log else None
    if record is None:
        return o.status.get("data")
    return api.DataStatus(**dataclasses.asdict(record)).model_dump(by_alias=True, exclude_none=True)


def _plan(o: Observed) -> dict | None:
    """status.plan: the fit check's line in this pass's checks log (read with the data check's), else kept."""
    record = last_plan(o.checks_log) if o.checks_log else None
    if record is None:
        return o.status.get("plan")
    tokens = None if record.tokens_per_second_per_chip is None else record.tokens_per_second_per_chip * record.chips
    return api.PlanStatus(
        target=record.target, hbm_bytes_per_chip=record.hbm_bytes_per_chip, capacity_bytes=record.capacity_bytes,
        step_seconds=record.step_seconds, tokens_per_second=tokens, mfu=record.mfu, bound=record.bound,
        compile_seconds=record.compile_seconds,
    ).model_dump(by_alias=True, exclude_none=True)


def _evaluation(o: Observed) -> dict | None:
    """status.evaluation: the evaluation line in this pass's train log, else kept."""
    record = last_evaluation(o.train_log) if o.train_log else None
    if record is None:
        return o.status.get("evaluation")
    scores = {name: api.ModelEvaluation(score=s.score, stop_rate=s.stop_rate, mean_length=round(s.mean_length, 1))
              for name, s in (("base", record.base), ("adapter", record.adapter))}
    return api.EvaluationStatus(
        scorer=record.scorer, examples=record.examples, step=record.step, seconds=record.seconds, **scores,
        samples=[api.EvaluationSample(**dataclasses.asdict(sample)) for sample in record.samples],
    ).model_dump(by_alias=True, exclude_none=True)


def _progress(o: Observed, record: ProgressRecord | None) -> dict | None:
    """status.progress: lifted from this pass's log tail, else kept (a pod that is gone erases nothing)."""
    if record is None:
        return o.status.get("progress")
    return _status_progress(record).model_dump(by_alias=True, exclude_none=True)


def _watched(progress: dict | None, advanced_time: str | None) -> dict | None:
    """status.progress with the stall watchdog's advancedTime, which it keeps only while it watches."""
    progress = {key: value for key, value in (progress or {}).items() if key != "advancedTime"}
    if advanced_time:
        progress["advancedTime"] = advanced_time
    return progress or None


def _checkpoints(o: Observed, record: ProgressRecord | None) -> list[dict]:
    """status.checkpoints: the list in this pass's last progress record, else kept."""
    if record is None or record.checkpoints is None:
        return o.status.get("checkpoints") or []
    layout = RunLayout(o.spec.output.base_output_directory, run_name(o.spec, o.name))
    return [
        api.CheckpointStatus(
            step=c.step, train_loss=c.train_loss, eval_loss=c.eval_loss, path=layout.checkpoint(c.step),
            time=None if c.time is None else datetime.fromtimestamp(c.time, timezone.utc).replace(microsecond=0),
        ).model_dump(mode="json", by_alias=True, exclude_none=True)
        for c in record.checkpoints
    ]


def exported_step(spec: api.LoRAJobSpec, progress: dict | None, checkpoints: list[dict]) -> int | None:
    """The step export.step chooses, once training has finished (the list of checkpoints is final then)."""
    if not spec.export.enabled or not _final_progress(progress or {}):
        return None
    records = [CheckpointRecord(c["step"], c.get("trainLoss"), c.get("evalLoss")) for c in checkpoints]
    try:
        return choose_checkpoint(spec.export.checkpoint(spec.training), records).step
    except LookupError:  # the export step fails with the trainer's message
        return None


# --- What to do ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Create:
    phase: str
    attempt: int


@dataclasses.dataclass
class Decision:
    status: dict
    create: list[Create] = dataclasses.field(default_factory=list)
    delete: list[str] = dataclasses.field(default_factory=list)
    """Child JobSet names, deleted with foreground propagation."""
    events: list[Event] = dataclasses.field(default_factory=list)
    requeue_after: float | None = None
    delete_self: bool = False


@dataclasses.dataclass
class _Draft:
    """The new status under construction; conditions keep their transition time while unchanged."""

    observed: Observed
    phase: str
    message: str
    conditions: dict[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)
    restarts: dict[str, int] = dataclasses.field(default_factory=dict)
    infrastructure_restarts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The retries of `restarts` after infrastructure failures (they do not use up retryLimit)."""
    start_time: str | None = None
    completion_time: str | None = None
    advanced_time: str | None = None
    """status.progress.advancedTime, set while the stall watchdog watches the running train step (else removed)."""

    def condition(self, condition_type: str, true: bool, reason: str, message: str = "") -> None:
        self.conditions[condition_type] = ("True" if true else "False", reason, message)

    def clear(self, *condition_types: str) -> None:
        """Set these conditions False, keeping their last reason, if they were ever set."""
        previous = {c["type"]: c for c in self.observed.status.get("conditions") or []}
        for condition_type in condition_types:
            if condition_type in self.conditions:
                continue
            if condition_type in previous and previous[condition_type].get("status") == "True":
                self.conditions[condition_type] = ("False", previous[condition_type].get("reason", ""), "")

    def status(self) -> dict:
        o = self.observed
        record = last_progress(o.train_log) if o.train_log else None
        previous = {c["type"]: c for c in o.status.get("conditions") or []}
        conditions = []
        for condition_type in api.CONDITION_TYPES:
            old = previous.get(condition_type)
            if condition_type not in self.conditions:
                if old:
                    conditions.append(old)
                continue
            status, reason, message = self.conditions[condition_type]
            changed = old is None or old.get("status") != status
            conditions.append({
                "type": condition_type,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": format_time(o.now) if changed else old["lastTransitionTime"],
                "observedGeneration": o.generation,
            })
        status = {
            "phase": self.phase,
            "message": self.message,
            "conditions": conditions,
            "observedGeneration": o.generation,
            "restarts": {phase: self.restarts.get(phase, 0) for phase in rules.PHASES},
            "infrastructureRestarts": {phase: self.infrastructure_restarts.get(phase, 0) for phase in rules.PHASES},
        }
        if o.spec is not None:
            status["children"] = {
                phase: rules.child_name(run_name(o.spec, o.name), phase) for phase in rules.phases(o.spec)
            }
            status["outputs"] = _outputs(o)
            status["checkpoints"] = _checkpoints(o, record)
            finished = o.status.get("phase") in TERMINAL_PHASES and o.status.get("resolved")
            # A finished LoRAJob keeps the record of what it ran with, whatever the policies say now.
            status["resolved"] = o.status["resolved"] if finished else resolved_status(o.spec, o.defaults, o.render)
        progress = _watched(_progress(o, record), self.advanced_time)
        if progress:
            status["progress"] = progress
        for key, lifted in (("data", _data(o)), ("plan", _plan(o)), ("evaluation", _evaluation(o))):
            if lifted:
                status[key] = lifted
        if o.spec is not None:
            step = exported_step(o.spec, progress, status["checkpoints"])
            if step is not None:
                status["outputs"]["exportedStep"] = step
        if self.start_time:
            status["startTime"] = self.start_time
        if self.completion_time:
            status["completionTime"] = self.completion_time
        # Written exactly as api.LoRAJobStatus declares it (the schema the CRD publishes).
        return api.LoRAJobStatus.model_validate(status).model_dump(mode="json", by_alias=True, exclude_none=True)


def _outputs(o: Observed) -> dict:
    paths = run_paths(o.spec, run_name(o.spec, o.name))
    outputs = {"baseCheckpointPath": paths.base_checkpoint, "checkpointPath": paths.checkpoints}
    if paths.adapter_export:
        outputs["adapterPath"] = paths.adapter_export
    return outputs


def _new_draft(o: Observed) -> _Draft:
    status = o.status
    return _Draft(
        observed=o,
        phase=status.get("phase") or api.Phase.Pending.value,
        message=status.get("message") or "",
        restarts={phase: int((status.get("restarts") or {}).get(phase, 0)) for phase in rules.PHASES},
        infrastructure_restarts={
            phase: int((status.get("infrastructureRestarts") or {}).get(phase, 0)) for phase in rules.PHASES
        },
        start_time=status.get("startTime") or _first_created(o),
        completion_time=status.get("completionTime"),
    )


def _first_created(o: Observed) -> str | None:
    """When the first step was created, from the children: the pass that creates a LoRAJob's first JobSet may skip
    its status write (kube.Reconciler._apply), so status.startTime can be missing while the step runs."""
    times = [child.created for child in o.children.values() if child.owned and child.created]
    return min(times, key=parse_time) if times else None


def backoff_seconds(retry: int, settings: ReconcileSettings) -> float:
    """Delay before retry number `retry` (1-based) of a step."""
    return min(settings.retry_backoff_seconds * 2 ** (retry - 1), settings.retry_backoff_max_seconds)


def decide(o: Observed, settings: ReconcileSettings) -> Decision:
    draft = _new_draft(o)
    decision = Decision(status={})
    if draft.phase in TERMINAL_PHASES:
        _finished(o, draft, decision)
    elif o.spec is None:
        _fail(draft, "InvalidSpec", "the spec cannot be used: " + "; ".join(o.spec_errors))
    elif (found := _policy_violations(o, draft)):
        _fail(draft, policy.VIOLATION_REASON, "; ".join(violation.message for violation in found))
    elif _deadline_exceeded(o, draft):
        _fail(
            draft, "DeadlineExceeded",
            f"the LoRAJob ran longer than spec.scheduling.activeDeadlineSeconds="
            f"{o.spec.scheduling.active_deadline_seconds}",
        )
        decision.delete += [child.name for child in o.children.values() if child.active]
    elif o.spec.suspend:
        _suspend(o, draft, decision)
    elif o.problems:
        _blocked(draft, o.problems)
    else:
        _advance(o, draft, settings, decision)
    decision.status = draft.status()
    previous_phase = o.status.get("phase")
    if draft.phase != previous_phase:
        kind = "Warning" if draft.phase == api.Phase.Failed.value else "Normal"
        decision.events.append(Event(kind, draft.phase, draft.message))
    blocked = _blocked_by(decision.status)
    if blocked and blocked != _blocked_by(o.status):
        decision.events.append(Event("Warning", *blocked))
    return decision


def _blocked_by(status: dict) -> tuple[str, str] | None:
    """(reason, message) of a True Blocked condition."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Blocked" and condition.get("status") == "True":
            return condition.get("reason", ""), condition.get("message", "")
    return None


def _finished(o: Observed, draft: _Draft, decision: Decision) -> None:
    decision.delete += [child.name for child in o.children.values() if child.active]
    ttl = o.spec.scheduling.ttl_seconds_after_finished if o.spec else None
    finished_at = parse_time(draft.completion_time)
    if ttl is None or finished_at is None:
        return
    remaining = (finished_at + timedelta(seconds=ttl) - o.now).total_seconds()
    if remaining <= 0:
        decision.delete_self = True
    else:
        decision.requeue_after = remaining


def _policy_violations(o: Observed, draft: _Draft) -> list[policy.PolicyViolation]:
    """Checked only before the first step starts: a policy changed mid-run does not kill a running LoRAJob."""
    if draft.start_time or o.children:
        return []
    return policy.violations(o.policies, o.namespace_labels, o.spec)


def _fail(draft: _Draft, reason: str, message: str) -> None:
    draft.phase, draft.message = api.Phase.Failed.value, message
    draft.completion_time = draft.completion_time or format_time(draft.observed.now)
    draft.condition("Failed", True, reason, message)
    draft.clear("Queued", "Admitted", "Running", "Evicted", "Blocked")


def _deadline_exceeded(o: Observed, draft: _Draft) -> bool:
    deadline = o.spec.scheduling.active_deadline_seconds
    start = parse_time(draft.start_time)
    if deadline is None or start is None or o.spec.suspend:
        return False
    resumed = next(
        (parse_time(c.get("lastTransitionTime")) for c in o.status.get("conditions") or []
         if c.get("type") == "Suspended" and c.get("status") == "False"),
        None,
    )
    running_since = max(start, resumed) if resumed else start
    return (o.now - running_since).total_seconds() > deadline


def _blocked(draft: _Draft, problems: tuple[tuple[str, str], ...]) -> None:
    reason = problems[0][0]
    message = "; ".join(message for _, message in problems)
    draft.phase, draft.message = api.Phase.Pending.value, message
    draft.condition("Blocked", True, reason, message)


def _suspend(o: Observed, draft: _Draft, decision: Decision) -> None:
    active = [child for child in o.children.values() if child.active]
    decision.delete += [child.name for child in active]
    deleting = [child.name for child in o.children.values() if child.owned and child.deleting]
    draft.phase = api.Phase.Suspended.value
    draft.message = "suspended by spec.suspend"
    if active or deleting:
        draft.message += f"; deleting JobSet {', '.join(sorted({c.name for c in active} | set(deleting)))}"
    draft.condition("Suspended", True, "SuspendedBySpec", draft.message)
    draft.clear("Queued", "Admitted", "Running", "Evicted", "Blocked")


def _advance(o: Observed, draft: _Draft, settings: ReconcileSettings, decision: Decision) -> None:
    draft.clear("Blocked")
    if o.status.get("phase") == api.Phase.Suspended.value:
        draft.condition("Suspended", False, "Resumed", "spec.suspend was cleared")
    run = run_name(o.spec, o.name)
    for phase in rules.phases(o.spec):
        name = rules.child_name(run, phase)
        attempt = draft.restarts[phase]
        child = o.children.get(phase)
        if child is not None and not child.owned:
            message = f"a JobSet named {name} already exists and is not controlled by this LoRAJob; delete it or set another spec.runName"
            draft.phase, draft.message = api.Phase.Pending.value, message
            draft.condition("Blocked", True, "NameTaken", message)
            return
        if child is not None and child.deleting:
            draft.phase = RUNNING_PHASE[phase].value
            draft.message = f"waiting for the previous JobSet {name} to be deleted"
            return
        if child is None:
            decision.create.append(Create(phase, attempt))
            draft.start_time = draft.start_time or format_time(o.now)
            _queued(o, draft, phase, None, f"created JobSet {name}" + (f" (retry {attempt})" if attempt else ""))
            return
        if child.attempt < attempt:
            decision.delete.append(name)
            draft.message = f"deleting the failed try {child.attempt} of the {phase} step before retrying"
            return
        if child.completed:
            continue
        if child.failed:
            _step_failed(o, draft, settings, decision, phase, child)
            return
        _running(o, draft, decision, phase, child)
        return
    draft.phase, draft.message = api.Phase.Succeeded.value, "all steps completed"
    draft.completion_time = draft.completion_time or format_time(o.now)
    progress = _progress(o, last_progress(o.train_log) if o.train_log else None) or {}
    if progress.get("state") == STOPPED_EARLY:
        step, total = progress.get("step"), o.spec.training.steps
        draft.message = f"stopped early at step {step} of {total} ({total - step} steps not run)"
        draft.condition("Succeeded", True, "EarlyStopped", f"{draft.message}: {progress.get('message', '')}")
    else:
        draft.condition("Succeeded", True, "StepsCompleted", f"completed: {', '.join(rules.phases(o.spec))}")
    draft.clear("Queued", "Admitted", "Running", "Evicted")


def _failure_text(phase: str, child: ChildState) -> str:
    text = f"the {phase} step failed (JobSet {child.name}"
    text += f": {child.failure_reason}" if child.failure_reason else ""
    text += ")"
    if child.container_failure:
        text += ": " + child.container_failure.describe()
    elif child.failure_message:
        text += ": " + child.failure_message
    return text


def failure_kind(child: ChildState) -> exit_codes.Kind:
    """A user error when the trainer exited with one of its user-error codes (a bad input stays bad,
    whatever else happened); else infrastructure when the cluster stopped a pod or a container died of
    a signal or the trainer says so; else unknown."""
    failure = child.container_failure
    if failure is not None and failure.container == TRAINER_CONTAINER:
        trainer_kind = exit_codes.kind(failure.exit_code)
    elif failure is not None and failure.exit_code > exit_codes.SIGNAL_BASE:
        trainer_kind = exit_codes.Kind.infrastructure
    else:
        trainer_kind = exit_codes.Kind.unknown  # only the trainer documents what its codes mean
    if trainer_kind is exit_codes.Kind.user or not child.disruption:
        return trainer_kind
    return exit_codes.Kind.infrastructure


def _step_failed(o, draft: _Draft, settings, decision: Decision, phase: str, child: ChildState) -> None:
    failure = _failure_text(phase, child)
    kind = failure_kind(child)
    if kind is exit_codes.Kind.user:
        code = exit_codes.BY_CODE[child.container_failure.exit_code]
        _fail(draft, code.name, f"{failure}; not retried: exit code {code.code} is a user error ({code.meaning})")
        return
    infrastructure = kind is exit_codes.Kind.infrastructure
    if infrastructure:
        failure += f"; an infrastructure failure ({child.disruption})" if child.disruption else "; an infrastructure failure"
        limit, used, budget = o.spec.scheduling.infrastructure_retry_limit, draft.infrastructure_restarts[phase], "infrastructureRetryLimit"
    else:
        limit, used, budget = o.spec.scheduling.retry_limit, child.attempt - draft.infrastructure_restarts[phase], "retryLimit"
    if used >= limit:
        _fail(draft, f"{phase.capitalize()}Failed", f"{failure}; giving up {_retries(limit, budget)}")
        return
    retry = used + 1
    wait = ((child.failed_at or o.now) + timedelta(seconds=backoff_seconds(retry, settings)) - o.now).total_seconds()
    if wait > 0:
        draft.message = f"{failure}; retry {retry}/{limit} in {int(wait) + 1}s"
        decision.requeue_after = wait
        return
    _restart(draft, decision, phase, child, retry, limit, failure, infrastructure=infrastructure, reason="Retrying")


def _retries(limit: int, budget: str) -> str:
    return f"after {limit} retr{'y' if limit == 1 else 'ies'}" if limit else f"({budget} is 0)"


def _restart(
    draft: _Draft, decision: Decision, phase: str, child: ChildState, retry: int, limit: int, failure: str, *,
    infrastructure: bool, reason: str,
) -> None:
    """Delete the step's try and record the next one (the next pass, seeing no child, creates it)."""
    draft.restarts[phase] = child.attempt + 1
    if infrastructure:
        draft.infrastructure_restarts[phase] = retry
    decision.delete.append(child.name)
    draft.message = f"{failure}; retrying ({retry}/{limit})"
    decision.events.append(Event("Warning", reason, draft.message))


def _watch_progress(o: Observed, draft: _Draft, decision: Decision, child: ChildState) -> None:
    """The stall watchdog of the running train step (scheduling.progressDeadlineSeconds): counts from when
    it started running or its step last changed, whichever is later (status.progress.advancedTime, written
    when the step changes, so an operator restart keeps the clock), and wakes the LoRAJob at the deadline."""
    deadline = o.spec.scheduling.progress_deadline_seconds
    previous = o.status.get("progress") or {}
    record = last_progress(o.train_log) if o.train_log else None
    advanced = previous.get("advancedTime")
    changed = record is not None and (record.step != previous.get("step") or record.state != previous.get("state"))
    if advanced is None or changed:
        advanced = format_time(o.now)
    idle = (o.now - parse_time(advanced)).total_seconds()
    if idle < deadline:
        draft.advanced_time = advanced
        decision.requeue_after = deadline - idle
        return
    step = record.step if record is not None else previous.get("step")
    last = f"last step {step}" if step is not None else "no step reported yet"
    failure = (
        f"the train step stalled (JobSet {child.name}): no new step for {int(idle)}s ({last}; "
        f"scheduling.progressDeadlineSeconds={deadline}); an infrastructure failure"
    )
    limit, used = o.spec.scheduling.infrastructure_retry_limit, draft.infrastructure_restarts["train"]
    if used >= limit:
        _fail(draft, STALLED, f"{failure}; giving up {_retries(limit, 'infrastructureRetryLimit')}")
        decision.delete.append(child.name)  # its hung pods would hold their accelerators
        return
    # No backoff: the step already waited out its deadline.
    _restart(draft, decision, "train", child, used + 1, limit, failure, infrastructure=True, reason=STALLED)


def _queued(o: Observed, draft: _Draft, phase: str, child: ChildState | None, message: str) -> None:
    if not o.defaults.queue_name:
        draft.phase, draft.message = RUNNING_PHASE[phase].value, message
        return
    workload = child.workload if child else None
    cluster_queue = o.cluster_queue or "?"
    details = ""
    if workload is None:
        reason, text = "WaitingForWorkload", f"{message}; waiting for Kueue to create its Workload"
    elif workload.evicted_reason:
        reason = workload.evicted_reason
        text = f"evicted by Kueue ({workload.evicted_reason}): {workload.evicted_message}; waiting to be admitted again"
        draft.condition("Evicted", True, workload.evicted_reason, workload.evicted_message)
    elif workload.pending_reason in ("", "Pending"):
        reason = "WaitingForQuota"
        text, details = _waiting_for_quota(cluster_queue, workload)
    else:
        reason = workload.pending_reason
        text = f"not admitted by ClusterQueue {cluster_queue} ({workload.pending_reason}): {workload.pending_message}"
    draft.phase, draft.message = api.Phase.Queued.value, f"{phase} step: {text}"
    # status.message is short enough for `kubectl get lj -o wide`; the conditions add the details.
    explained = draft.message + (f"; {details}" if details else "")
    draft.condition("Queued", True, reason, explained)
    draft.condition("Admitted", False, reason, explained)
    draft.condition("Running", False, "Queued", "")


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def waiting_for(workload: WorkloadState) -> str:
    """What a pending Workload waits for, e.g. `16 google.com/tpu (flavor tpu-v6e-slice-4x4)`: each resource
    Kueue's message says is short, with what the Workload requests of it in all. Kueue's message does not
    always name one (it may only list flavors that do not match): then the accelerators it requests, else
    everything it requests; "quota" before Kueue has looked at it."""
    flavors: dict[str, list[str]] = {}
    for resource, flavor in workload.short_of:
        flavors.setdefault(resource, []).append(flavor)
    if flavors:
        return ", ".join(
            " ".join(filter(None, (workload.requests.get(resource), resource))) + f" (flavor {' or '.join(names)})"
            for resource, names in flavors.items()
        )
    extended = {resource: total for resource, total in workload.requests.items() if "/" in resource}
    return ", ".join(f"{total} {resource}" for resource, total in (extended or workload.requests).items()) or "quota"


EXACT_QUEUE_POSITIONS = 10
"""Positions up to this are given exactly; further back, only the power of ten of the Workloads ahead, so
that the 1,000 LoRAJobs behind an admitted one do not all need a status write to say they moved up."""


def queue_place(position: int) -> str:
    """`3rd`, or `100+ Workloads ahead` (see EXACT_QUEUE_POSITIONS)."""
    if position <= EXACT_QUEUE_POSITIONS:
        return ordinal(position)
    return f"{10 ** (len(str(position - 1)) - 1)}+ Workloads ahead"


def _waiting_for_quota(cluster_queue: str, workload: WorkloadState) -> tuple[str, str]:
    """(the short text, its details): position in the ClusterQueue and what the Workload waits for; then
    what the position counts and Kueue's own message."""
    queue = workload.queue
    where = f"{queue_place(queue.position)} in ClusterQueue {cluster_queue}" if queue else f"queued in ClusterQueue {cluster_queue}"
    details = []
    if queue:
        plural = "s" if len(queue.namespaces) > 1 else ""
        counted = f" in namespace{plural} {', '.join(queue.namespaces)}" if queue.namespaces else ""
        details.append(f"counting the pending Workloads{counted} in Kueue's order (priority, then creation)")
    if workload.pending_message:
        details.append(f"Kueue: {workload.pending_message}")
    return f"{where}; waiting for {waiting_for(workload)}", "; ".join(details)


def _running(o: Observed, draft: _Draft, decision: Decision, phase: str, child: ChildState) -> None:
    queue = o.defaults.queue_name
    queued_by_kueue = queue and (child.workload is None or not child.workload.admitted)
    if queued_by_kueue or (child.suspended and not queue):
        _queued(o, draft, phase, child, f"JobSet {child.name} waits for admission")
        return
    draft.phase = RUNNING_PHASE[phase].value
    draft.message = f"{phase} step running (JobSet {child.name})"
    if child.workload is not None:
        cluster_queue = child.workload.cluster_queue or o.cluster_queue or "?"
        draft.condition("Admitted", True, "Admitted", f"{phase} step admitted by ClusterQueue {cluster_queue}")
    draft.condition("Queued", False, "Admitted", "")
    draft.condition("Running", True, f"{phase.capitalize()}Running", draft.message)
    draft.clear("Evicted")
    if phase == "train" and o.spec.scheduling.progress_deadline_seconds is not None:
        _watch_progress(o, draft, decision, child)
