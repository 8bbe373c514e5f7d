"""The reconcile decision on what exists: phase, conditions, children to create/delete, retries, suspend, TTL."""

from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest
from builders import UID, condition, failed_pod, jobset, lorajob, spec_dict, workload

from lorajob_operator.reconcile.decide import STALLED, Create, backoff_seconds, decide
from lorajob_operator.reconcile.kueue import QueuePosition, short_of, total_requests
from lorajob_operator.reconcile.observed import ChildState, Observed, observe_child, observe_container_failure
from lorajob_operator.reconcile.status_text import ordinal, queue_place
from lorajob_operator.reconcile.trainer_output import train_log_wanted
from lorajob_operator.validation import parse_spec
from lorajob_operator.settings import ReconcileSettings
from lorajob_trainer.contract.records import EvalRecord, ModelScore, ProgressRecord

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = ReconcileSettings(retry_backoff_seconds=10, retry_backoff_max_seconds=60)
COMPLETED = condition("Completed", reason="AllJobsCompleted")
PENDING_MESSAGE = "couldn't assign flavors to pod set worker: insufficient unused quota for google.com/tpu in flavor v6e, 16 more needed"


def _observe(
    body: dict, children: dict | None = None, *, now: datetime = NOW, problems=(), cluster_queue="cq-tpu",
    train_log: str | None = None, queue: QueuePosition | None = None,
) -> Observed:
    spec, errors = parse_spec(body)
    states = {}
    for phase, (child, wl, pods) in (children or {}).items():
        states[phase] = observe_child(child, UID, wl, pods, queue)
    return Observed(
        name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], generation=body["metadata"]["generation"],
        spec=spec, spec_errors=errors, status=body.get("status") or {}, children=states,
        problems=tuple(problems), cluster_queue=cluster_queue, now=now, train_log=train_log,
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


def test_a_step_waiting_for_quota_says_its_place_in_the_cluster_queue_and_what_it_waits_for():
    body = lorajob()
    requests = {"pathways-head": {"cpu": "49", "memory": "100Gi"}, "worker": {"cpu": "4", "google.com/tpu": "16", "memory": "28Gi"}}
    pending = workload(condition("QuotaReserved", "False", "Pending", PENDING_MESSAGE), requests=requests)
    children = {"convert": (jobset(body, "convert", suspend=True), pending, None)}
    decision = decide(_observe(body, children, queue=QueuePosition(2)), SETTINGS)
    assert decision.create == []
    short = "convert step: 2nd in ClusterQueue cq-tpu; waiting for 16 google.com/tpu (flavor v6e)"
    assert decision.status["message"] == short
    queued = _conditions(decision)["Queued"]
    assert (queued["status"], queued["reason"]) == ("True", "WaitingForQuota")
    assert queued["message"] == (
        f"{short}; counting the pending Workloads in Kueue's order (priority, then creation); Kueue: {PENDING_MESSAGE}"
    )
    assert _conditions(decision)["Admitted"]["message"] == queued["message"]

    watching_one_namespace = decide(_observe(body, children, queue=QueuePosition(1, ("team-a",))), SETTINGS)
    assert _conditions(watching_one_namespace)["Queued"]["message"].startswith(
        "convert step: 1st in ClusterQueue cq-tpu; waiting for 16 google.com/tpu (flavor v6e); counting the pending Workloads in namespace team-a in"
    )


@pytest.mark.parametrize(("position", "place"), [
    (1, "1st"), (2, "2nd"), (3, "3rd"), (10, "10th"), (11, "10+ Workloads ahead"), (100, "10+ Workloads ahead"),
    (101, "100+ Workloads ahead"), (5000, "1000+ Workloads ahead"),
])
def test_far_back_in_the_queue_only_the_power_of_ten_ahead_is_said_so_moving_up_rarely_rewrites_status(position, place):
    assert queue_place(position) == place


def test_a_step_kueue_has_not_placed_yet_still_says_which_cluster_queue():
    body = lorajob()
    children = {"convert": (jobset(body, "convert", suspend=True), workload(condition("QuotaReserved", "False", "Pending", "")), None)}
    decision = decide(_observe(body, children), SETTINGS)
    assert decision.status["message"] == "convert step: queued in ClusterQueue cq-tpu; waiting for quota"
    assert _conditions(decision)["Queued"]["message"] == decision.status["message"]


def test_when_kueues_message_names_no_resource_the_step_says_what_it_requests():
    body = lorajob()
    requests = {"pathways-head": {"cpu": "49", "memory": "100Gi"}, "worker": {"cpu": "4", "google.com/tpu": "16", "memory": "28Gi"}}
    only_affinity = "couldn't assign flavors to pod set pathways-head: flavor tpu-v6e-slice-2x2 doesn't match node affinity"
    for requested, waits_for in ((requests, "16 google.com/tpu"), ({"head": {"cpu": "2", "memory": "1Gi"}}, "2 cpu, 1Gi memory")):
        pending = workload(condition("QuotaReserved", "False", "Pending", only_affinity), requests=requested)
        decision = decide(_observe(body, {"convert": (jobset(body, "convert", suspend=True), pending, None)}), SETTINGS)
        assert decision.status["message"] == f"convert step: queued in ClusterQueue cq-tpu; waiting for {waits_for}"


def test_what_a_workload_waits_for_is_read_from_kueues_message_and_its_requests():
    several = (
        "couldn't assign flavors to pod set worker: insufficient quota for google.com/tpu in flavor cpu-np, "
        "request > maximum capacity (16 > 0), flavor tpu-v6e-slice-2x2 doesn't match node affinity, "
        "insufficient unused quota for google.com/tpu in flavor tpu-v6e-slice-4x4, 16 more needed; "
        "couldn't assign flavors to pod set head: insufficient unused quota in cohort for cpu in flavor cpu-np, 2 more needed"
    )
    assert short_of(several) == (("google.com/tpu", "tpu-v6e-slice-4x4"), ("cpu", "cpu-np"))
    never_fits = "couldn't assign flavors to pod set worker: insufficient quota for google.com/tpu in flavor cpu-np, request > maximum capacity (16 > 0)"
    assert short_of(never_fits) == (("google.com/tpu", "cpu-np"),)
    assert short_of("Workload no longer fits after processing another workload") == ()
    halves = [{"name": "a", "resources": {"cpu": "500m", "memory": "1Gi"}}, {"name": "b", "resources": {"cpu": "2", "memory": "512Mi"}}]
    assert total_requests(halves) == {"cpu": "2.5", "memory": "1536Mi"}
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th",
    ]


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
    assert [backoff_seconds(n, SETTINGS) for n in (1, 2, 3, 4, 5)] == [10, 20, 40, 60, 60]


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


def test_a_lorajob_whose_first_status_write_was_skipped_still_has_a_start_and_a_deadline():
    """The pass that creates a new LoRAJob's first JobSet skips its status write (bursts): the start is the first
    step's creation, read from the children, so activeDeadlineSeconds fires (it once never did for a LoRAJob
    that started with train)."""
    spec = spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://bucket/qwen3/0/items"},
                     scheduling={"queueName": "lorajob", "activeDeadlineSeconds": 600})
    body = lorajob(spec=spec)
    check, train = jobset(body, "check", conditions=[COMPLETED]), jobset(body, "train")
    check["metadata"]["creationTimestamp"] = "2026-01-01T11:55:00Z"
    train["metadata"]["creationTimestamp"] = "2026-01-01T11:57:00Z"
    running = {"check": (check, None, None), "train": (train, _admitted(), None)}
    decision = decide(_observe(body, running), SETTINGS)
    assert decision.status["startTime"] == "2026-01-01T11:55:00Z" and decision.status["phase"] == "Training"

    late = decide(_observe(body, running, now=NOW + timedelta(minutes=6)), SETTINGS)
    assert late.status["phase"] == "Failed" and late.delete == ["qwen3-gsm8k"]
    assert _conditions(late)["Failed"]["reason"] == "DeadlineExceeded"


def test_ttl_deletes_the_finished_lorajob_when_it_expires():
    spec = spec_dict(scheduling={"queueName": "lorajob", "ttlSecondsAfterFinished": 60})
    body = lorajob(spec=spec, status={"phase": "Succeeded", "completionTime": "2026-01-01T11:59:30Z"})
    early = decide(_observe(body), SETTINGS)
    assert not early.delete_self and early.requeue_after == pytest.approx(30)
    assert decide(_observe(body, now=NOW + timedelta(seconds=31)), SETTINGS).delete_self


def test_operator_visible_spec_problems_block_with_a_clear_condition():
    problems = [("LocalQueueNotFound", "Kueue LocalQueue lorajob (spec.scheduling.queueName or a LoRAJobPolicy default) does not exist in namespace team-a")]
    decision = decide(_observe(lorajob(), problems=problems), SETTINGS)
    assert decision.create == [] and decision.status["phase"] == "Pending"
    blocked = _conditions(decision)["Blocked"]
    assert (blocked["status"], blocked["reason"]) == ("True", "LocalQueueNotFound")
    assert "LocalQueue lorajob" in decision.status["message"]

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


# --- Stall watchdog (scheduling.progressDeadlineSeconds) --------------------------------------------------

WATCHED = spec_dict(scheduling={"queueName": "lorajob", "progressDeadlineSeconds": 60, "infrastructureRetryLimit": 2})


def _step(step: int) -> str:
    return ProgressRecord(step=step, total_steps=20, loss=1.0).line()


def _train_running(body: dict, *, train: tuple | None = None) -> dict:
    """Convert completed, and the train step's JobSet (running, admitted, unless `train` says otherwise)."""
    converted = (jobset(body, "convert", conditions=[COMPLETED]), _admitted(), None)
    return {"convert": converted, "train": train or (jobset(body, "train"), _admitted(), None)}


def _at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def _stuck_at_step_7(*, restarts: int, infrastructure_restarts: int) -> tuple[dict, dict]:
    """A LoRAJob on train attempt `restarts` whose step counter last moved (to 7) at NOW."""
    progress = {"step": 7, "totalSteps": 20, "summary": " 7/20  35%", "state": "running", "advancedTime": "2026-01-01T12:00:00Z"}
    body = lorajob(spec=WATCHED, status={
        "phase": "Training", "progress": progress,
        "restarts": {"convert": 0, "train": restarts, "export": 0},
        "infrastructureRestarts": {"convert": 0, "train": infrastructure_restarts, "export": 0},
    })
    return body, _train_running(body, train=(jobset(body, "train", attempt=restarts), _admitted(), None))


def test_an_advancing_step_never_stalls():
    body = lorajob(spec=WATCHED, status={"phase": "Training"})
    for seconds, log in [(0, _step(1)), (50, _step(2)), (100, _step(3)), (150, None), (155, _step(3))]:
        decision = decide(_observe(body, _train_running(body), now=_at(seconds), train_log=log), SETTINGS)
        assert decision.delete == [] and decision.status["phase"] == "Training", seconds
        assert [e for e in decision.events if e.reason == STALLED] == []
        body = _with_status(body, decision)
    assert decision.status["progress"]["advancedTime"] == "2026-01-01T12:01:40Z"  # when step 3 was first seen
    assert decision.requeue_after == pytest.approx(5)  # woken at the deadline, 60 s after step 3


def test_a_frozen_step_past_the_deadline_restarts_as_an_infrastructure_failure_with_reason_stalled():
    body, children = _stuck_at_step_7(restarts=1, infrastructure_restarts=0)
    before = decide(_observe(body, children, now=_at(59), train_log=_step(7)), SETTINGS)
    assert before.delete == [] and before.requeue_after == pytest.approx(1)

    stalled = decide(_observe(body, children, now=_at(61), train_log=_step(7)), SETTINGS)
    assert stalled.delete == ["qwen3-gsm8k"] and stalled.create == []
    assert stalled.status["phase"] == "Training"
    assert (stalled.status["restarts"]["train"], stalled.status["infrastructureRestarts"]["train"]) == (2, 1)
    message = (
        "the train step stalled (JobSet qwen3-gsm8k): no new step for 61s (last step 7; "
        "scheduling.progressDeadlineSeconds=60); an infrastructure failure; retrying (1/2)"
    )
    assert stalled.status["message"] == message
    assert [(e.type, e.reason, e.message) for e in stalled.events] == [("Warning", "Stalled", message)]
    assert "advancedTime" not in stalled.status["progress"]  # the next try's clock starts when it runs

    # The stalled try is deleted, then try 2 is created; the retry is not a retryLimit one.
    body = _with_status(body, stalled)
    deleting = _train_running(body, train=(jobset(body, "train", attempt=1, deleting=True), None, None))
    assert decide(_observe(body, deleting, now=_at(62)), SETTINGS).create == []
    assert decide(_observe(body, {"convert": deleting["convert"]}, now=_at(63)), SETTINGS).create == [Create("train", 2)]


def test_a_step_that_never_prints_progress_counts_from_when_it_started_running():
    body = lorajob(spec=WATCHED, status={"phase": "Training"})
    started = decide(_observe(body, _train_running(body), train_log="loading checkpoint\n"), SETTINGS)
    assert started.status["progress"] == {"advancedTime": "2026-01-01T12:00:00Z"}
    body = _with_status(body, started)
    stalled = decide(_observe(body, _train_running(body), now=_at(60), train_log="loading checkpoint\n"), SETTINGS)
    assert stalled.delete == ["qwen3-gsm8k"]
    assert "no new step for 60s (no step reported yet;" in stalled.status["message"]


def test_without_a_progress_deadline_a_frozen_step_never_stalls():
    progress = {"step": 7, "totalSteps": 20, "summary": " 7/20  35%"}
    body = lorajob(status={"phase": "Training", "progress": progress})
    decision = decide(_observe(body, _train_running(body), now=_at(86_400), train_log=_step(7)), SETTINGS)
    assert decision.delete == [] and decision.events == [] and decision.requeue_after is None
    assert "advancedTime" not in decision.status["progress"]


def test_time_queued_or_suspended_does_not_count():
    pending = workload(condition("QuotaReserved", "False", "Pending", "waiting"))
    old = {"step": 7, "totalSteps": 20, "summary": " 7/20  35%", "advancedTime": "2026-01-01T10:00:00Z"}
    body = lorajob(spec=WATCHED, status={"phase": "Training", "progress": old})
    queued = decide(_observe(body, _train_running(body, train=(jobset(body, "train", suspend=True), pending, None))), SETTINGS)
    assert queued.status["phase"] == "Queued" and queued.delete == []
    assert "advancedTime" not in queued.status["progress"]

    # Admitted two hours later: the clock starts now, not when the step last ran or was created.
    body = _with_status(body, queued)
    admitted = decide(_observe(body, _train_running(body), now=_at(7200)), SETTINGS)
    assert admitted.status["progress"]["advancedTime"] == "2026-01-01T14:00:00Z" and admitted.delete == []

    # Suspended, then resumed: the clock restarts with the resumed step.
    body = _with_status(body, admitted)
    suspended = decide(_observe(lorajob(spec={**WATCHED, "suspend": True}, status=body["status"]), _train_running(body),
                               now=_at(7230)), SETTINGS)
    assert suspended.status["phase"] == "Suspended" and "advancedTime" not in suspended.status["progress"]
    body = _with_status(body, suspended)
    resumed = decide(_observe(body, _train_running(body), now=_at(9000)), SETTINGS)
    assert resumed.delete == [] and resumed.status["progress"]["advancedTime"] == "2026-01-01T14:30:00Z"


def test_a_stall_with_the_infrastructure_budget_used_up_fails_the_lorajob_and_stops_the_step():
    body, children = _stuck_at_step_7(restarts=2, infrastructure_restarts=2)
    decision = decide(_observe(body, children, now=_at(90)), SETTINGS)
    assert decision.status["phase"] == "Failed" and decision.delete == ["qwen3-gsm8k"] and decision.create == []
    failed = _conditions(decision)["Failed"]
    assert failed["reason"] == "Stalled"
    assert failed["message"].endswith("no new step for 90s (last step 7; scheduling.progressDeadlineSeconds=60); "
                                      "an infrastructure failure; giving up after 2 retries")
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "Failed")]


def test_the_evaluation_after_the_last_step_restarts_the_stall_clock_and_its_line_lands_in_status():
    body, children = _stuck_at_step_7(restarts=0, infrastructure_restarts=0)
    evaluating = ProgressRecord(step=7, total_steps=20, loss=1.0, state="evaluating").line()
    decision = decide(_observe(body, children, now=_at(59), train_log=evaluating), SETTINGS)
    assert decision.delete == [] and decision.status["progress"]["advancedTime"] == "2026-01-01T12:00:59Z"
    record = EvalRecord(scorer="contains", examples=4, step=7, max_new_tokens=8, seconds=2.0,
                        base=ModelScore(0.25, 0.5, 8.0), adapter=ModelScore(0.75, 1.0, 3.25))
    status = decide(_observe(body, children, now=_at(60), train_log=evaluating + "\n" + record.line()), SETTINGS).status
    assert status["evaluation"] == {
        "scorer": "contains", "examples": 4, "step": 7, "seconds": 2.0, "samples": [],
        "base": {"score": 0.25, "stopRate": 0.5, "meanLength": 8.0}, "adapter": {"score": 0.75, "stopRate": 1.0, "meanLength": 3.2},
    }
    kept = decide(_observe(lorajob(spec=WATCHED, status=status), children, now=_at(61), train_log=None), SETTINGS).status
    assert kept["evaluation"] == status["evaluation"]


def test_an_evaluating_train_step_is_not_finished_so_its_log_is_read_after_it_ends():
    train = ChildState(name="r", phase="train", attempt=0, owned=True, deleting=False, completed=True, failed=False,
                                 failed_at=None, failure_reason="", failure_message="", suspended=False, lead_pod_selector="x=y")
    assert train_log_wanted({"progress": {"step": 20, "totalSteps": 20, "state": "evaluating"}}, train)
    assert not train_log_wanted({"progress": {"step": 20, "totalSteps": 20, "state": "succeeded"}}, train)
