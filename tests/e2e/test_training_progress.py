"""Training progress end to end: the lead trainer's log (served by kwok for the simulated pods, through the
API server's pods/log) -> the operator -> status.progress -> `kubectl get lj`."""

from __future__ import annotations

import pytest
from lorajobs import every_image, progress_line, sample

from lorajob_devcluster import HANG_IMAGE
from lorajob_devcluster.kwok_stages import cri_log
from lorajob_trainer.contract.records import PROGRESS_LINE_PREFIX

pytestmark = pytest.mark.cluster


def summary(obj: dict | None) -> str | None:
    return ((obj or {}).get("status", {}).get("progress") or {}).get("summary")


def table_row(lorajobs, name: str, *options: str) -> tuple[list[str], str]:
    """The column names and the row of `kubectl get lj <name>`."""
    header, row = lorajobs.kubectl("get", "lj", name, *options).stdout.splitlines()
    return header.split(), row


def test_kubectl_get_shows_the_progress_the_trainer_logs(lorajobs, operator, trainer_log):
    trainer_log.write_text(cri_log([
        "loading checkpoint gs://my-bucket/qwen3/0/items", progress_line(6), "step 6/10 loss 0.5000",
        PROGRESS_LINE_PREFIX + '{"step":', progress_line(7), PROGRESS_LINE_PREFIX + '{"step":8,"total_st',
    ]))
    lorajobs.apply(sample("tracked", train_only=True, images=every_image(HANG_IMAGE)))
    running = lorajobs.wait("tracked", lambda obj: summary(obj) == " 7/10  70%", "progress 7/10", timeout=60)

    assert running["status"]["phase"] == "Training"
    assert running["status"]["progress"] == {
        "step": 7, "totalSteps": 10, "loss": round(3.0 / 7, 4), "tokensPerSecond": 1200.0, "etaSeconds": 12,
        "evalLoss": 0.8, "evalStep": 5, "state": "running", "summary": " 7/10  70%",
    }
    assert running["status"]["checkpoints"] == [{
        "step": 5, "time": "2026-01-01T12:00:05Z", "trainLoss": 0.6, "evalLoss": 0.8,
        "path": f"{running['spec']['output']['baseOutputDirectory']}/tracked/checkpoints/5",
    }]
    columns, row = table_row(lorajobs, "tracked")
    assert columns[:3] == ["NAME", "PHASE", "PROGRESS"] and row.split()[:4] == ["tracked", "Training", "7/10", "70%"]
    columns, row = table_row(lorajobs, "tracked", "-o", "wide")
    assert "LOSS" in columns and str(round(3.0 / 7, 4)) in row.split()
    assert "EVAL" in columns and "0.8" in row.split()

    with trainer_log.open("a") as log:  # the trainer goes on; the next resync reads the newer line
        log.write(cri_log([progress_line(9)]))
    later = lorajobs.wait("tracked", lambda obj: summary(obj) == " 9/10  90%", "progress 9/10", timeout=30)
    assert later["status"]["phase"] == "Training"


def test_a_succeeded_job_shows_the_final_step_the_trainer_reported(lorajobs, start_operator, trainer_log):
    trainer_log.write_text(cri_log([progress_line(8), progress_line(9)]))
    first = start_operator()
    lorajobs.apply(sample("finished", train_only=True))  # its pods succeed after about 2 s
    lorajobs.wait_phase("finished", "Succeeded", timeout=120)
    lorajobs.wait("finished", lambda obj: summary(obj) == " 9/10  90%", "progress 9/10", timeout=30)
    first.kill()

    # The last lines reach the log only now: the step completed and the LoRAJob succeeded before, so only
    # the read of a finished step's log can bring them in.
    with trainer_log.open("a") as log:
        log.write(cri_log([progress_line(10), progress_line(10, "succeeded")]))
    start_operator()
    done = lorajobs.wait("finished", lambda obj: summary(obj) == "10/10 100%", "progress 10/10", timeout=30)
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["progress"]["etaSeconds"] == 0


def test_without_a_readable_log_the_job_runs_on_and_the_operator_says_why(lorajobs, operator):
    """No log is served in this namespace: kwok answers the API server's pods/log request with an error,
    as a node without a kubelet would; the operator logs it and carries on."""
    lorajobs.apply(sample("unlogged", train_only=True, images=every_image(HANG_IMAGE)))
    lorajobs.wait_phase("unlogged", "Training", timeout=60)
    reason = f"no progress for LoRAJob {lorajobs.namespace}/unlogged: cannot read the trainer log of JobSet unlogged"
    lorajobs.wait_until(lambda: reason in operator.log_path.read_text(), "the operator logging the unreadable log", timeout=30)

    obj = lorajobs.get("unlogged")
    assert obj["status"]["phase"] == "Training" and "progress" not in obj["status"]
    assert "Traceback" not in operator.log_path.read_text()


def test_the_tracker_runs_are_linked_from_status_kubectl_and_argo_cd(lorajobs, operator, trainer_log):
    """The trainer's progress lines carry its tracker runs' addresses and any tracking problem: the operator puts the
    addresses in status.tracking and in Argo CD's link annotations on the LoRAJob (a metadata patch), and the problem in
    TrackingDegraded, which never changes the phase."""
    urls = {"mlflow": "https://mlflow.example.com/#/experiments/3/runs/9f1c", "wandb": "https://wandb.ai/team/p/runs/x7"}
    problem = "mlflow: https://mlflow.example.com unreachable (ConnectionError); 12 updates wait to be sent"
    trainer_log.write_text(cri_log([progress_line(6, tracking_urls=urls, tracking_problem=problem)]))
    body = sample("tracked-runs", train_only=True, images=every_image(HANG_IMAGE))
    body["spec"]["tracking"] = {"mlflow": {"trackingUri": "https://mlflow.example.com"},
                                "wandb": {"project": "p", "mode": "offline"}}
    lorajobs.apply(body)

    def linked(obj: dict | None) -> bool:
        return len(((obj or {}).get("metadata") or {}).get("annotations") or {}) >= 3  # kubectl's own, and both links

    running = lorajobs.wait("tracked-runs", linked, "the links to the tracker runs", timeout=60)
    assert running["status"]["phase"] == "Training"
    assert running["status"]["tracking"] == {"mlflow": {"url": urls["mlflow"]}, "wandb": {"url": urls["wandb"]}}
    annotations = running["metadata"]["annotations"]
    assert annotations["link.argocd.argoproj.io/mlflow-run"] == f"MLflow run|{urls['mlflow']}"
    assert annotations["link.argocd.argoproj.io/wandb-run"] == f"Weights & Biases run|{urls['wandb']}"
    assert "tracking" in running["spec"] and running["metadata"]["generation"] == 1  # the spec untouched
    (degraded,) = [c for c in running["status"]["conditions"] if c["type"] == "TrackingDegraded"]
    assert (degraded["status"], degraded["message"]) == ("True", problem)
    columns, row = table_row(lorajobs, "tracked-runs", "-o", "wide")
    assert urls["mlflow"] in row.split() and "MLFLOW" in columns

    with trainer_log.open("a") as log:  # the tracker is back
        log.write(cri_log([progress_line(7, tracking_urls=urls, tracking_problem="")]))
    lorajobs.wait("tracked-runs", lambda obj: any(
        c["type"] == "TrackingDegraded" and c["status"] == "False" for c in obj["status"].get("conditions") or []),
        "TrackingDegraded False", timeout=30)
