"""The OpenAI fine-tuning API (`lorajob api`) driven by the official `openai` client, on the simulated cluster: two
tenants (a namespace and a service account each, with a Role on LoRAJobs in their own namespace only), the
operator watching both, and the API server with the cluster's admin kubeconfig. A job uploaded and created through
the client really trains (the pod runner's nodes) and exports its adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from lorajobs import Lorajobs

from lorajob_devcluster import localjob
from lorajob_operator.local import ApiServerProcess
from lorajob_operator.openai_api import CALLER_RULES, jobs
from lorajob_trainer import demo

pytestmark = [pytest.mark.cluster, pytest.mark.slow(minutes=6)]
MODEL = localjob.MODEL_NAME
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fine_tuning_api.py"
TIMEOUT = 600
"""Bound on the wait for the trained job: pod start-ups and compiles on a loaded 2-core machine (test_real_pods)."""


def chat_lines(rows: list[dict]) -> bytes:
    return "".join(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                            {"role": "assistant", "content": r["answer"]}]}) + "\n"
                   for r in rows).encode()


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> localjob.Assets:
    return localjob.write_assets(tmp_path_factory.mktemp("fine-tuning-api"), train_rows=8, eval_rows=8)


@pytest.fixture
def other_namespace(sim_cluster, namespace):
    name = sim_cluster.create_namespace_with_queue(f"{namespace}-b")
    yield name
    sim_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def serve(sim_cluster, namespace, other_namespace, assets, tmp_path):
    """Starts the API server for both namespaces with `limits`; stopped at the end."""
    started = []

    def start(limits: dict) -> ApiServerProcess:
        config = {"storage": str(tmp_path / "api-storage"), "namespaces": [namespace, other_namespace],
                  "models": {MODEL: localjob.fine_tuning_offer(assets)}, "limits": limits}
        started.append(ApiServerProcess(sim_cluster.kubeconfig, config, tmp_path).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def api_server(serve) -> ApiServerProcess:
    return serve({"lineErrors": 3})


@pytest.fixture
def small_chips_policy(sim_cluster, other_namespace):
    """A LoRAJobPolicy allowing the second namespace's LoRAJobs 4 TPU chips (the model's template takes 8)."""
    name = f"{other_namespace}-chips"
    sim_cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "lorajob.dev/v1alpha1", "kind": "LoRAJobPolicy", "metadata": {"name": name},
        "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": other_namespace}},
                 "tpu": {"maxChipsPerJob": 4}}}))
    yield name
    sim_cluster.kubectl("delete", "lorajobpolicies.lorajob.dev", name)


def client(server: ApiServerProcess, token: str, project: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=token, project=project, max_retries=0)


def test_the_openai_client_trains_a_lorajob_cancels_another_gets_the_apis_errors_and_tenants_stay_apart(
    sim_cluster, namespace, other_namespace, api_server, start_operator, small_chips_policy, tmp_path
):
    alice = client(api_server, sim_cluster.plane.service_account_token(namespace, "alice", CALLER_RULES))
    bob = client(api_server, sim_cluster.plane.service_account_token(other_namespace, "bob", CALLER_RULES))
    lorajobs = Lorajobs(sim_cluster, namespace)
    start_operator(namespaces=[namespace, other_namespace])
    training = alice.files.create(file=("train.jsonl", chat_lines(demo.arithmetic_rows(64))), purpose="fine-tune")
    validation = alice.files.create(file=("valid.jsonl", chat_lines(demo.arithmetic_rows(8, seed=1))),
                                    purpose="fine-tune")
    assert (training.bytes, training.purpose, training.filename) == (
        len(chat_lines(demo.arithmetic_rows(64))), "fine-tune", "train.jsonl")
    assert {f.id for f in alice.files.list()} == {training.id, validation.id}

    assert_refused_without_a_trace(api_server, alice, bob, other_namespace, lorajobs, training.id, small_chips_policy)

    job = alice.fine_tuning.jobs.create(
        model=MODEL, training_file=training.id, validation_file=validation.id, suffix="sums", seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 2, "batch_size": 16, "learning_rate_multiplier": 2}}},
        metadata={"team": "arithmetic"})
    spec = lorajobs.get(job.id)["spec"]  # the LoRAJob exists once create returns
    expected = {"steps": 8, "perDeviceBatchSize": 2, "gradientAccumulationSteps": 1, "learningRate": 2e-2,
                "seed": 7, "packing": False, "checkpointPeriod": 4}
    assert {key: spec["training"].get(key) for key in expected} == expected
    assert spec["dataset"]["columns"] == ["messages"] and spec["dataset"]["evalSplit"] == "test"
    assert job.status in ("validating_files", "queued") and job.hyperparameters.n_epochs == 2
    assert job.hyperparameters.batch_size == 16 and job.metadata == {"team": "arithmetic"}

    cancelled = alice.fine_tuning.jobs.create(model=MODEL, training_file=training.id)
    assert alice.fine_tuning.jobs.cancel(cancelled.id).status == "cancelled"
    assert lorajobs.get(cancelled.id)["spec"]["suspend"] is True
    with pytest.raises(openai.BadRequestError, match="cancelled: it cannot cancel"):
        alice.fine_tuning.jobs.cancel(cancelled.id)

    page = alice.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in page.data] == [cancelled.id] and page.has_more
    assert [j.id for j in alice.fine_tuning.jobs.list(limit=5, after=cancelled.id).data] == [job.id]
    assert_tenants_apart(alice, bob, job.id, training.id)

    lorajobs.wait_until(lambda: alice.fine_tuning.jobs.retrieve(job.id).status == "running", "the job running",
                        timeout=TIMEOUT)
    assert alice.fine_tuning.jobs.list_events(job.id).data, "events while it runs"
    done = lorajobs.wait_until(
        lambda: (j := alice.fine_tuning.jobs.retrieve(job.id)).status in jobs.FINISHED and j, "the job's end",
        timeout=TIMEOUT)

    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{MODEL}:{namespace}:sums:{job.id}"
    assert done.trained_tokens and done.finished_at >= done.created_at
    adapter = Path(done.model_extra["lorajob"]["adapter_path"])
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 8, "PEFT's adapter files"
    checkpoints = alice.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [8, 4], "one a epoch, newest first"
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-8"
    assert checkpoints[0].metrics.valid_loss is not None
    events = alice.fine_tuning.jobs.list_events(job.id, limit=100).data
    assert events[0].message.startswith("The job has successfully completed")
    assert any(e.type == "metrics" and e.data["step"] == 8 for e in events)
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    older = alice.fine_tuning.jobs.list_events(job.id, limit=2, after=events[1].id).data
    assert [e.id for e in older] == [e.id for e in events[2:4]], "paged by after"

    # The example script, unchanged from one written for a hosted service: only its environment names the cluster.
    train = tmp_path / "train.jsonl"
    train.write_bytes(chat_lines(demo.arithmetic_rows(16)))
    script = subprocess.run(
        [sys.executable, str(EXAMPLE), str(train), "--model", MODEL, "--suffix", "script", "--epochs", "1", "--poll", "1"],
        env={**os.environ, "OPENAI_BASE_URL": f"{api_server.url}/v1", "OPENAI_API_KEY": alice.api_key,
             "OPENAI_PROJECT_ID": namespace},
        capture_output=True, text=True, timeout=TIMEOUT)
    assert script.returncode == 0, script.stdout + script.stderr
    assert f"fine-tuned model: ft:{MODEL}:{namespace}:script:ftjob-" in script.stdout, script.stdout
    assert "Created fine-tuning job" in script.stdout and "checkpoint at step 1:" in script.stdout, script.stdout


def assert_refused_without_a_trace(server, alice, bob, bobs_namespace: str, lorajobs, training_id: str,
                                   policy: str) -> None:
    """Bad input and bad credentials get the API's errors, and no LoRAJob comes of them."""
    with pytest.raises(openai.BadRequestError) as malformed:
        alice.files.create(file=("bad.jsonl", b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'
                                 b'{"prompt": "a", "completion": "b"}\n'), purpose="fine-tune")
    message = malformed.value.body["message"]
    assert "line 1: messages hold no assistant message" in message and "line 2: not JSON" in message, message
    assert "line 3: layout prompt_completion, but the lines before it are chat" in message, message

    refusals = {
        "model": dict(model="gpt-4o-mini", training_file=training_id),
        "suffix": dict(model=MODEL, training_file=training_id, suffix="s" * 65),
        "method.type": dict(model=MODEL, training_file=training_id, method={"type": "reinforcement"}),
        "hyperparameters.batch_size": dict(model=MODEL, training_file=training_id, hyperparameters={"batch_size": 12}),
        "hyperparameters.prompt_loss_weight": dict(model=MODEL, training_file=training_id,
                                                   hyperparameters={"prompt_loss_weight": 0.1}),
    }
    for param, request in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            alice.fine_tuning.jobs.create(**request)
        assert refused.value.body["param"] == param, refused.value.body
    with pytest.raises(openai.BadRequestError, match="no LoRAJob meaning|not supported"):
        alice.fine_tuning.jobs.create(model=MODEL, training_file=training_id, extra_body={"weights": "bf16"})

    bobs_file = bob.files.create(file=("b.jsonl", chat_lines(demo.arithmetic_rows(4))), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="no such file in project"):
        alice.fine_tuning.jobs.create(model=MODEL, training_file=bobs_file.id)
    with pytest.raises(openai.BadRequestError, match=f"refused by policy: {policy}: .*4") as refused:
        bob.fine_tuning.jobs.create(model=MODEL, training_file=bobs_file.id)
    assert refused.value.code == "policy_violation"
    assert not Lorajobs(lorajobs.cluster, bobs_namespace).kubectl("get", "lorajobs.lorajob.dev", "-o", "name").stdout.strip()

    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-token").fine_tuning.jobs.list()
    with pytest.raises(openai.PermissionDeniedError, match="may not list LoRAJobs"):
        client(server, alice.api_key, project=bobs_namespace).fine_tuning.jobs.list()
    assert not lorajobs.kubectl("get", "lorajobs.lorajob.dev", "-o", "name").stdout.strip(), "nothing created"


def assert_tenants_apart(alice, bob, job_id: str, file_id: str) -> None:
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.retrieve(job_id)
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        bob.fine_tuning.jobs.cancel(job_id)
    assert job_id not in {j.id for j in bob.fine_tuning.jobs.list().data}
    assert file_id not in {f.id for f in bob.files.list().data}


def test_a_namespace_past_its_limits_gets_the_apis_errors(sim_cluster, namespace, serve):
    server = serve({"requestsPerMinute": 4, "fileBytes": 1000})
    alice = client(server, sim_cluster.plane.service_account_token(namespace, "alice", CALLER_RULES))
    with pytest.raises(openai.BadRequestError, match="larger than this API's limit of 1000 bytes") as refused:
        alice.files.create(file=("big.jsonl", chat_lines(demo.arithmetic_rows(100))), purpose="fine-tune")
    assert refused.value.param == "file"
    with pytest.raises(openai.BadRequestError, match="purpose must be 'fine-tune'"):
        alice.files.create(file=("a.jsonl", chat_lines(demo.arithmetic_rows(1))), purpose="batch")
    listed = 0
    with pytest.raises(openai.RateLimitError, match="over its limit of 4 requests a minute"):
        while listed < 10:
            assert alice.fine_tuning.jobs.list().data == []
            listed += 1
    assert 2 <= listed <= 3, "4 requests in all (a fifth where the bucket refilled one, 15 s on)"
