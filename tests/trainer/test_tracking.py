"""Experiment tracking against a real MLflow tracking server (SQLite store, artifacts served by the server) and
Weights & Biases offline.

The trainer runs as the pods run it (`python -m lorajob_trainer.train`, then `python -m lorajob_trainer.export`) and
everything is read back from the trackers: the run's params, metric histories, evaluation, files and the exported
adapter, a resumed run appending to the same runs without a step twice, and the server going away and coming back
while metrics are sent (the tracker's queue against the server stopped and started, and a whole trainer run whose
server is down until its progress says so)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

from lorajob_devcluster.controlplane import wait_for
from lorajob_trainer import tracking
from lorajob_trainer.contract.config import TrackingConfig
from lorajob_trainer.contract.records import ProgressRecord, RunLayout, TrackingRecord

pytestmark = pytest.mark.slow(minutes=3)

STEPS = 4
MORE_STEPS = 7
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def client(mlflow_server) -> MlflowClient:
    return MlflowClient(tracking_uri=mlflow_server.url)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("inputs")
    return SimpleNamespace(
        model=tiny_checkpoint(root / "tiny-qwen3"),
        train=write_jsonl(root / "train.jsonl", arithmetic_rows(64)),
        evaluation=write_jsonl(root / "eval.jsonl", arithmetic_rows(8, seed=1)),
    )


def run_entry_point(module: str, args: list[str]) -> list[ProgressRecord]:
    """`python -m lorajob_trainer.<module> args` to its end (it must succeed); the progress records it printed."""
    done = subprocess.run([sys.executable, "-m", f"lorajob_trainer.{module}", *args], env=trainer_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return [record for line in done.stdout.splitlines() if (record := ProgressRecord.from_line(line))]


def train_args(inputs, output: Path, tracking_settings: TrackingConfig, *overrides: str) -> list[str]:
    return [*base_args(inputs.model, output, inputs.train, "enable_tensorboard=false", "progress_lines=true",
                       "checkpoint_period=2", *overrides),
            *tracking_settings.to_args()]


def loss_steps(client: MlflowClient, run_id: str, key: str = "loss") -> list[int]:
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def settings(mlflow_server, tmp_path_factory) -> TrackingConfig:
    return TrackingConfig(
        mlflow_tracking_uri=mlflow_server.url, mlflow_experiment="tracking-test", mlflow_tags={"team": "llm"},
        wandb_project="lorajob-test", wandb_mode="offline", wandb_dir=str(tmp_path_factory.mktemp("wandb")),
        wandb_tags=["test"], job_name="job-a", job_namespace="team-a", job_uid="uid-1",
    )


@pytest.fixture(scope="module")
def first_run(inputs, settings, tmp_path_factory) -> SimpleNamespace:
    """A run of STEPS steps with evaluations and the generation evaluation, reporting to both trackers."""
    output = tmp_path_factory.mktemp("tracked")
    progress = run_entry_point("train", train_args(
        inputs, output, settings, f"steps={STEPS}", f"hf_eval_files=['{inputs.evaluation}']", "eval_interval=2",
        "generation_eval.enabled=true", "generation_eval.examples=4", "generation_eval.max_new_tokens=4",
        "generation_eval.samples=2",
    ))
    layout = RunLayout(str(output), "run")
    record = TrackingRecord.from_json(Path(layout.tracking).read_text())
    return SimpleNamespace(layout=layout, progress=progress, record=record, mlflow=record.runs["mlflow"].run_id)


def test_the_mlflow_run_holds_the_resolved_config_and_who_ran_it(first_run, client, settings, inputs):
    run = client.get_run(first_run.mlflow)
    params = run.data.params
    assert (params["model_name"], params["lora.lora_rank"], params["learning_rate"]) == ("tiny-qwen3", "4", "0.01")
    assert params["tracking.job_name"] == "job-a" and params["steps"] == str(STEPS)
    assert params["adam_b1"] == "0.9"  # a default, not on the command line
    assert params["resolved.remat_policy"] == "minimal" and params["resolved.mesh.fsdp"] == "1"
    assert params["dataset.name"] == str(inputs.train) and re.fullmatch(r"[0-9a-f]{16}", params["dataset.fingerprint"])
    assert run.info.run_name == "job-a" and run.info.status == "FINISHED"
    assert {key: run.data.tags[key] for key in ("team", "lorajob.job", "lorajob.namespace", "lorajob.uid")} == {
        "team": "llm", "lorajob.job": "job-a", "lorajob.namespace": "team-a", "lorajob.uid": "uid-1"}
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "tracking-test"
    assert first_run.record.runs["mlflow"].url == (
        f"{settings.mlflow_tracking_uri}/#/experiments/{experiment.experiment_id}/runs/{first_run.mlflow}")


def test_every_logged_step_is_one_point_of_each_metric(first_run, client):
    written = [json.loads(line) for line in Path(first_run.layout.metrics).read_text().splitlines()]
    assert loss_steps(client, first_run.mlflow) == list(range(1, STEPS + 1))
    for record in written:
        if "loss" in record:
            for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu"):
                if record.get(key) is not None:
                    (point,) = [m for m in client.get_metric_history(first_run.mlflow, key) if m.step == record["step"]]
                    assert point.value == pytest.approx(record[key]), (key, record["step"])
    assert loss_steps(client, first_run.mlflow, "eval_loss") == [2, 4]


def test_the_generation_evaluation_becomes_metrics_and_a_sample_table(first_run, client, tmp_path):
    evaluation = json.loads(Path(first_run.layout.evaluation).read_text())
    metrics = client.get_run(first_run.mlflow).data.metrics
    for model in ("base", "adapter"):
        assert metrics[f"generation/{model}_score"] == pytest.approx(evaluation[model]["score"])
        assert metrics[f"generation/{model}_stop_rate"] == pytest.approx(evaluation[model]["stop_rate"])
    assert loss_steps(client, first_run.mlflow, "generation/adapter_score") == [STEPS]
    table = json.loads(Path(client.download_artifacts(first_run.mlflow, "generation_samples.json", str(tmp_path)))
                       .read_text())
    assert table["columns"] == ["prompt", "reference", "base", "adapter"]
    assert table["data"] == [[sample[column] for column in table["columns"]] for sample in evaluation["samples"]]


def test_the_run_ends_with_its_loss_plot_and_evaluation(first_run, client):
    artifacts = {artifact.path for artifact in client.list_artifacts(first_run.mlflow)}
    assert {"loss.png", "evaluation.json", "generation_samples.json"} <= artifacts
    local = Path(client.download_artifacts(first_run.mlflow, "loss.png"))
    assert local.read_bytes().startswith(b"\x89PNG")


def wandb_records(run_directory: str) -> list:
    """The records of an offline W&B run: its run-<id>.wandb file, which `wandb sync` uploads, holds
    wandb_internal_pb2.Record messages in LevelDB's log framing (a 7-byte file header, then 32 KiB blocks of
    chunks, each with a CRC, its length and whether it is a whole record or its first, middle or last part)."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = Path(run_directory).glob("run-*.wandb")
    data, block, header = path.read_bytes(), 32 * 1024, 7
    assert data.startswith(b":W&B")
    records, parts, offset = [], b"", header
    while offset + header <= len(data):
        if block - offset % block < header:  # a block's tail too short for a chunk is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        parts += data[offset + header:offset + header + length]
        offset += header + length
        if kind in (1, 4):  # whole, or the last part
            records.append(Record.FromString(parts))
            parts = b""
    return records


def of_kind(records: list, kind: str) -> list:
    return [getattr(record, kind) for record in records if record.WhichOneof("record_type") == kind]


def wandb_history(records: list) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in row.item}
            for row in of_kind(records, "history")]


def wandb_steps(records: list, key: str = "loss") -> list[int]:
    return [row["_step"] for row in wandb_history(records) if key in row]


def test_the_offline_wandb_run_holds_the_config_history_and_files(first_run, client):
    records = wandb_records(first_run.record.runs["wandb"].url)
    (run,) = of_kind(records, "run")
    assert (run.run_id, run.display_name, run.project, list(run.tags)) == (
        first_run.record.runs["wandb"].run_id, "job-a", "lorajob-test", ["test"])
    config = {item.key: json.loads(item.value_json) for update in of_kind(records, "config") for item in update.update}
    assert (config["model_name"], config["lora.lora_rank"], config["tracking.job_name"]) == ("tiny-qwen3", 4, "job-a")
    assert config["dataset.fingerprint"] == client.get_run(first_run.mlflow).data.params["dataset.fingerprint"]
    written = {r["step"]: r["loss"] for r in map(json.loads, Path(first_run.layout.metrics).read_text().splitlines())
               if "loss" in r}
    history = wandb_history(records)
    assert {row["_step"]: row["loss"] for row in history if "loss" in row} == pytest.approx(written)
    assert wandb_steps(records) == list(range(1, STEPS + 1))
    (evaluated,) = [row for row in history if "generation/adapter_score" in row]
    assert evaluated["_step"] == STEPS and evaluated["generation_samples/_type"] == "table-file"
    saved = {file.path for files in of_kind(records, "files") for file in files.files}
    assert {"loss.png", "evaluation.json"} <= saved
    assert not (Path(first_run.record.runs["wandb"].url) / "files" / "loss.png").is_symlink()
    assert [end.exit_code for end in of_kind(records, "exit")] == [0]


def test_progress_records_carry_the_tracker_addresses_and_no_problem(first_run):
    last = first_run.progress[-1]
    assert last.state == "succeeded"
    assert last.tracking_urls == {name: run.url for name, run in first_run.record.runs.items()}
    assert all(record.tracking_problem == "" for record in first_run.progress[1:]), [
        record.tracking_problem for record in first_run.progress]


@pytest.fixture(scope="module")
def exported(first_run, settings, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "adapter"
    run_entry_point("export", ["--checkpoint", first_run.layout.checkpoints, "--out", str(out),
                               "--tracking-record", first_run.layout.tracking, *settings.to_args()])
    return out


def test_the_exported_adapter_is_logged_to_the_run_with_its_lineage(exported, first_run, client, tmp_path):
    from safetensors.numpy import load_file

    logged = {artifact.path for artifact in client.list_artifacts(first_run.mlflow, "adapter")}
    assert logged == {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
    downloaded = Path(client.download_artifacts(first_run.mlflow, "adapter", str(tmp_path)))
    assert json.loads((downloaded / "adapter_config.json").read_text()) == json.loads(
        (exported / "adapter_config.json").read_text())
    tensors, expected = load_file(downloaded / "adapter_model.safetensors"), load_file(
        exported / "adapter_model.safetensors")
    assert sorted(tensors) == sorted(expected)
    run = client.get_run(first_run.mlflow)
    tags = run.data.tags
    assert tags["lorajob.adapter.base_model"] == "tiny-qwen3"
    assert tags["lorajob.adapter.dataset.fingerprint"] == run.data.params["dataset.fingerprint"]
    assert tags["lorajob.adapter.location"] == str(exported)
    assert run.info.status == "FINISHED"  # the export step appends; the run's status is training's


def test_the_exported_adapter_is_a_wandb_model_artifact_of_the_same_run(exported, first_run):
    record = TrackingRecord.from_json(Path(first_run.layout.tracking).read_text())
    assert record.runs["wandb"].run_id == first_run.record.runs["wandb"].run_id
    records = wandb_records(record.runs["wandb"].url)
    (artifact,) = of_kind(records, "artifact")
    assert artifact.type == "model" and artifact.run_id == record.runs["wandb"].run_id
    assert {entry.path for entry in artifact.manifest.contents} == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads(artifact.metadata)["base_model"] == "tiny-qwen3"


@pytest.fixture(scope="module")
def resumed(first_run, exported, inputs, settings) -> SimpleNamespace:
    """The run continued to MORE_STEPS after its last checkpoint is lost: step STEPS runs again, from STEPS - 2."""
    shutil.rmtree(Path(first_run.layout.checkpoints) / str(STEPS))
    progress = run_entry_point("train", train_args(
        inputs, Path(first_run.layout.base_output_directory), settings, f"steps={MORE_STEPS}"))
    return SimpleNamespace(progress=progress, record=TrackingRecord.from_json(Path(first_run.layout.tracking).read_text()))


def test_a_resumed_run_appends_to_the_same_runs_and_sends_no_step_twice(resumed, first_run, client):
    assert {name: run.run_id for name, run in resumed.record.runs.items()} == {
        name: run.run_id for name, run in first_run.record.runs.items()}
    assert loss_steps(client, first_run.mlflow) == list(range(1, MORE_STEPS + 1))
    # An offline W&B run resumes as a new local run of the same id, sent after the first by `wandb sync`.
    assert wandb_steps(wandb_records(resumed.record.runs["wandb"].url)) == list(range(STEPS + 1, MORE_STEPS + 1))
    assert resumed.record.runs["wandb"].logged_step == MORE_STEPS
    run = client.get_run(first_run.mlflow)
    assert run.data.params["steps"] == str(STEPS)  # params are immutable: the first value stays
    assert run.info.status == "FINISHED"
    assert resumed.progress[-1].tracking_problem == ""


# ------------------------------------------------------------------- the server goes away and comes back


def mlflow_only(mlflow_server, experiment: str) -> TrackingConfig:
    return TrackingConfig(mlflow_tracking_uri=mlflow_server.url, mlflow_experiment=experiment)


def trackers_of(mlflow_server, tmp_path: Path, **queue_options) -> tracking.Trackers:
    """MLflow's queue alone, retrying at least every 0.2 s."""
    backend = tracking.MlflowBackend(mlflow_only(mlflow_server, tmp_path.name), "fault", {"learning_rate": 0.01})
    return tracking.Trackers(str(tmp_path / "tracking.json"), TrackingRecord({}), [(backend, None)],
                             retry_max_seconds=0.2, **queue_options)


def log_steps(trackers: tracking.Trackers, steps) -> None:
    for step in steps:
        trackers.log_metrics(step, {"loss": 1.0 / step}, time.time())


def drained(trackers: tracking.Trackers) -> bool:
    (queue,) = trackers.queues
    return queue.url() != "" and queue.waiting() == 0 and trackers.problem() == ""


def test_metrics_wait_while_the_server_is_down_and_all_arrive_when_it_is_back(mlflow_server, client, tmp_path):
    trackers = trackers_of(mlflow_server, tmp_path)
    log_steps(trackers, range(1, 4))
    wait_for(lambda: drained(trackers), 60, "steps 1-3 sent")
    mlflow_server.stop()
    try:
        log_steps(trackers, range(4, 7))
        problem = wait_for(trackers.problem, 30, "the problem reported")
        assert re.fullmatch(r"mlflow: unreachable since \d\d:\d\d:\d\d \(.*Connection refused.*\), 3 records waiting",
                            problem), problem
    finally:
        mlflow_server.start()
    wait_for(lambda: drained(trackers), 60, "the waiting steps sent")
    log_steps(trackers, [7])
    assert trackers.close("finished")
    (run_id,) = [run.run_id for run in TrackingRecord.from_json((tmp_path / "tracking.json").read_text()).runs.values()]
    assert loss_steps(client, run_id) == list(range(1, 8))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_full_queue_drops_its_oldest_records_and_says_so(mlflow_server, client, tmp_path):
    trackers = trackers_of(mlflow_server, tmp_path, bound=3)
    wait_for(lambda: drained(trackers), 60, "the run open")
    mlflow_server.stop()
    try:
        log_steps(trackers, [1])
        wait_for(trackers.problem, 30, "step 1 failing")  # it is the call retried meanwhile
        log_steps(trackers, range(2, 6))
        assert trackers.problem().endswith("3 records waiting, 2 oldest dropped (queue full at 3)"), trackers.problem()
    finally:
        mlflow_server.start()
    wait_for(lambda: drained(trackers), 60, "the kept steps sent")
    assert trackers.close("finished")
    (run,) = TrackingRecord.from_json((tmp_path / "tracking.json").read_text()).runs.values()
    assert loss_steps(client, run.run_id) == [1, 4, 5]


def test_a_run_whose_server_is_down_says_so_and_loses_no_step_once_it_is_back(mlflow_server, client, inputs, tmp_path):
    steps = 6
    settings = mlflow_only(mlflow_server, "server-down")
    args = train_args(inputs, tmp_path, settings, f"steps={steps}")
    log = tmp_path / "stderr.log"
    mlflow_server.stop()
    with log.open("w") as errors:
        process = subprocess.Popen([sys.executable, "-m", "lorajob_trainer.train", *args], env=trainer_env(),
                                   stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        problems = (record.tracking_problem for line in process.stdout
                    if (record := ProgressRecord.from_line(line)) and record.tracking_problem)
        assert "mlflow: unreachable since" in next(problems, ""), log.read_text()[-3000:]
    finally:
        mlflow_server.start()
    try:
        rest, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        process.kill()
    assert process.returncode == 0, log.read_text()[-3000:]
    final = [record for line in rest.splitlines() if (record := ProgressRecord.from_line(line))]
    run_id = TrackingRecord.from_json(Path(RunLayout(str(tmp_path), "run").tracking).read_text()).runs["mlflow"].run_id
    assert loss_steps(client, run_id) == list(range(1, steps + 1))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert final[-1].state == "succeeded"
