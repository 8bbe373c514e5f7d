"""Training progress: the trainer's progress lines, lifted from its log tail into status.progress without
ever touching the phase."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, UTC
from pathlib import Path

import pytest
from builders import UID, compute, condition, jobset, lorajob, owner, spec_dict, workload

from lorajob_operator.reconcile.decide import decide
from lorajob_operator.reconcile.observed import Observed, lead_pod_selector, observe_child
from lorajob_operator.reconcile.status_text import progress_summary
from lorajob_operator.reconcile.trainer_output import (
    checks_log_wanted, checks_step, parse_progress_line, progress_from_log, train_log_wanted,
)
from lorajob_operator import api
from lorajob_operator.controller.trainer_logs import TrainLogs
from lorajob_operator.step_commands import export_command, train_command
from lorajob_operator.validation import parse_spec
from lorajob_operator.settings import ReconcileSettings
from lorajob_trainer.contract.records import PROGRESS_LINE_PREFIX, CheckpointRecord, DataRecord, PlanRecord, ProgressRecord, RunLayout
from lorajob_trainer.metrics import MetricsWriter

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = ReconcileSettings()
COMPLETED = condition("Completed", reason="AllJobsCompleted")
TRAIN_ONLY = spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://bucket/qwen3/0/items"}, export={"enabled": False})


def line(**values) -> str:
    return PROGRESS_LINE_PREFIX + json.dumps(values, separators=(",", ":"))


GOOD = line(step=120, total_steps=500, loss=1.25, tokens_per_second=3100.5, eta_seconds=371.6, state="running")


# --- One line ---------------------------------------------------------------------------------------------

def test_a_progress_line_gives_every_field_and_the_summary():
    progress = parse_progress_line(GOOD)
    assert progress.model_dump(by_alias=True, exclude_none=True) == {
        "step": 120, "totalSteps": 500, "loss": 1.25, "tokensPerSecond": 3100.5, "etaSeconds": 372,
        "state": "running", "summary": "120/500  24%",
    }


def test_the_rows_an_expert_parallel_step_dropped_reach_status():
    progress = parse_progress_line(line(step=12, total_steps=500, state="running", expert_rows_dropped=4096))
    assert progress.model_dump(by_alias=True, exclude_none=True)["expertRowsDropped"] == 4096
    assert parse_progress_line(GOOD).expert_rows_dropped is None


def test_a_preference_runs_figures_reach_status_as_loss_does():
    progress = parse_progress_line(line(
        step=40, total_steps=1000, loss=0.512345, state="running", reward_accuracy=0.8125, reward_margin=1.234567,
        chosen_logps=-210.56789, rejected_logps=-260.2345, eval_loss=0.6, eval_step=40, eval_preference_accuracy=0.75))
    assert {key: value for key, value in progress.model_dump(by_alias=True, exclude_none=True).items()
            if key not in ("step", "totalSteps", "state", "summary")} == {
        "loss": 0.5123, "rewardAccuracy": 0.8125, "rewardMargin": 1.235, "chosenLogps": -210.6, "rejectedLogps": -260.2,
        "evalLoss": 0.6, "evalStep": 40, "evalPreferenceAccuracy": 0.75,
    }
    assert api.Progress.model_validate(progress.model_dump(by_alias=True)) == progress  # the CRD's schema holds them
    sft = parse_progress_line(GOOD).model_dump(by_alias=True, exclude_none=True)
    assert not sft.keys() & {"rewardAccuracy", "rewardMargin", "chosenLogps", "rejectedLogps", "evalPreferenceAccuracy"}


def test_a_compiling_train_step_shows_compiling_until_its_first_step():
    progress = parse_progress_line(line(step=0, total_steps=500, tokens_per_second=0.0, state="compiling",
                                        message="compiling the train step; its first step follows"))
    assert (progress.state, progress.summary, progress.step) == ("compiling", "compiling", 0)


def test_unknown_values_are_left_out_not_invented():
    progress = parse_progress_line(line(step=3, total_steps=10, loss=None, tokens_per_second=0.0, eta_seconds=None))
    assert progress.model_dump(by_alias=True, exclude_none=True) == {
        "step": 3, "totalSteps": 10, "tokensPerSecond": 0.0, "summary": " 3/10  30%",
    }


@pytest.mark.parametrize("text", [
    "step 120/500 loss 1.25",  # an ordinary log line
    PROGRESS_LINE_PREFIX.strip(),
    PROGRESS_LINE_PREFIX + '{"step":120,"total_steps":5',  # cut short
    PROGRESS_LINE_PREFIX + "[120, 500]",
    PROGRESS_LINE_PREFIX + "not json",
    line(total_steps=500),  # no step
    line(step="120", total_steps=500),
    line(step=True, total_steps=500),
    line(step=-1, total_steps=500),
    line(step=1.5, total_steps=500),
    line(step=120, total_steps=0),
    PROGRESS_LINE_PREFIX + '{"step":120,"total_steps":500,"loss":NaN}',
    line(step=120, total_steps=500, loss="low"),
    line(step=120, total_steps=500, eta_seconds=[1]),
    line(step=120, total_steps=500, expert_rows_dropped=-3),
    line(step=120, total_steps=500, expert_rows_dropped=2.5),
], ids=range(16))
def test_anything_but_a_well_formed_progress_line_is_ignored(text):
    assert parse_progress_line(text) is None


@pytest.mark.parametrize("step, total, summary", [
    (120, 500, "120/500  24%"),
    (0, 10, " 0/10   0%"),
    (7, 500, "  7/500   1%"),
    (499, 500, "499/500  99%"),  # never rounded up to a finished-looking 100%
    (500, 500, "500/500 100%"),
    (7, None, "7"),
])
def test_summary(step, total, summary):
    assert progress_summary(step, total) == summary


def test_a_runs_summary_is_as_wide_at_every_step_so_watch_columns_stay_put():
    assert {len(progress_summary(step, 1000)) for step in range(1001)} == {len("1000/1000 100%")}


def test_the_summary_says_compiling_until_the_first_step_has_run():
    assert progress_summary(0, 500, "compiling") == "compiling"
    assert progress_summary(300, 500, "compiling") == "compiling"  # resumed: compiling again before step 301
    assert progress_summary(301, 500, "running") == "301/500  60%"


def test_the_line_the_trainer_prints_is_the_one_the_operator_reads(tmp_path, capsys):
    writer = MetricsWriter(RunLayout(str(tmp_path), "run"), total_steps=40, enabled=True, tensorboard=False, progress_lines=True)
    writer.progress(12, loss=2.5, tokens_per_second=812.0, eta_seconds=30.2, state="running")
    writer.progress(40, loss=float("nan"), tokens_per_second=790.0, eta_seconds=float("nan"), state="succeeded")
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(text.startswith(PROGRESS_LINE_PREFIX) for text in printed)
    first, last = (parse_progress_line(text) for text in printed)
    assert (first.step, first.total_steps, first.loss, first.tokens_per_second, first.eta_seconds) == (12, 40, 2.5, 812.0, 30)
    assert (last.summary, last.loss, last.eta_seconds) == ("40/40 100%", None, None)


def test_only_the_lead_process_prints(tmp_path, capsys):
    MetricsWriter(RunLayout(str(tmp_path), "run"), total_steps=40, enabled=False, tensorboard=False, progress_lines=True).progress(
        1, loss=1.0, tokens_per_second=1.0, eta_seconds=1.0, state="running")
    assert capsys.readouterr().out == ""


def test_a_person_running_the_trainer_sees_no_json_but_the_progress_file_is_written(tmp_path, capsys):
    layout = RunLayout(str(tmp_path), "run")
    MetricsWriter(layout, total_steps=40, enabled=True, tensorboard=False, progress_lines=False).progress(
        1, loss=1.0, tokens_per_second=1.0, eta_seconds=1.0, state="running")
    assert capsys.readouterr().out == ""
    assert Path(layout.progress).exists()


def test_the_rendered_train_pods_turn_the_progress_lines_on():
    assert "progress_lines=true" in train_command(api.LoRAJobSpec.model_validate(spec_dict()), "run-1", owner(lorajob()))


# --- A log tail -------------------------------------------------------------------------------------------

def test_the_last_progress_line_of_a_tail_wins_over_older_ones_and_other_output():
    tail = "\n".join([
        line(step=5, total_steps=10, loss=2.0),
        "2026-01-01 12:00:00 INFO lorajob_trainer.train: step 5/10 loss 2.0000",
        line(step=6, total_steps=10, loss=1.5),
        "W0101 jax warning",
    ])
    assert progress_from_log(tail).summary == " 6/10  60%"


def test_a_garbled_last_line_falls_back_to_the_last_readable_one():
    tail = "\n".join([line(step=6, total_steps=10, loss=1.5), PROGRESS_LINE_PREFIX + '{"step":7,"total_st'])
    assert progress_from_log(tail).step == 6


@pytest.mark.parametrize("tail", ["", "\n", "starting\nloading checkpoint\n", PROGRESS_LINE_PREFIX + "{"])
def test_a_tail_without_a_progress_line_gives_none(tail):
    assert progress_from_log(tail) is None


# --- Which pod runs process 0 -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend, replicated_job", [("pathways", "pathways-head"), ("mcjax", "worker"), ("gpu", "worker")])
def test_the_lead_pod_is_pod_0_of_job_0_of_the_replicated_job_running_the_trainer(backend, replicated_job):
    body = lorajob(spec=spec_dict(compute=compute(backend, slices=2)))
    selector = lead_pod_selector(jobset(body, "train"))
    assert selector == (
        f"jobset.sigs.k8s.io/jobset-name=qwen3-gsm8k,jobset.sigs.k8s.io/replicatedjob-name={replicated_job},"
        "jobset.sigs.k8s.io/job-index=0,batch.kubernetes.io/job-completion-index=0"
    )


# --- When the log is read ---------------------------------------------------------------------------------

def _train(body: dict, **jobset_args) -> object:
    return observe_child(jobset(body, "train", **jobset_args), UID, workload(condition("QuotaReserved"), condition("Admitted")))


def test_the_log_is_read_while_the_train_step_runs_and_not_while_kueue_holds_it():
    body = lorajob(spec=TRAIN_ONLY)
    assert train_log_wanted({}, _train(body))
    assert not train_log_wanted({}, _train(body, suspend=True))
    assert not train_log_wanted({}, _train(body, deleting=True))
    assert not train_log_wanted({}, _train(body, owner_uid="someone-else"))
    assert not train_log_wanted({}, None)


def test_after_the_step_finished_the_log_is_read_only_until_progress_shows_the_last_step():
    body = lorajob(spec=TRAIN_ONLY)
    done = _train(body, conditions=[COMPLETED])
    assert train_log_wanted({"progress": {"step": 8, "totalSteps": 10}}, done)
    assert train_log_wanted({}, done)
    assert not train_log_wanted({"progress": {"step": 10, "totalSteps": 10}}, done)


# --- status.progress in the decision ----------------------------------------------------------------------

def _checked(body: dict) -> object:
    """The completed check step of a chain without convert."""
    return observe_child(jobset(body, "check", conditions=[COMPLETED]), UID, None)


def _observed(body: dict, train, train_log: str | None) -> Observed:
    spec, errors = parse_spec(body)
    return Observed(
        name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], generation=1, spec=spec,
        spec_errors=errors, status=body.get("status") or {},
        children={"check": _checked(body), "train": train} if train else {}, problems=(),
        cluster_queue="cq-tpu", now=NOW, train_log=train_log,
    )


def _without_progress(decision) -> tuple:
    status = {key: value for key, value in decision.status.items() if key != "progress"}
    return status, decision.create, decision.delete, decision.events, decision.requeue_after


@pytest.mark.parametrize("train_log", [None, "", "no progress yet", PROGRESS_LINE_PREFIX + "{garbled", GOOD])
def test_progress_never_changes_the_phase_or_anything_else(train_log):
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Queued"})
    baseline = decide(_observed(body, _train(body), None), SETTINGS)
    decision = decide(_observed(body, _train(body), train_log), SETTINGS)
    assert decision.status["phase"] == "Training"
    assert _without_progress(decision) == _without_progress(baseline)


def test_a_running_step_s_progress_is_lifted_into_status():
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Training"})
    decision = decide(_observed(body, _train(body), "loading\n" + GOOD + "\n"), SETTINGS)
    assert decision.status["progress"]["summary"] == "120/500  24%"
    assert decision.status["progress"]["loss"] == 1.25


def test_status_holds_losses_to_four_significant_digits_as_kubectl_prints_them():
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Training"})
    record = line(step=12, total_steps=30, loss=6.832830905914307, eval_loss=0.00012934567, eval_step=10)
    progress = decide(_observed(body, _train(body), record), SETTINGS).status["progress"]
    assert (progress["loss"], progress["evalLoss"]) == (6.833, 0.0001293)


@pytest.mark.parametrize("train_log", [None, "", "pod restarted, nothing yet", PROGRESS_LINE_PREFIX + "{garbled"])
def test_a_log_without_news_keeps_the_recorded_progress(train_log):
    recorded = {"step": 7, "totalSteps": 10, "loss": 0.5, "summary": " 7/10  70%"}
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Training", "progress": recorded})
    assert decide(_observed(body, _train(body), train_log), SETTINGS).status["progress"] == recorded


def test_on_success_progress_shows_the_final_step_the_trainer_reported():
    recorded = {"step": 9, "totalSteps": 10, "summary": " 9/10  90%"}
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Training", "progress": recorded})
    final = line(step=10, total_steps=10, loss=0.25, tokens_per_second=900.0, eta_seconds=0.0, state="succeeded")
    tail = "\n".join([line(step=9, total_steps=10, loss=0.3), "saving checkpoint 10", final])
    decision = decide(_observed(body, _train(body, conditions=[COMPLETED]), tail), SETTINGS)
    assert decision.status["phase"] == "Succeeded"
    assert decision.status["progress"] == {
        "step": 10, "totalSteps": 10, "loss": 0.25, "tokensPerSecond": 900.0, "etaSeconds": 0, "state": "succeeded",
        "summary": "10/10 100%",
    }
    # Later passes read nothing (the JobSet and its pods may be gone): the record stays.
    later = lorajob(spec=TRAIN_ONLY, status=decision.status)
    assert decide(_observed(later, None, None), SETTINGS).status["progress"] == decision.status["progress"]


# --- status.tracking, TrackingDegraded and the Argo CD links to the runs -----------------------------------

TRACKED = spec_dict(model=TRAIN_ONLY["model"], export={"enabled": False},
                    tracking={"mlflow": {"trackingUri": "https://mlflow.example.com"}, "wandb": {"project": "p", "mode": "offline"}})
URLS = {"mlflow": "https://mlflow.example.com/#/experiments/3/runs/9f1c", "wandb": "https://wandb.ai/team/p/runs/x7"}
DOWN = "mlflow: https://mlflow.example.com unreachable (ConnectionError); 12 updates wait to be sent"


def _tracking_line(step: int, problem: str | None, urls: dict | None = URLS) -> str:
    return line(step=step, total_steps=500, loss=1.0, state="running", tracking_urls=urls, tracking_problem=problem)


def _degraded(status: dict) -> dict | None:
    return next((c for c in status["conditions"] if c["type"] == "TrackingDegraded"), None)


def test_the_tracker_runs_reach_status_and_argo_cd_links_and_a_healthy_tracking_says_so():
    body = lorajob(spec=TRACKED, status={"phase": "Training"})
    decision = decide(_observed(body, _train(body), _tracking_line(12, "")), SETTINGS)
    assert decision.status["tracking"] == {"mlflow": {"url": URLS["mlflow"]}, "wandb": {"url": URLS["wandb"]}}
    degraded = _degraded(decision.status)
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("False", "TrackersReporting", "")
    assert decision.annotations == {
        "link.argocd.argoproj.io/mlflow-run": f"MLflow run|{URLS['mlflow']}",
        "link.argocd.argoproj.io/wandb-run": f"Weights & Biases run|{URLS['wandb']}",
    }
    assert not [event for event in decision.events if event.reason == "TrackingDegraded"]


def test_a_failing_tracker_degrades_tracking_but_never_the_phase_and_warns_once():
    body = lorajob(spec=TRACKED, status={"phase": "Training"})
    healthy = decide(_observed(body, _train(body), _tracking_line(12, "")), SETTINGS)
    failing = decide(_observed(body, _train(body), _tracking_line(12, DOWN)), SETTINGS)
    degraded = _degraded(failing.status)
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "TrackerFailing", DOWN)
    assert (failing.status["phase"], failing.status["message"]) == (healthy.status["phase"], healthy.status["message"])
    assert (failing.create, failing.delete, failing.requeue_after) == (healthy.create, healthy.delete, healthy.requeue_after)
    assert [(e.type, e.reason, e.message) for e in failing.events] == [("Warning", "TrackingDegraded", DOWN)]
    still = lorajob(spec=TRACKED, status=failing.status)  # the next pass: still failing, no second warning
    again = decide(_observed(still, _train(still), _tracking_line(13, DOWN)), SETTINGS)
    assert _degraded(again.status)["status"] == "True" and not again.events
    recovered = decide(_observed(still, _train(still), _tracking_line(14, "")), SETTINGS)
    assert _degraded(recovered.status)["status"] == "False"


def test_a_run_without_trackers_has_no_tracking_status_condition_or_link():
    body = lorajob(spec=TRAIN_ONLY, status={"phase": "Training"})
    decision = decide(_observed(body, _train(body), _tracking_line(12, None, urls=None)), SETTINGS)
    assert "tracking" not in decision.status and _degraded(decision.status) is None
    assert decision.annotations == {}


def test_links_are_written_only_where_the_lorajob_lacks_them_or_holds_another_address():
    body = lorajob(spec=TRACKED, status={"phase": "Training"})
    observed = dataclasses.replace(_observed(body, _train(body), _tracking_line(12, "")), annotations={
        "link.argocd.argoproj.io/mlflow-run": f"MLflow run|{URLS['mlflow']}",
        "link.argocd.argoproj.io/wandb-run": "Weights & Biases run|https://wandb.ai/team/p/runs/old",
    })
    assert decide(observed, SETTINGS).annotations == {
        "link.argocd.argoproj.io/wandb-run": f"Weights & Biases run|{URLS['wandb']}"}


@pytest.mark.parametrize("train_log", [None, "", line(step=13, total_steps=500, loss=1.0)])
def test_a_log_without_tracking_news_keeps_the_runs_and_the_condition(train_log):
    body = lorajob(spec=TRACKED, status={"phase": "Training"})
    failing = decide(_observed(body, _train(body), _tracking_line(12, DOWN)), SETTINGS).status
    later = lorajob(spec=TRACKED, status=failing)
    decision = decide(_observed(later, _train(later), train_log), SETTINGS)
    assert decision.status["tracking"] == failing["tracking"] and _degraded(decision.status) == _degraded(failing)


# --- status.checkpoints and the exported step -------------------------------------------------------------

WITH_EXPORT = spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://bucket/qwen3/0/items"},
                        dataset={"name": "openai/gsm8k", "columns": ["question", "answer"], "evalSplit": "test"})


def _checkpoint_line(step: int, total: int = 30, **values) -> str:
    kept = [CheckpointRecord(10, 1.5, 1.9, 1767268800.0), CheckpointRecord(20, 1.0, 1.2, 1767268860.0),
            CheckpointRecord(30, 0.8, 1.4, 1767268920.0)]
    return ProgressRecord(step=step, total_steps=total, loss=0.8, eval_loss=1.4, eval_step=30, checkpoints=kept,
                          **values).line()


def test_the_kept_checkpoints_and_the_latest_eval_loss_are_in_status():
    body = lorajob(spec=WITH_EXPORT, status={"phase": "Training"})
    decision = decide(_observed(body, _train(body), _checkpoint_line(29)), SETTINGS)
    assert decision.status["checkpoints"] == [
        {"step": 10, "time": "2026-01-01T12:00:00Z", "trainLoss": 1.5, "evalLoss": 1.9,
         "path": "gs://bucket/runs/qwen3-gsm8k/checkpoints/10"},
        {"step": 20, "time": "2026-01-01T12:01:00Z", "trainLoss": 1.0, "evalLoss": 1.2,
         "path": "gs://bucket/runs/qwen3-gsm8k/checkpoints/20"},
        {"step": 30, "time": "2026-01-01T12:02:00Z", "trainLoss": 0.8, "evalLoss": 1.4,
         "path": "gs://bucket/runs/qwen3-gsm8k/checkpoints/30"},
    ]
    assert (decision.status["progress"]["evalLoss"], decision.status["progress"]["evalStep"]) == (1.4, 30)
    assert "exportedStep" not in decision.status["outputs"]  # training has not finished: the list may change
    later = lorajob(spec=WITH_EXPORT, status=decision.status)
    assert decide(_observed(later, _train(later), "no news"), SETTINGS).status["checkpoints"] == decision.status["checkpoints"]


@pytest.mark.parametrize("step, exported", [("latest", 30), ("best", 20), ("10", 10), ("15", None)])
def test_once_training_finished_outputs_name_the_step_export_takes(step, exported):
    body = lorajob(spec={**WITH_EXPORT, "export": {"step": step}}, status={"phase": "Training"})
    final = _checkpoint_line(30, state="succeeded")
    decision = decide(_observed(body, _train(body, conditions=[COMPLETED]), final), SETTINGS)
    assert decision.status["outputs"].get("exportedStep") == exported
    assert "--step" in (command := export_command(parse_spec(body)[0], "qwen3-gsm8k", owner(body))) and step in command


def test_a_run_that_stopped_early_succeeds_with_reason_early_stopped_and_exports_the_best_step():
    spec = {**WITH_EXPORT, "training": {"steps": 100, "earlyStopping": {"patience": 2}}}
    body = lorajob(spec=spec, status={"phase": "Exporting"})
    stopped = _checkpoint_line(30, total=100, state="stopped_early", message="eval loss did not improve on 1.2000")
    children = {"check": _checked(body), "train": _train(body, conditions=[COMPLETED]),
                "export": observe_child(jobset(body, "export", conditions=[COMPLETED]), UID, None)}
    observed = dataclasses.replace(_observed(body, None, stopped), children=children)
    decision = decide(observed, SETTINGS)
    assert decision.status["phase"] == "Succeeded"
    assert decision.status["message"] == "stopped early at step 30 of 100 (70 steps not run)"
    (succeeded,) = [c for c in decision.status["conditions"] if c["type"] == "Succeeded"]
    assert succeeded["reason"] == "EarlyStopped"
    assert succeeded["message"].endswith(": eval loss did not improve on 1.2000")
    assert decision.status["outputs"]["exportedStep"] == 20  # best by eval loss, export.step's default here
    command = export_command(parse_spec(body)[0], "qwen3-gsm8k", owner(body))
    assert command[command.index("--step") + 1] == "best"


# --- status.data and status.plan: the data and fit checks' figures, from the convert step's log -------------

DATA = DataRecord(examples=7473, tokens=1402116, trained_tokens=512330, epochs=4.28, truncated_examples=12, truncated_share=0.003)
PLAN = PlanRecord(fits=True, target="tpu-v6e-slice 4x4 (16 chips), per-device batch 1 x 1 accumulation", chips=16,
                  hbm_bytes_per_chip=14_630_000_000, capacity_bytes=30_923_764_531, step_seconds=0.25,
                  tokens_per_second_per_chip=4096.0, mfu=0.08, bound="ICI collectives", compile_seconds=565.0)


def _convert(body: dict, **jobset_args) -> object:
    return observe_child(jobset(body, "convert", **jobset_args), UID, workload(condition("QuotaReserved"), condition("Admitted")))


def test_the_checks_log_is_read_for_the_figures_once_the_step_completed_and_until_status_has_them():
    body = lorajob()
    assert checks_log_wanted({}, _convert(body, conditions=[COMPLETED]))
    assert not checks_log_wanted({}, _convert(body))  # still running: read once it completed
    assert not checks_log_wanted({"data": {"examples": 1}}, _convert(body, conditions=[COMPLETED]))
    assert not checks_log_wanted({}, None)


def test_a_chain_without_convert_checks_in_a_step_of_its_own():
    body = lorajob(spec=spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://bucket/qwen3/0/items"}))
    check = observe_child(jobset(body, "check", conditions=[COMPLETED]), UID,
                          workload(condition("QuotaReserved"), condition("Admitted")))
    assert check.name == "qwen3-gsm8k-check" and checks_step({"check": check, "train": object()}) is check
    assert checks_log_wanted({}, check)


def test_the_data_and_plan_lines_of_the_convert_log_are_lifted_into_status_and_kept():
    body = lorajob(status={"phase": "Converting"})
    converted = _convert(body, conditions=[COMPLETED])
    observed = dataclasses.replace(_observed(body, None, None), children={"convert": converted},
                                   checks_log=f"data check passed: ...\n{DATA.line()}\n{PLAN.line()}\nconverting\n")
    status = decide(observed, SETTINGS).status
    assert status["data"] == {"examples": 7473, "tokens": 1402116, "trainedTokens": 512330, "epochs": 4.28,
                              "truncatedExamples": 12, "truncatedShare": 0.003}
    assert status["plan"] == {"target": PLAN.target, "hbmBytesPerChip": 14_630_000_000, "capacityBytes": 30_923_764_531,
                              "stepSeconds": 0.25, "tokensPerSecond": 16 * 4096.0, "mfu": 0.08,
                              "bound": "ICI collectives", "compileSeconds": 565.0}
    later = dataclasses.replace(observed, status=status, checks_log=None)
    assert {k: decide(later, SETTINGS).status[k] for k in ("data", "plan")} == {k: status[k] for k in ("data", "plan")}


def test_the_checks_log_is_read_once_per_jobset():
    class Cluster:
        reads = 0

        def trainer_log_tail(self, namespace, selector, lines):
            Cluster.reads += 1
            assert lines is None  # the whole log: the data line comes first
            return DATA.line()

    body = lorajob(status={"phase": "Training"})
    observed = dataclasses.replace(_observed(body, None, None), children={"convert": _convert(body, conditions=[COMPLETED])})
    logs = TrainLogs(Cluster(), lines=100)
    assert logs.read_checks(("team-a", "qwen3-gsm8k"), observed) == DATA.line()
    assert logs.read_checks(("team-a", "qwen3-gsm8k"), observed) is None
    assert Cluster.reads == 1
