"""The reconcile decision on what exists: phase, conditions, children to create/delete, retries, suspend, TTL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from builders import UID, condition, failed_pod, jobset, lorajob, spec_dict, workload

from lorajob_operator import reconcile
from lorajob_operator.reconcile import Create, Observed, decide, observe_child, observe_container_failure
from lorajob_operator.render import parse_spec
from lorajob_operator.settings import ReconcileSettings

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
SETTINGS = ReconcileSettings(retry_backoff_seconds=10, retry_backoff_max_seconds=60)
COMPLETED = condition("Completed", reason="AllJobsCompleted")
PENDING_MESSAGE = "couldn't assign flavors to pod set worker: insufficient unused quota for google.com/tpu in flavor v6e, 16 more needed"


def _observe(body: dict, children: dict | None = None, *, now: datetime = NOW, problems=(), cluster_queue="cq-tpu") -> Observed:
    spec, errors = parse_spec(body)
    states = {}
    for phase, (child, wl, pods) in (children or {}).items():
        states[phase] = observe_child(child, UID, wl, pods)
    return Observed(
        name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], generation=body["metadata"]["generation"],
        spec=spec, spec_errors=errors, status=body.get("status") or {}, children=states,
        problems=tuple(problems), cluster_queue=cluster_queue, now=now,
    )


def _conditions(decision) -> dict[str, dict]:
    return {c["type"]: c for c in decision.status["conditions"]}


def _admitted() -> dict:
    return workload(condition("QuotaReserved"), condition("Admitted"), cluster_queue="cq-tpu")


def _with_status(body: dict, decision) -> dict:
    """The LoRAJob after the operator wrote `decision.status` (the next pass starts from it)."""
    return {**body, "status": decision.status}


def test_a_new_lorajob_creates_its_first_step_and_waits_for_kueue():
    decision = decide(_observe(lorajob()), SETTINGS)
    assert decision.create == [Create("convert", 0)] and decision.delete == []
    assert decision.status["phase"] == "Queued"
    assert decision.status["startTime"] == "2026-01-01T12:00:00Z"
    assert _conditions(decision)["Queued"]["reason"] == "WaitingForWorkload"
    assert decision.status["children"] == {"convert": "qwen3-gsm8k-convert", "train": "qwen3-gsm8k", "export": "qwen3-gsm8k-to-hf"}
    assert decision.status["outputs"]["adapterPath"] == "gs://bucket/runs/qwen3-gsm8k/huggingface"
    assert [(e.type, e.reason) for e in decision.events] == [("Normal", "Queued")]


def test_a_step_waiting_for_quota_says_which_cluster_queue():
    body = lorajob()
    pending = workload(condition("QuotaReserved", "False", "Pending", PENDING_MESSAGE))
    decision = decide(_observe(body, {"convert": (jobset(body, "convert", suspend=True), pending, None)}), SETTINGS)
    assert decision.create == []
    queued = _conditions(decision)["Queued"]
    assert (queued["status"], queued["reason"]) == ("True", "WaitingForQuota")
    assert queued["message"] == f"convert step: waiting for quota in ClusterQueue cq-tpu: {PENDING_MESSAGE}"
    assert decision.status["message"] == queued["message"]


def test_an_admitted_step_is_running():
    body = lorajob()
    decision = decide(_observe(body, {"convert": (jobset(body, "convert"), _admitted(), None)}), SETTINGS)
    assert decision.status["phase"] == "Converting" and decision.create == []
    conditions = _conditions(decision)
    assert conditions["Admitted"]["status"] == "True" and "cq-tpu" in conditions["Admitted"]["message"]
    assert conditions["Running"]["status"] == "True"


def test_the_next_step_starts_only_when_the_previous_one_completed():
    body = lorajob()
    done = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)
    decision = decide(_observe(body, {"convert": done}), SETTINGS)
    assert decision.create == [Create("train", 0)]


def test_all_steps_completed_is_success():
    body = lorajob(status={"phase": "Exporting", "startTime": "2026-01-01T10:00:00Z"})
    children = {phase: (jobset(body, phase, conditions=[COMPLETED]), _admitted(), None) for phase in ("convert", "train", "export")}
    decision = decide(_observe(body, children), SETTINGS)
    assert decision.status["phase"] == "Succeeded" and decision.create == []
    assert decision.status["completionTime"] == "2026-01-01T12:00:00Z"
    assert _conditions(decision)["Succeeded"]["status"] == "True"
    assert [(e.type, e.reason) for e in decision.events] == [("Normal", "Succeeded")]


def test_success_is_final_even_if_children_disappear():
    body = lorajob(status={"phase": "Succeeded", "completionTime": "2026-01-01T11:00:00Z"})
    decision = decide(_observe(body), SETTINGS)
    assert decision.create == [] and decision.status["phase"] == "Succeeded" and decision.events == []


def _failed_train(body: dict, attempt: int, failed_at: str = "2026-01-01T12:00:00Z"):
    failed = condition("Failed", reason="FailedJobs", message="jobset failed due to one or more job failures", at=failed_at)
    pods = [
        failed_pod("qwen3-gsm8k-worker-0-0-abcde", "pathways-worker", 143, "2026-01-01T11:59:59Z"),
        failed_pod("qwen3-gsm8k-pathways-head-0-0-xyz12", "trainer", 42, "2026-01-01T12:00:00Z"),
    ]
    return jobset(body, "train", attempt=attempt, conditions=[failed]), _admitted(), pods


def test_a_failed_step_is_retried_after_its_backoff_under_the_same_name():
    body = lorajob(status={"phase": "Training", "restarts": {"convert": 0, "train": 0, "export": 0}})
    converted = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)

    waiting = decide(_observe(body, {"convert": converted, "train": _failed_train(body, 0)}, now=NOW + timedelta(seconds=3)), SETTINGS)
    assert waiting.delete == [] and waiting.create == []
    assert waiting.requeue_after == pytest.approx(7)
    assert "retry 1/2 in 8s" in waiting.status["message"]

    retrying = decide(_observe(body, {"convert": converted, "train": _failed_train(body, 0)}, now=NOW + timedelta(seconds=11)), SETTINGS)
    assert retrying.delete == ["qwen3-gsm8k"] and retrying.create == []
    assert retrying.status["restarts"]["train"] == 1
    assert [e.reason for e in retrying.events] == ["Retrying"]

    # Next pass: the failed try is still being deleted, then it is gone and try 1 is created.
    body = _with_status(body, retrying)
    deleting = jobset(body, "train", attempt=0, deleting=True)
    assert decide(_observe(body, {"convert": converted, "train": (deleting, None, None)}), SETTINGS).create == []
    assert decide(_observe(body, {"convert": converted}), SETTINGS).create == [Create("train", 1)]


def test_backoff_doubles_and_is_capped():
    assert [reconcile.backoff_seconds(n, SETTINGS) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


def test_a_step_out_of_retries_fails_the_lorajob_naming_the_container_and_exit_code():
    body = lorajob(status={"phase": "Training", "restarts": {"convert": 0, "train": 2, "export": 0}})
    converted = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)
    decision = decide(_observe(body, {"convert": converted, "train": _failed_train(body, 2)}), SETTINGS)
    assert decision.status["phase"] == "Failed" and decision.create == [] and decision.delete == []
    failed = _conditions(decision)["Failed"]
    assert failed["reason"] == "TrainFailed"
    assert failed["message"] == (
        "the train step failed (JobSet qwen3-gsm8k: FailedJobs): pod qwen3-gsm8k-pathways-head-0-0-xyz12 container "
        "trainer exited with code 42 (Error); giving up after 2 retries"
    )
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "Failed")]
    # Final: the next pass creates no export.
    assert decide(_observe(_with_status(body, decision), {"convert": converted}), SETTINGS).create == []


def test_suspend_deletes_the_running_step_and_resume_recreates_it():
    spec = spec_dict()
    spec["suspend"] = True
    status = {"phase": "Training", "restarts": {"convert": 0, "train": 1, "export": 0}, "conditions": [condition("Running")]}
    body = lorajob(spec=spec, status=status)
    converted = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)
    running = (jobset(body, "train", attempt=1), _admitted(), None)
    suspended = decide(_observe(body, {"convert": converted, "train": running}), SETTINGS)
    assert suspended.delete == ["qwen3-gsm8k"] and suspended.create == []
    assert suspended.status["phase"] == "Suspended"
    assert _conditions(suspended)["Suspended"]["status"] == "True"
    assert _conditions(suspended)["Running"]["status"] == "False"

    resumed_spec = spec_dict()
    body = lorajob(spec=resumed_spec, status=suspended.status)
    resumed = decide(_observe(body, {"convert": converted}, now=NOW + timedelta(minutes=5)), SETTINGS)
    assert resumed.create == [Create("train", 1)]  # the same try: a suspension is not a failure
    assert _conditions(resumed)["Suspended"]["status"] == "False"
    assert _conditions(resumed)["Suspended"]["reason"] == "Resumed"


def test_active_deadline_fails_and_stops_the_running_step_counting_from_the_last_resume():
    spec = spec_dict(scheduling={"queueName": "lorajob", "activeDeadlineSeconds": 600})
    resumed = condition("Suspended", "False", "Resumed", at="2026-01-01T11:55:00Z")
    body = lorajob(spec=spec, status={"phase": "Converting", "startTime": "2026-01-01T10:00:00Z", "conditions": [resumed]})
    running = {"convert": (jobset(body, "convert"), _admitted(), None)}
    assert decide(_observe(body, running), SETTINGS).status["phase"] == "Converting"

    late = decide(_observe(body, running, now=NOW + timedelta(minutes=6)), SETTINGS)
    assert late.status["phase"] == "Failed" and late.delete == ["qwen3-gsm8k-convert"]
    assert _conditions(late)["Failed"]["reason"] == "DeadlineExceeded"


def test_ttl_deletes_the_finished_lorajob_when_it_expires():
    spec = spec_dict(scheduling={"queueName": "lorajob", "ttlSecondsAfterFinished": 60})
    body = lorajob(spec=spec, status={"phase": "Succeeded", "completionTime": "2026-01-01T11:59:30Z"})
    early = decide(_observe(body), SETTINGS)
    assert not early.delete_self and early.requeue_after == pytest.approx(30)
    assert decide(_observe(body, now=NOW + timedelta(seconds=31)), SETTINGS).delete_self


def test_operator_visible_spec_problems_block_with_a_clear_condition():
    problems = [("SecretNotFound", "Secret hf-token (spec.credentials.huggingFaceToken) does not exist in namespace team-a; create it")]
    decision = decide(_observe(lorajob(), problems=problems), SETTINGS)
    assert decision.create == [] and decision.status["phase"] == "Pending"
    blocked = _conditions(decision)["Blocked"]
    assert (blocked["status"], blocked["reason"]) == ("True", "SecretNotFound")
    assert "hf-token" in decision.status["message"]

    fixed = decide(_observe(lorajob(status=decision.status)), SETTINGS)
    assert fixed.create == [Create("convert", 0)]
    assert _conditions(fixed)["Blocked"]["status"] == "False"


def test_a_jobset_with_our_name_owned_by_someone_else_is_never_adopted():
    body = lorajob()
    foreign = jobset(body, "convert", owner_uid="someone-else")
    decision = decide(_observe(body, {"convert": (foreign, None, None)}), SETTINGS)
    assert decision.create == [] and decision.delete == []
    assert _conditions(decision)["Blocked"]["reason"] == "NameTaken"


def test_an_evicted_step_is_queued_again_with_kueues_reason():
    body = lorajob(status={"phase": "Training"})
    converted = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)
    evicted = workload(
        condition("QuotaReserved", "False", "Pending", "waiting"),
        condition("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"),
    )
    decision = decide(_observe(body, {"convert": converted, "train": (jobset(body, "train", suspend=True), evicted, None)}), SETTINGS)
    assert decision.status["phase"] == "Queued"
    assert _conditions(decision)["Evicted"]["reason"] == "Preempted"
    assert _conditions(decision)["Queued"]["reason"] == "Preempted"


def test_without_a_queue_a_created_step_runs_at_once():
    body = lorajob(spec=spec_dict(scheduling=None))
    assert decide(_observe(body), SETTINGS).status["phase"] == "Converting"
    decision = decide(_observe(body, {"convert": (jobset(body, "convert"), None, None)}), SETTINGS)
    assert decision.status["phase"] == "Converting" and "Admitted" not in _conditions(decision)


def test_an_unusable_spec_fails_once_with_the_reason():
    decision = decide(_observe(lorajob(spec=spec_dict(training={"steps": 0}))), SETTINGS)
    assert decision.status["phase"] == "Failed"
    assert _conditions(decision)["Failed"]["reason"] == "InvalidSpec"
    assert "spec.training.steps" in decision.status["message"]


def test_unchanged_conditions_keep_their_transition_time_and_the_status_is_stable():
    body = lorajob()
    child = {"convert": (jobset(body, "convert"), _admitted(), None)}
    first = decide(_observe(body, child), SETTINGS)
    second = decide(_observe(_with_status(body, first), child, now=NOW + timedelta(minutes=1)), SETTINGS)
    assert second.status == first.status and second.events == []


def test_the_failed_container_is_the_real_error_not_a_sibling_killed_by_sigterm():
    pods = [failed_pod("a", "worker", 143, "2026-01-01T00:00:00Z"), failed_pod("b", "trainer", 1, "2026-01-01T00:00:05Z")]
    assert observe_container_failure(pods).pod == "b"
    assert observe_container_failure([failed_pod("a", "worker", 143)]).exit_code == 143
    assert observe_container_failure([]) is None
