"""The reconcile decision: what exists -> what the LoRAJob's status is and what to do next (pure)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from lorajob_operator import api, policy, rules
from lorajob_operator.names import TRAINER_CONTAINER, child_name, run_name, tracker_link
from lorajob_operator.reconcile.conditions import format_time, parse_time
from lorajob_operator.reconcile.observed import ChildState, Observed, resolved_status
from lorajob_operator.reconcile.status_text import failure_text, retries_text, waiting_for_quota
from lorajob_operator.reconcile.trainer_output import (
    checkpoints_status, data_status, evaluation_status, exported_step, plan_status, progress_status, tracking_status,
    watched,
)
from lorajob_operator.settings import ReconcileSettings
from lorajob_operator.step_commands import run_paths
from lorajob_trainer.contract import exit_codes
from lorajob_trainer.contract.records import STOPPED_EARLY


RUNNING_PHASE = {step: api.Phase(phase) for step, phase in rules.PHASE_WHILE_RUNNING.items()}


TERMINAL_PHASES = (api.Phase.Succeeded.value, api.Phase.Failed.value)


STALLED = "Stalled"
"""Reason of a train step restarted (or the LoRAJob failed) by the stall watchdog."""

TRACKING_DEGRADED = "TrackingDegraded"
"""The condition that an experiment tracker does not take what the trainer sends it (training goes on)."""


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
    annotations: dict[str, str] = dataclasses.field(default_factory=dict)
    """Annotations to set on the LoRAJob: its Argo CD links to the tracker runs, where they are new or changed."""


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
        record = o.progress_record
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
                phase: child_name(run_name(o.spec, o.name), phase) for phase in rules.phases(o.spec)
            }
            status["outputs"] = _outputs(o)
            status["checkpoints"] = checkpoints_status(o, record)
            finished = o.status.get("phase") in TERMINAL_PHASES and o.status.get("resolved")
            # A finished LoRAJob keeps the record of what it ran with, whatever the policies say now.
            status["resolved"] = o.status["resolved"] if finished else resolved_status(o.spec, o.defaults, o.render)
        progress = watched(progress_status(o, record), self.advanced_time)
        if progress:
            status["progress"] = progress
        for key, lifted in (("data", data_status(o)), ("plan", plan_status(o)), ("evaluation", evaluation_status(o)),
                            ("tracking", tracking_status(o))):
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
    its status write (controller.reconciler.Reconciler._apply), so status.startTime can be missing while the step runs."""
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
    _tracking_degraded(o, draft)
    decision.status = draft.status()
    decision.annotations = _tracker_links(o, decision.status)
    previous_phase = o.status.get("phase")
    if draft.phase != previous_phase:
        kind = "Warning" if draft.phase == api.Phase.Failed.value else "Normal"
        decision.events.append(Event(kind, draft.phase, draft.message))
    blocked = _true(decision.status, "Blocked")
    if blocked and blocked != _true(o.status, "Blocked"):
        decision.events.append(Event("Warning", *blocked))
    degraded = _true(decision.status, TRACKING_DEGRADED)
    if degraded and not _true(o.status, TRACKING_DEGRADED):
        decision.events.append(Event("Warning", TRACKING_DEGRADED, degraded[1]))
    return decision


def _true(status: dict, condition_type: str) -> tuple[str, str] | None:
    """(reason, message) of the condition when it is True."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == condition_type and condition.get("status") == "True":
            return condition.get("reason", ""), condition.get("message", "")
    return None


def _tracking_degraded(o: Observed, draft: _Draft) -> None:
    """TrackingDegraded from the trainer's last progress record: True with its problem (which tracker fails, and how),
    False while every tracker takes what it is sent; as it was when this pass read no record that says (a run without
    trackers never has it)."""
    record = o.progress_record
    if record is None or record.tracking_problem is None:
        return
    problem = record.tracking_problem
    draft.condition(TRACKING_DEGRADED, bool(problem), "TrackerFailing" if problem else "TrackersReporting", problem)


def _tracker_links(o: Observed, status: dict) -> dict[str, str]:
    """The Argo CD links (names.tracker_link) to the runs in status.tracking that the LoRAJob lacks or holds another
    address for."""
    links = {
        tracker_link(tracker): f"{api.TRACKER_TITLES[tracker]} run|{run['url']}"
        for tracker, run in (status.get("tracking") or {}).items() if run.get("url")
    }
    return {key: value for key, value in links.items() if o.annotations.get(key) != value}


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
        name = child_name(run, phase)
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
    progress = progress_status(o, o.progress_record) or {}
    if progress.get("state") == STOPPED_EARLY:
        step, total = progress.get("step"), o.spec.training.steps
        draft.message = f"stopped early at step {step} of {total} ({total - step} steps not run)"
        draft.condition("Succeeded", True, "EarlyStopped", f"{draft.message}: {progress.get('message', '')}")
    else:
        draft.condition("Succeeded", True, "StepsCompleted", f"completed: {', '.join(rules.phases(o.spec))}")
    draft.clear("Queued", "Admitted", "Running", "Evicted")


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
    failure = failure_text(phase, child)
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
        _fail(draft, f"{phase.capitalize()}Failed", f"{failure}; giving up {retries_text(limit, budget)}")
        return
    retry = used + 1
    wait = ((child.failed_at or o.now) + timedelta(seconds=backoff_seconds(retry, settings)) - o.now).total_seconds()
    if wait > 0:
        draft.message = f"{failure}; retry {retry}/{limit} in {int(wait) + 1}s"
        decision.requeue_after = wait
        return
    _restart(draft, decision, phase, child, retry, limit, failure, infrastructure=infrastructure, reason="Retrying")


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
    record = o.progress_record
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
        _fail(draft, STALLED, f"{failure}; giving up {retries_text(limit, 'infrastructureRetryLimit')}")
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
        text, details = waiting_for_quota(cluster_queue, workload)
    else:
        reason = workload.pending_reason
        text = f"not admitted by ClusterQueue {cluster_queue} ({workload.pending_reason}): {workload.pending_message}"
    draft.phase, draft.message = api.Phase.Queued.value, f"{phase} step: {text}"
    # status.message is short enough for `kubectl get lj -o wide`; the conditions add the details.
    explained = draft.message + (f"; {details}" if details else "")
    draft.condition("Queued", True, reason, explained)
    draft.condition("Admitted", False, reason, explained)
    draft.condition("Running", False, "Queued", "")


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
