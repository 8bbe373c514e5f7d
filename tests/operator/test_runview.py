"""`lorajob status` on plain objects: the loss history from progress lines, the step marks, the text."""

from __future__ import annotations

import json
from datetime import datetime, UTC

import pytest

from builders import condition, lorajob

from lorajob_operator import runview
from lorajob_trainer.contract.records import PROGRESS_LINE_PREFIX

NOW = datetime(2026, 1, 1, 0, 10, tzinfo=UTC)


def line(**values) -> str:
    return PROGRESS_LINE_PREFIX + json.dumps(values)


def test_loss_history_keeps_one_point_per_step_in_order_and_skips_garbage():
    log = "\n".join([
        "2026-01-01 loading the base", line(step=2, total_steps=4, loss=2.0), line(step=1, total_steps=4, loss=3.0),
        PROGRESS_LINE_PREFIX + '{"step": 3, "total', line(step=2, total_steps=4, loss=1.9, eval_loss=2.5),
        line(step=3, total_steps=4, loss=float("nan")), line(step=4, total_steps=4, loss=1.5, eval_loss=None),
    ])
    assert runview.loss_history(log) == [
        runview.LossPoint(1, 3.0), runview.LossPoint(2, 1.9, 2.5), runview.LossPoint(4, 1.5),
    ]


def test_sparkline_spans_the_range_and_fits_the_width():
    assert runview.sparkline([3.0, 2.0, 1.0]) == "█▅▁"
    assert runview.sparkline([1.0, 1.0]) == "▁▁"
    assert len(runview.sparkline([float(i) for i in range(1000)], width=40)) == 40
    assert runview.sparkline([]) == ""


def _training(**status) -> dict:
    body = lorajob(status={
        "phase": "Training", "startTime": "2026-01-01T00:00:00Z", "restarts": {"train": 1},
        "progress": {"step": 70, "totalSteps": 100, "loss": 0.4286, "tokensPerSecond": 1234.5, "etaSeconds": 125},
        "resolved": {"queueName": "team-q"},
        "conditions": [condition("Admitted"), condition("Running", reason="TrainRunning")],
        "outputs": {"checkpointPath": "gs://bucket/runs/qwen3-gsm8k/checkpoints"},
        **status,
    })
    return body


def test_status_text_shows_steps_progress_loss_outputs_and_events():
    event = {"metadata": {"creationTimestamp": "2026-01-01T00:09:30Z"}, "type": "Normal", "reason": "Created",
             "message": "created JobSet qwen3-gsm8k"}
    history = [runview.LossPoint(step, 3.0 / step, 2.0 if step == 50 else None) for step in range(1, 71)]
    text = runview.format_status(runview.RunView(_training(), history, [event]), now=NOW)
    lines = text.splitlines()
    assert lines[0] == "LoRAJob team-a/qwen3-gsm8k: Training"
    assert lines[1] == "  model qwen3-0.6b, backend pathways, queue team-q"
    assert lines[2] == "steps     ✓ convert   ▶ train (1 retries)   · export   (10m00s)"
    assert lines[3] == "progress  [" + "█" * 21 + "░" * 9 + "]  70/100  70%  loss 0.4286  1,234 tok/s  ETA 2m05s"
    assert lines[4].startswith("loss      █") and lines[4].endswith("step 1..70: 3.0000 -> 0.0429 (min 0.0429)")
    assert lines[5] == "eval loss ▁  last 2.0000 at step 50"
    assert "checkpoints: gs://bucket/runs/qwen3-gsm8k/checkpoints" in lines
    assert "conditions Admitted, Running (TrainRunning)" in lines
    assert lines[-1].split() == ["30s", "ago", "Normal", "Created", "created", "JobSet", "qwen3-gsm8k"]


def test_status_text_shows_the_plan_and_measured_tokens_beside_its_prediction():
    plan = {"target": "tpu-v6e-slice 2x4 (8 chips), per-device batch 1 x 1 accumulation", "hbmBytesPerChip": 4_450_000_000,
            "capacityBytes": 30_923_764_531, "stepSeconds": 0.5, "tokensPerSecond": 16384.0, "mfu": 0.21,
            "bound": "compute", "compileSeconds": 265.0}
    lines = runview.format_status(runview.RunView(_training(plan=plan), [], []), now=NOW).splitlines()
    assert lines[3] == ("plan      tpu-v6e-slice 2x4 (8 chips), per-device batch 1 x 1 accumulation: 4.45 GB of 30.92 GB "
                        "HBM per chip; roofline 0.500 s/step, 16,384 tok/s, MFU ceiling 21% (compute-bound)")
    assert lines[4].endswith("loss 0.4286  1,234 tok/s (plan's roofline 16,384)  ETA 2m05s")


def test_a_tiny_models_plan_says_megabytes_and_no_roofline_figures():
    """A plan's figures mean something at any size: small memory in MB, and no tokens/s or MFU ceiling where the
    roofline's step is shorter than a step's fixed costs (a tiny model's: 1.2 billion tokens/s beside 5,000)."""
    plan = {"target": "tpu-v6e-slice 2x2 (4 chips), per-device batch 2 x 1 accumulation", "hbmBytesPerChip": 3_400_000,
            "capacityBytes": 30_923_764_531, "stepSeconds": 0.000004, "tokensPerSecond": 1_196_261_682.0, "mfu": 0.7,
            "bound": "compute"}
    lines = runview.format_status(runview.RunView(_training(plan=plan), [], []), now=NOW).splitlines()
    assert lines[3] == ("plan      tpu-v6e-slice 2x2 (4 chips), per-device batch 2 x 1 accumulation: 3.40 MB of 30.92 GB "
                        "HBM per chip; roofline under 10 ms/step (a step this small is its fixed costs, which the "
                        "roofline leaves out)")
    assert lines[4].endswith("loss 0.4286  1,234 tok/s  ETA 2m05s")


def test_status_text_links_the_tracker_runs_and_says_why_tracking_is_degraded():
    runs = {"mlflow": {"url": "https://mlflow.example.com/#/experiments/3/runs/9f1c"},
            "wandb": {"url": "https://wandb.ai/team/p/runs/x7"}}
    problem = "wandb: 401 Unauthorized (the API key was refused); 4 updates wait to be sent"
    degraded = condition("TrackingDegraded", reason="TrackerFailing", message=problem)
    lines = runview.format_status(runview.RunView(_training(tracking=runs, conditions=[degraded])), now=NOW).splitlines()
    assert "mlflow run:  https://mlflow.example.com/#/experiments/3/runs/9f1c" in lines
    assert "wandb run:   https://wandb.ai/team/p/runs/x7" in lines
    assert f"tracking degraded (training goes on): {problem}" in lines
    healthy = condition("TrackingDegraded", status="False", reason="TrackersReporting")
    text = runview.format_status(runview.RunView(_training(tracking=runs, conditions=[healthy])), now=NOW)
    assert "mlflow run:" in text and "degraded" not in text
    assert "run:" not in runview.format_status(runview.RunView(_training()), now=NOW)  # no trackers, no lines


def test_a_failed_step_is_marked_where_it_failed():
    body = _training(phase="Failed", conditions=[condition("Failed", reason="TrainFailed", message="the train step failed")])
    assert "steps     ✓ convert   ✗ train (1 retries)   · export   (10m00s)" in runview.format_status(
        runview.RunView(body), now=NOW
    ).splitlines()
    done = _training(phase="Succeeded", completionTime="2026-01-01T00:05:00Z")
    assert "✓ convert   ✓ train (1 retries)   ✓ export   (5m00s)" in runview.format_status(runview.RunView(done), now=NOW)


def test_status_text_shows_base_against_adapter_and_samples_side_by_side():
    evaluation = {
        "scorer": "gsm8k", "examples": 64, "step": 100, "seconds": 95.0,
        "base": {"score": 0.125, "stopRate": 0.5, "meanLength": 240.2},
        "adapter": {"score": 0.6875, "stopRate": 1.0, "meanLength": 88.0},
        "samples": [{"prompt": "Natalia sold 48 clips.\nHow many?", "reference": "#### 72", "base": "", "adapter": "#### 72"}],
    }
    text = runview.format_status(runview.RunView(_training(evaluation=evaluation), [], []), now=NOW, samples=2)
    assert text.splitlines()[4:12] == [
        "evaluation step 100, gsm8k on 64 examples (1m35s):",
        "  base       12.5%   stop rate  50.0%   mean length 240.2 tokens",
        "  adapter    68.8%   stop rate 100.0%   mean length 88.0 tokens",
        "  sample 1: Natalia sold 48 clips. How many?",
        "    reference #### 72",
        "    base      (empty)",
        "    adapter   #### 72",
        "  (1 samples kept in status: spec.evaluation.samples; all answers are in <run>/evaluation-samples.jsonl)",
    ]
    assert "sample 1" not in runview.format_status(runview.RunView(_training(evaluation=evaluation), [], []), now=NOW)


def test_a_preference_runs_history_status_and_plot_show_its_reward_accuracy(tmp_path):
    log = "\n".join([
        line(step=1, total_steps=4, loss=0.69, reward_accuracy=0.5, reward_margin=0.0),
        line(step=2, total_steps=4, loss=0.6, reward_accuracy=0.75, eval_loss=0.65, eval_step=2, eval_preference_accuracy=0.6),
        line(step=3, total_steps=4, loss=0.5, reward_accuracy=0.875, eval_loss=0.65, eval_step=2, eval_preference_accuracy=0.6),
        line(step=4, total_steps=4, loss=0.4, reward_accuracy=1.0, eval_loss=0.5, eval_step=4, eval_preference_accuracy=0.9),
    ])
    history = runview.loss_history(log)
    assert [(p.step, p.reward_accuracy, p.eval_preference_accuracy) for p in history] == [
        (1, 0.5, None), (2, 0.75, 0.6), (3, 0.875, None), (4, 1.0, 0.9)]
    body = _training(progress={"step": 4, "totalSteps": 4, "loss": 0.4, "rewardAccuracy": 1.0, "rewardMargin": 2.5,
                               "chosenLogps": -120.25, "rejectedLogps": -180.5, "evalLoss": 0.5, "evalStep": 4,
                               "evalPreferenceAccuracy": 0.9})
    lines = runview.format_status(runview.RunView(body, history), now=NOW).splitlines()
    assert ("pairs     reward accuracy 100.0%  margin 2.5  log-probs chosen -120.2, rejected -180.5  "
            "eval preference accuracy 90.0% at step 4") in lines
    assert any(text.startswith("reward acc ") and text.endswith("step 1..4: 50.0% -> 100.0% (max 100.0%)") for text in lines)
    assert any(text.startswith("eval acc  ") and text.endswith("last 90.0% at step 4") for text in lines)
    sft = runview.format_status(runview.RunView(_training(), runview.loss_history(line(step=1, total_steps=4, loss=1.0))), now=NOW)
    assert "pairs " not in sft and "reward acc" not in sft and "eval acc" not in sft
    pytest.importorskip("matplotlib")
    assert runview.plot(runview.RunView(body, history), tmp_path / "loss.png").stat().st_size > 0
