"""Failure classes of a failed step: user errors fail at once with the trainer's message, infrastructure
failures retry on a budget of their own, anything else within retryLimit; and the grace period that
lets a trainer save a checkpoint on SIGTERM."""

from __future__ import annotations

from datetime import datetime, timedelta, UTC

import pytest
from builders import UID, compute, condition, failed_pod, jobset, lorajob, owner, parsed, spec_dict, workload

from lorajob_operator import jobsets, names
from lorajob_operator.reconcile.decide import Create, decide
from lorajob_operator.reconcile.observed import Observed, observe_child
from lorajob_operator.validation import parse_spec
from lorajob_operator.settings import ReconcileSettings, RenderSettings
from lorajob_trainer.contract import exit_codes

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
AFTER_BACKOFF = NOW + timedelta(minutes=5)
SETTINGS = ReconcileSettings(retry_backoff_seconds=10, retry_backoff_max_seconds=60)
HEAD_POD = "qwen3-gsm8k-pathways-head-0-0-xyz12"
TRAINER_LINE = "training failed before step 1: DataError: dataset lacks column(s) ['question']; it has ['text']"


def _admitted() -> dict:
    return workload(condition("QuotaReserved"), condition("Admitted"), cluster_queue="cq-tpu")


def _observe(body: dict, pods: list[dict] | None, now: datetime = NOW) -> Observed:
    """Convert completed; the train step of `body` failed with these pods (None: it has no JobSet)."""
    spec, errors = parse_spec(body)
    children = {"convert": observe_child(jobset(body, "convert", conditions=[condition("Completed")]), UID, _admitted())}
    if pods is not None:
        attempt = body["status"]["restarts"]["train"]
        failed = condition("Failed", reason="FailedJobs", message="jobset failed due to one or more job failures")
        children["train"] = observe_child(jobset(body, "train", attempt=attempt, conditions=[failed]), UID, _admitted(), pods)
    return Observed(
        name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], generation=body["metadata"]["generation"],
        spec=spec, spec_errors=errors, status=body.get("status") or {}, children=children,
        problems=(), cluster_queue="cq-tpu", now=now,
    )


def _trainer_pod(exit_code: int, message: str = "") -> dict:
    pod = failed_pod(HEAD_POD, names.TRAINER_CONTAINER, exit_code)
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = message
    return pod


def _disrupted_pod(**status) -> dict:
    pod = failed_pod("qwen3-gsm8k-worker-0-0-abcde", "pathways-worker", 143)
    pod["status"].update(status)
    return pod


def _training(restarts: int = 0, infrastructure: int = 0, **scheduling) -> dict:
    spec = spec_dict()
    spec["scheduling"] = {**spec["scheduling"], **scheduling}
    return lorajob(spec=spec, status={
        "phase": "Training",
        "restarts": {"convert": 0, "train": restarts, "export": 0},
        "infrastructureRestarts": {"convert": 0, "train": infrastructure, "export": 0},
    })


def _failed_condition(decision) -> dict:
    return next(c for c in decision.status["conditions"] if c["type"] == "Failed")


@pytest.mark.parametrize("code", [e.code for e in exit_codes.TABLE if e.kind is exit_codes.Kind.user])
def test_a_user_error_fails_at_once_with_the_trainers_message(code):
    log_tail = f'LORAJOB_PROGRESS {{"step": 0}}\n{TRAINER_LINE}\n'  # FallbackToLogsOnError: the log's tail
    decision = decide(_observe(_training(), [_trainer_pod(code, log_tail)]), SETTINGS)
    assert decision.status["phase"] == "Failed" and decision.delete == [] and decision.create == []
    failed = _failed_condition(decision)
    assert failed["reason"] == exit_codes.BY_CODE[code].name
    assert f"exited with code {code} (Error): {TRAINER_LINE}; not retried" in failed["message"]
    assert "LORAJOB_PROGRESS" not in failed["message"]
    assert decision.status["restarts"]["train"] == 0


@pytest.mark.parametrize("pods, cause", [
    ([_trainer_pod(exit_codes.PREEMPTED, "training stopped: stopped by SIGTERM after step 7")], "code 8"),
    ([_trainer_pod(exit_codes.CHECKPOINT_WRITE)], "code 7"),
    ([_trainer_pod(137)], "code 137"),
    ([_disrupted_pod(conditions=[condition("DisruptionTarget", reason="PreemptionByScheduler")])],
     "PreemptionByScheduler"),
    ([_disrupted_pod(conditions=[condition("DisruptionTarget", reason="DeletionByTaintManager")])],
     "DeletionByTaintManager"),
    ([_disrupted_pod(reason="Evicted"), _trainer_pod(exit_codes.UNEXPECTED)], "Evicted"),
], ids=["sigterm-checkpointed", "checkpoint-write", "sigkill", "preempted", "node-lost", "evicted"])
def test_an_infrastructure_failure_retries_without_using_up_retry_limit(pods, cause):
    body = _training(restarts=5, infrastructure=5, retryLimit=0)  # five infrastructure retries so far, none other
    decision = decide(_observe(body, pods, now=AFTER_BACKOFF), SETTINGS)
    assert decision.delete == ["qwen3-gsm8k"], decision.status["message"]
    assert decision.status["restarts"]["train"] == 6
    assert decision.status["infrastructureRestarts"]["train"] == 6
    assert "infrastructure failure" in decision.status["message"] and cause in decision.status["message"]
    assert "retrying (6/10)" in decision.status["message"]
    # The next pass, the failed try deleted, creates try 6 under the same name.
    retried = lorajob(spec=body["spec"], status=decision.status)
    assert decide(_observe(retried, None, now=AFTER_BACKOFF), SETTINGS).create == [Create("train", 6)]


def test_the_infrastructure_budget_runs_out_on_its_own():
    body = _training(restarts=3, infrastructure=3, infrastructureRetryLimit=3)
    decision = decide(_observe(body, [_trainer_pod(137)], now=AFTER_BACKOFF), SETTINGS)
    assert decision.status["phase"] == "Failed"
    assert "giving up after 3 retries" in _failed_condition(decision)["message"]


def test_an_unclassified_failure_uses_retry_limit_minus_the_infrastructure_retries():
    body = _training(restarts=4, infrastructure=3, retryLimit=2)  # one retry of the two used
    retrying = decide(_observe(body, [_trainer_pod(exit_codes.UNEXPECTED)], now=AFTER_BACKOFF), SETTINGS)
    assert retrying.delete == ["qwen3-gsm8k"] and "retrying (2/2)" in retrying.status["message"]
    assert retrying.status["infrastructureRestarts"]["train"] == 3

    spent = _training(restarts=5, infrastructure=3, retryLimit=2)
    failed = decide(_observe(spent, [_trainer_pod(exit_codes.UNEXPECTED)], now=AFTER_BACKOFF), SETTINGS)
    assert failed.status["phase"] == "Failed" and "giving up after 2 retries" in failed.status["message"]


def test_a_user_error_is_not_retried_even_when_a_pod_was_also_evicted():
    pods = [_disrupted_pod(reason="Evicted"), _trainer_pod(exit_codes.CONFIG, "config error: unknown key lora.rank")]
    decision = decide(_observe(_training(), pods, now=AFTER_BACKOFF), SETTINGS)
    assert decision.status["phase"] == "Failed" and _failed_condition(decision)["reason"] == "InvalidConfig"


def test_codes_of_other_containers_are_not_read_as_the_trainers():
    """A Pathways worker exiting 3 is not the trainer's InvalidData."""
    pod = failed_pod("qwen3-gsm8k-worker-0-0-abcde", "pathways-worker", exit_codes.DATA)
    decision = decide(_observe(_training(), [pod], now=AFTER_BACKOFF), SETTINGS)
    assert decision.status["phase"] != "Failed" and decision.status["restarts"]["train"] == 1
    assert decision.status["infrastructureRestarts"]["train"] == 0


# --- The grace period after SIGTERM ----------------------------------------------------------------

@pytest.mark.parametrize("backend", ["pathways", "mcjax", "gpu"])
def test_train_pods_get_the_grace_period_of_the_spec(backend):
    spec = spec_dict(compute=compute(backend))
    body = lorajob(spec=spec)
    default = jobsets.render_phase("train", parsed(body), owner(body), RenderSettings())
    spec["scheduling"] = {**spec["scheduling"], "terminationGracePeriodSeconds": 600}
    body = lorajob(spec=spec)
    chosen = jobsets.render_phase("train", parsed(body), owner(body), RenderSettings())
    for jobset_obj, seconds in ((default, 120), (chosen, 600)):
        pods = [job["template"]["spec"]["template"]["spec"] for job in jobset_obj["spec"]["replicatedJobs"]]
        assert [pod["terminationGracePeriodSeconds"] for pod in pods] == [seconds] * len(pods)
        trainers = [c for pod in pods for c in pod["containers"] if c["name"] == names.TRAINER_CONTAINER]
        assert trainers and all(c["terminationMessagePolicy"] == "FallbackToLogsOnError" for c in trainers)
