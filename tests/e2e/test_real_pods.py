"""LoRAJobs whose pods really run (the pod runner's nodes): the command lines the operator renders, as
one chain on a tiny generated model. convert's output (base and restore adapter) is train's input,
train's checkpoints are export's input, the 2 train pods form one jax.distributed job, and the
trainer's progress lines reach `status.progress`.

Each full chain costs minutes of pod start-up and compiles on 2 cores, so one chain checks what several would:
the crash-and-suspend chain is also the DoRA chain (restored from a PEFT DoRA adapter, magnitudes trained and
exported)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from lorajobs import condition

from lorajob_devcluster import localjob
from lorajob_devcluster.topology import LOCAL_CPU_NP, LOCAL_V6E_2X4
from lorajob_trainer import metrics
from lorajob_trainer.contract import exit_codes

pytestmark = [pytest.mark.cluster, pytest.mark.slow(minutes=10)]
STEPS = 8
TIMEOUT = 600
"""Bound on each wait for a chain's next state: minutes of compiles and pod start-ups, which take 2-3 times as long
on a loaded 2-core CI machine as on a quiet one (CI failed at 420 s with the QLoRA chain still evaluating)."""
SLOW_STEPS = {"steps": 30, "perDeviceBatchSize": 8, "maxTargetLength": 256, "gradientAccumulationSteps": 2}
"""Training long enough (tens of seconds) to be caught mid-way by a suspend."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> localjob.Assets:
    """The runs share the tests' JAX compilation cache (tests/conftest.py), as runs under one output directory do; their
    train steps, on several CPU devices each, compile anyway (train.configure_compilation_cache)."""
    return localjob.write_assets(tmp_path_factory.mktemp("real-pods"), train_rows=200, eval_rows=8,
                                 compilation_cache=Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))


@pytest.fixture(scope="module")
def hf_adapter(assets) -> Path:
    """A random PEFT DoRA adapter on the tiny model, of the rank and targets the LoRAJob trains."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorajob_trainer import lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(assets.model, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=lora.default_targets("qwen3"), init_lora_weights=False,
                        use_dora=True)
    out = assets.outputs.parent / "hf-adapter"
    get_peft_model(base, config).save_pretrained(out)
    return out


def step(obj: dict) -> int:
    return ((obj.get("status") or {}).get("progress") or {}).get("step") or 0


def trained_steps(assets: localjob.Assets, run: str) -> list[int]:
    path = assets.metrics(run)
    return [r["step"] for r in metrics.read_metrics(path) if "loss" in r] if path.exists() else []


def pods_of(lorajobs, phase: str) -> list[dict]:
    return [p for p in lorajobs.pods() if p["metadata"]["labels"].get("lorajob.dev/phase") == phase]


def running(pods: list[dict], count: int) -> list[dict]:
    return pods if len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods) else []


def jobset_uid(lorajobs, name: str) -> str:
    return lorajobs.kubectl("get", "jobsets.jobset.x-k8s.io", name, "-o", "jsonpath={.metadata.uid}").stdout


@pytest.mark.torch
@pytest.mark.timeout(1800)  # the longest chain: two train starts and an export (3-5 min on a quiet machine)
def test_the_dora_chain_runs_for_real_survives_an_operator_crash_and_resumes_after_a_suspend(
    lorajobs, start_operator, assets, hf_adapter
):
    run = "chain-real"
    body = localjob.lorajob(run, assets, checkpoint_period=1000)  # only the SIGTERM checkpoint
    body["spec"]["training"] |= SLOW_STEPS
    body["spec"]["lora"] |= {"dora": True, "restoreFrom": {"huggingFace": str(hf_adapter)}}
    total = SLOW_STEPS["steps"]
    first = start_operator()
    lorajobs.apply(body)
    train_pods = lorajobs.wait_until(lambda: running(pods_of(lorajobs, "train"), 2), "2 train pods Running", timeout=TIMEOUT)
    assert sorted(p["spec"]["nodeName"] for p in train_pods) == LOCAL_V6E_2X4.node_names(), "one process per host"
    assert [p["spec"]["nodeName"] in LOCAL_CPU_NP.node_names() for p in pods_of(lorajobs, "convert")] == [True]

    # The operator dies while the step runs: training goes on untouched, and a new operator adopts it.
    uid = jobset_uid(lorajobs, run)
    first.kill()
    lorajobs.wait_until(lambda: trained_steps(assets, run), "training steps without the operator", timeout=TIMEOUT)
    lead = next(p["metadata"]["name"] for p in train_pods if p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] == "0")
    restored = assets.layout(run).converted_adapter
    assert f"starting from adapter {restored}" in lorajobs.kubectl("logs", lead).stdout, "convert's adapter is train's start"
    start_operator()
    lorajobs.wait(run, lambda obj: step(obj) >= 1, "the new operator reporting progress", timeout=60)
    assert jobset_uid(lorajobs, run) == uid
    assert {p["metadata"]["uid"] for p in pods_of(lorajobs, "train")} == {p["metadata"]["uid"] for p in train_pods}

    # Suspend mid-training: SIGTERM, the trainer checkpoints the step it is at; resume continues there.
    lorajobs.patch_spec(run, {"suspend": True})
    lorajobs.wait_phase(run, "Suspended", timeout=120)
    lorajobs.wait_until(lambda: not pods_of(lorajobs, "train"), "the train pods gone", timeout=120)
    before_resume = trained_steps(assets, run)
    assert 1 <= max(before_resume) < total, f"suspended mid-training: {before_resume}"
    lorajobs.patch_spec(run, {"suspend": False})
    done = lorajobs.wait_phase(run, "Succeeded", timeout=TIMEOUT)

    steps = trained_steps(assets, run)
    assert steps[: len(before_resume)] == before_resume and steps == list(range(1, total + 1)), (
        f"resumed from the step the suspend checkpointed, no step run twice or skipped: {steps}"
    )
    assert done["status"]["progress"]["step"] == total
    assert done["status"]["outputs"]["adapterPath"] == str(assets.adapter(run))
    data = done["status"]["data"]  # the data check's figures, lifted from the convert pod's log
    assert data["examples"] == 200 and 0 < data["trainedTokens"] < data["tokens"], data
    assert data["epochs"] > 0 and 0 <= data["truncatedShare"] <= 1, data
    assert_dora_adapter_trained_from(assets, run, hf_adapter)


def assert_dora_adapter_trained_from(assets: localjob.Assets, run: str, start: Path) -> None:
    """PEFT loads the exported adapter as a DoRA one, and its magnitudes moved from those of the adapter the
    chain started from (restored through convert)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((assets.adapter(run) / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["base_model_name_or_path"] == str(assets.model)
    assert config["use_dora"] is True

    def q_proj_magnitude(adapter: Path) -> torch.Tensor:
        base = AutoModelForCausalLM.from_pretrained(assets.model, dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, adapter)
        assert any("lora_A" in name for name, _ in adapted.named_parameters())
        return adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_magnitude_vector["default"].weight

    trained, started = q_proj_magnitude(assets.adapter(run)), q_proj_magnitude(start)
    moved = ((trained - started).abs() / started.abs()).median().item()
    assert trained.shape == started.shape and moved > 1e-3, f"the magnitudes were trained (median change {moved:.1e})"


def test_a_broken_dataset_fails_the_lorajob_with_the_trainers_message(lorajobs, operator, assets, tmp_path):
    broken = tmp_path / "data"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"question": "no answer column"}\n')
    body = localjob.lorajob("bad-data-real", assets, steps=STEPS)
    body["spec"]["dataset"] |= {"dataDir": str(broken)}
    del body["spec"]["dataset"]["evalSplit"], body["spec"]["training"]["evalInterval"]
    lorajobs.apply(body)
    failed = lorajobs.wait_phase("bad-data-real", "Failed", timeout=TIMEOUT)

    reason = condition(failed, "Failed")
    assert reason["reason"] == "InvalidData", reason
    assert f"exited with code {exit_codes.DATA}" in reason["message"]
    assert "answer" in reason["message"], reason["message"]
    assert failed["status"]["restarts"]["train"] == 0


WIDER_THAN_A_V6E_4X8 = {"hidden_size": 32768, "intermediate_size": 262144, "num_attention_heads": 256,
                        "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 16}
"""448B parameters: 112 GB of bf16 weights per chip of a v6e 2x4 before any layer is gathered; the compiler needs
131 GB of temporaries there. Fits no topology the check tries (2x4, 4x4, 4x8): each compile stops at its
out-of-memory, in seconds. (A model that fits 4x4 makes that compile, near the chips' capacity, take a minute; the
suggestion's line: tests/trainer/test_plan_cli.py.)"""


def test_a_lorajob_too_large_for_its_tpu_chips_ends_does_not_fit_before_a_tpu_jobset_exists(
    lorajobs, operator, assets, tmp_path
):
    model = tmp_path / "wide"  # the tiny model's tokenizer with a config.json far wider: the fit check reads only that
    shutil.copytree(assets.model, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | WIDER_THAN_A_V6E_4X8))
    body = localjob.lorajob("too-wide", assets, steps=STEPS)
    # One row per device: no smaller batch to try. Remat auto compiles "full" first, which does not fit either, so
    # the check compiles the step three times: its own 2x4, then 4x4 and 4x8.
    body["spec"]["training"]["perDeviceBatchSize"] = 1
    # A base already in the trainer's format (never read: the check step fails first), so the chain starts
    # with a check step of its own; config.json comes from the tokenizer directory, as for a MaxText base.
    body["spec"]["model"] = {"name": localjob.MODEL_NAME, "maxtextCheckpoint": str(tmp_path / "base" / "0" / "items"),
                             "tokenizer": str(model)}
    lorajobs.apply(body)
    failed = lorajobs.wait_phase("too-wide", "Failed", timeout=TIMEOUT)

    reason = condition(failed, "Failed")
    assert reason["reason"] == "DoesNotFit", reason
    assert reason["message"].startswith("the check step failed (JobSet too-wide-check"), reason["message"]
    assert f"exited with code {exit_codes.DOES_NOT_FIT}" in reason["message"], reason["message"]
    assert "the train step does not fit 2x4 (8 chips), per-device batch 1 x 1 accumulation, remat auto: " in reason["message"], reason
    assert "none of 2 smaller batches, remat policies or larger topologies tried fits" in reason["message"], reason
    steps = {js["metadata"]["labels"]["lorajob.dev/phase"] for js in lorajobs.jobsets()
             if js["metadata"]["labels"].get("lorajob.dev/run-name") == "too-wide"}
    assert steps == {"check"}, steps  # no TPU JobSet was ever created (a train JobSet is not deleted on failure)


@pytest.mark.parametrize("secret", [None, {"OTHER": "x"}], ids=["no-secret", "no-key"])
def test_a_token_that_cannot_arrive_fails_the_first_cpu_step_with_the_reason(lorajobs, operator, assets, secret):
    """The operator holds no right on Secrets: the token is an optional secretKeyRef, and the check step's pod
    says what is missing, before any TPU is held."""
    run = f"token-{'key' if secret else 'secret'}"
    if secret:
        lorajobs.kubectl("create", "secret", "generic", "keyless", *(f"--from-literal={k}={v}" for k, v in secret.items()))
    body = localjob.lorajob(run, assets, steps=STEPS)
    body["spec"]["model"] = {"name": localjob.MODEL_NAME, "maxtextCheckpoint": str(assets.outputs / "none" / "0" / "items"),
                             "tokenizer": str(assets.model)}
    body["spec"]["credentials"] = {"huggingFaceToken": {"name": "keyless", "key": "token"}}
    lorajobs.apply(body)
    failed = lorajobs.wait_phase(run, "Failed", timeout=TIMEOUT)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "InvalidConfig", reason
    assert "no Secret keyless with a non-empty key token" in reason["message"], reason["message"]
    steps = {js["metadata"]["labels"]["lorajob.dev/phase"] for js in lorajobs.jobsets()
             if js["metadata"]["labels"].get("lorajob.dev/run-name") == run}
    assert steps == {"check"}, steps


def test_an_int8_qlora_lorajob_trains_and_evaluates_and_the_gate_keeps_its_adapter_from_export(lorajobs, operator, assets):
    """The train step holds the base in int8 (QLoRA, lora.baseQuantization rendered into its command line): every
    step's loss is finite and the checkpoint records the quantisation. A pattern no answer holds scores both models
    0: requireImprovement refuses the adapter, so the export step exits NoImprovement before writing, and the
    LoRAJob fails with both scores; the checkpoints stay. (A QLoRA adapter's export for the full-precision base:
    tests/trainer/test_qlora.py; an exported adapter of this chain that PEFT loads: the DoRA chain above.)"""
    from lorajob_trainer import lora

    run = "gated-qlora-real"
    body = localjob.lorajob(run, assets, steps=STEPS)
    body["spec"]["lora"]["baseQuantization"] = "int8"
    body["spec"]["evaluation"] = {"scorer": "regex", "pattern": "(no answer says this)", "maxNewTokens": 8,
                                  "examples": 6, "samples": 2}
    body["spec"]["export"] = {"requireImprovement": True}
    lorajobs.apply(body)
    failed = lorajobs.wait_phase(run, "Failed", timeout=TIMEOUT)

    evaluation = failed["status"]["evaluation"]
    assert (evaluation["scorer"], evaluation["examples"], evaluation["step"]) == ("regex", 6, STEPS), evaluation
    assert evaluation["base"]["score"] == evaluation["adapter"]["score"] == 0.0
    assert 0 < evaluation["adapter"]["meanLength"] <= 8 and len(evaluation["samples"]) == 2
    reason = condition(failed, "Failed")
    assert reason["reason"] == "NoImprovement", reason
    assert reason["message"].startswith(f"the export step failed (JobSet {run}-to-hf"), reason["message"]
    assert f"the adapter of step {STEPS} is not exported: it does not score above the base model" in reason["message"]
    assert not assets.adapter(run).exists()
    assert failed["status"]["progress"]["state"] == "succeeded"
    losses = [r["loss"] for r in metrics.read_metrics(assets.metrics(run)) if "loss" in r]
    assert len(losses) == STEPS and all(np.isfinite(losses)), losses
    adapters, saved = lora.load_adapter_checkpoint(assets.outputs / run / "checkpoints" / str(STEPS))
    assert (saved.step, saved.base_quantization) == (STEPS, "int8"), saved
    assert adapters and all(np.isfinite(value).all() for value in adapters.values())


@pytest.mark.torch
def test_a_dpo_lorajob_learns_its_preference_reports_to_mlflow_and_exports_an_adapter_peft_loads(
        lorajobs, operator, assets, mlflow_server):
    """spec.method dpo on generated pairs whose chosen answers are learnable (demo.preference_rows: the right sum,
    worded as the question/answer rows are; the rejected ones a bare wrong sum): the train step's reward accuracy
    and the eval split's preference accuracy reach status.progress and rise above 90 %; the evaluation ranks the
    adapter above the base by preference accuracy, so export.requireImprovement lets the export run. The run reports
    to a real MLflow server (spec.tracking.mlflow): status.tracking links its run, which holds the resolved config,
    one point per step of each metric, the loss plot and the exported adapter, which loads from there in PEFT and
    changes the base model's output."""
    import torch
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = "dpo-real"
    body = localjob.lorajob(run, assets, steps=STEPS, checkpoint_period=STEPS // 2)
    body["spec"]["method"] = "dpo"
    body["spec"]["dataset"].update(dataDir=str(assets.preference_data), columns=["prompt", "chosen", "rejected"])
    body["spec"]["training"]["learningRate"] = 3e-3
    body["spec"]["evaluation"] = {"scorer": "contains", "maxNewTokens": 8, "examples": 6, "samples": 1}
    body["spec"]["export"] = {"requireImprovement": True}
    body["spec"]["tracking"] = {"mlflow": {"trackingUri": mlflow_server.url, "tags": {"suite": "e2e"}}}
    lorajobs.apply(body)
    succeeded = lorajobs.wait_phase(run, "Succeeded", timeout=TIMEOUT)
    evaluation = succeeded["status"]["evaluation"]
    assert evaluation["adapter"]["preferenceAccuracy"] > evaluation["base"]["preferenceAccuracy"], evaluation

    progress = succeeded["status"]["progress"]
    assert progress["rewardAccuracy"] > 0.9 and progress["evalPreferenceAccuracy"] > 0.9, progress
    records = metrics.read_metrics(assets.metrics(run))
    accuracies = [r["reward_accuracy"] for r in records if "reward_accuracy" in r]
    evaluations = [r["eval_preference_accuracy"] for r in records if "eval_preference_accuracy" in r]
    assert len(accuracies) == STEPS and len(evaluations) == 2, records
    print(f"reward accuracy by step {accuracies}; eval preference accuracy {evaluations}; preference accuracy base "
          f"{evaluation['base']['preferenceAccuracy']}, adapter {evaluation['adapter']['preferenceAccuracy']}")

    url = succeeded["status"]["tracking"]["mlflow"]["url"]
    assert url.startswith(f"{mlflow_server.url}/#/experiments/"), succeeded["status"]["tracking"]
    client = MlflowClient(mlflow_server.url)
    tracked = client.get_run(url.rsplit("/", 1)[-1])
    assert tracked.info.status == "FINISHED" and tracked.data.tags["suite"] == "e2e", tracked.info
    assert tracked.data.params["method"] == "dpo" and tracked.data.params["tracking.job_name"] == run, tracked.data.params
    for name in ("loss", "reward_accuracy", "learning_rate"):
        assert [m.step for m in client.get_metric_history(tracked.info.run_id, name)] == list(range(1, STEPS + 1)), name
    assert [m.value for m in client.get_metric_history(tracked.info.run_id, "reward_accuracy")] == accuracies
    artifacts = {artifact.path for artifact in client.list_artifacts(tracked.info.run_id)}
    assert {"adapter", "loss.png"} <= artifacts, artifacts
    adapter = download_artifacts(run_id=tracked.info.run_id, artifact_path="adapter", tracking_uri=mlflow_server.url,
                                 dst_path=str(assets.outputs / f"{run}-from-mlflow"))

    base = AutoModelForCausalLM.from_pretrained(assets.model, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        after = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits
    assert torch.isfinite(after).all() and (after - before).abs().max() > 1e-3
