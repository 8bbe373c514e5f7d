"""The fine-tuning API's pure parts: the upload check, requests into LoRAJobs, LoRAJobs into the API's objects, the
server's configuration and its rate limit (the server on a cluster: tests/e2e/test_fine_tuning_api.py)."""

from __future__ import annotations

import io
import json

import fsspec
import pytest
from pydantic import ValidationError

from lorajob_operator import validation
from lorajob_operator.openai_api import jobs
from lorajob_operator.openai_api.config import ModelOffer, ServerConfig
from lorajob_operator.openai_api.files import FileStore, StoredFile, UploadCheck, UploadRefused, paginate
from lorajob_operator.openai_api.server import RateLimits, ReviewCache
from lorajob_trainer.contract.rows import to_messages, to_preference_messages

TEMPLATE = {
    "model": {"name": "qwen3-4b", "huggingFace": "gs://models/qwen3-4b"},
    "training": {"perDeviceBatchSize": 2, "maxTargetLength": 512, "learningRate": 1e-4, "evalInterval": 5},
    "compute": {"tpu": {"machineType": "ct6e-standard-4t", "topology": "2x4"}},
    "evaluation": {"examples": 8},
}
OFFER = ModelOffer(template=TEMPLATE)
CHIPS = 8
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
PREFERENCE = {"input": {"messages": [{"role": "user", "content": "2+2?"}]},
              "preferred_output": [{"role": "assistant", "content": "4"}],
              "non_preferred_output": [{"role": "assistant", "content": "5"}]}


def check(lines: list, **limits) -> tuple[UploadCheck, list[dict]]:
    sink = io.BytesIO()
    upload = UploadCheck(sink, **({"max_bytes": 10_000, "max_lines": 100, "errors_listed": 3} | limits))
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    for start in range(0, len(text), 7):  # lines split across chunks
        upload.feed(text[start:start + 7])
    upload.finish()
    return upload, [json.loads(line) for line in sink.getvalue().splitlines()]


def test_each_layout_is_stored_in_the_trainers_columns_and_reads_back_with_its_rules():
    upload, rows = check([CHAT, CHAT])
    assert (upload.layout.name, upload.lines, rows) == ("chat", 2, [CHAT, CHAT])
    assert to_messages(rows[0], upload.layout.columns)[-1] == {"role": "assistant", "content": "4"}

    upload, rows = check([{"prompt": "2+2?", "completion": "4"}])
    assert upload.layout.columns == ("prompt", "completion") and rows == [{"prompt": "2+2?", "completion": "4"}]

    upload, rows = check([PREFERENCE])
    assert upload.layout.columns == ("prompt", "chosen", "rejected")
    prompt, chosen, rejected = to_preference_messages(rows[0], upload.layout.columns)
    assert (prompt[0]["content"], chosen[0]["content"], rejected[0]["content"]) == ("2+2?", "4", "5")


def test_bad_lines_are_listed_by_number_up_to_the_limit_and_counted_beyond_it():
    lines = [CHAT, "{not json", {"messages": [{"role": "user", "content": "no answer"}]}, {"text": "x"},
             {"prompt": "a", "completion": "b"},
             {"messages": [{"role": "assistant", "content": "4", "tool_calls": []}]}]
    with pytest.raises(UploadRefused) as refused:
        check(lines)
    message = str(refused.value)
    assert message.startswith("5 of 6 lines cannot be trained on (and 2 more): line 2: not JSON"), message
    assert "line 3: messages hold no assistant message" in message and "line 4: keys ['text'] match no layout" in message
    with pytest.raises(UploadRefused, match=r"line 2: messages\[0\] holds \['tool_calls'\]"):
        check([CHAT, lines[-1]])
    with pytest.raises(UploadRefused, match="layout prompt_completion, but the lines before it are chat"):
        check([CHAT, lines[4]])


@pytest.mark.parametrize("lines, limits, refusal", [
    ([CHAT] * 3, {"max_lines": 2}, "more than this API's limit of 2 lines"),
    ([CHAT] * 300, {"max_lines": 1000}, "larger than this API's limit of 10000 bytes"),
    (["", " "], {}, "holds no lines"),
])
def test_an_upload_past_a_limit_or_empty_is_refused(lines, limits, refusal):
    with pytest.raises(UploadRefused, match=refusal):
        check(lines, **limits)


def stored(layout: str = "chat", lines: int = 100, file_id: str = "file-train") -> StoredFile:
    return StoredFile(file_id, "train.jsonl", 1000, 1767268800, layout, lines)


def build(request: dict, training: StoredFile | None = None, validation_file: StoredFile | None = None,
          offer: ModelOffer = OFFER) -> dict:
    create = jobs.CreateJob.model_validate({"model": "qwen3-4b", "training_file": "file-train"} | request)
    return jobs.build_lorajob(create, offer, job_id="ftjob-abc", namespace="team-a", user="alice",
                              training=training or stored(), validation=validation_file,
                              dataset_folder="gs://b/team-a/jobs/ftjob-abc/data", outputs="gs://b/team-a/jobs/ftjob-abc/runs")


def test_a_supervised_request_becomes_a_lorajob_the_api_server_accepts():
    body = build({"hyperparameters": {"n_epochs": 2, "batch_size": 64, "learning_rate_multiplier": 0.5}, "seed": 3,
                  "suffix": "sums", "metadata": {"team": "a"}}, validation_file=stored(file_id="file-valid"))
    assert validation.validate(body) == []
    spec = body["spec"]
    # 64 examples a step on 8 chips: 8 per chip, in micro-batches of at most the template's 2.
    assert spec["training"] | {} == TEMPLATE["training"] | {
        "steps": 4, "perDeviceBatchSize": 2, "gradientAccumulationSteps": 4, "learningRate": 5e-5, "seed": 3,
        "packing": False, "checkpointPeriod": 2}
    assert spec["dataset"] == {"name": "json", "dataDir": "gs://b/team-a/jobs/ftjob-abc/data", "columns": ["messages"],
                               "split": "train", "evalSplit": "test"}
    assert spec["output"] == {"baseOutputDirectory": "gs://b/team-a/jobs/ftjob-abc/runs"} and spec["method"] == "sft"
    request = jobs.request_of(body)
    assert request["hyperparameters"] == {"n_epochs": 2, "batch_size": 64, "learning_rate_multiplier": 0.5}
    assert (request["suffix"], request["seed"], request["user"]) == ("sums", 3, "alice")


def test_auto_takes_the_templates_batch_and_three_epochs_and_no_validation_file_drops_what_needs_one():
    spec = build({})["spec"]
    assert (spec["training"]["perDeviceBatchSize"], spec["training"]["steps"]) == (2, 3 * 7)  # 100 examples, 16 a step
    assert "evalInterval" not in spec["training"] and "evaluation" not in spec and "evalSplit" not in spec["dataset"]
    assert validation.validate(build({})) == []


def test_a_dpo_request_trains_on_preference_lines_with_its_beta_and_the_lora_extension():
    body = build({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "lora_rank": 32, "lora_alpha": 64}}}},
                 training=stored("preference"))
    spec = body["spec"]
    assert (spec["method"], spec["preference"], spec["lora"]) == ("dpo", {"beta": 0.2}, {"rank": 32, "alpha": 64})
    assert spec["dataset"]["columns"] == ["prompt", "chosen", "rejected"] and validation.validate(body) == []


def test_wandb_integration_becomes_the_lorajobs_wandb_tracking():
    integration = {"type": "wandb", "wandb": {"project": "sums", "entity": "team", "tags": ["a"]}}
    assert build({"integrations": [integration]})["spec"]["tracking"] == {
        "wandb": {"project": "sums", "entity": "team", "tags": ["a"]}}


@pytest.mark.parametrize("request_, training, param", [
    ({"hyperparameters": {"batch_size": 12}}, stored(), "hyperparameters.batch_size"),
    ({"method": {"type": "dpo"}}, stored(), "training_file"),
    ({}, stored("preference"), "training_file"),
    ({"hyperparameters": {"beta": 0.1}}, stored(), "method.supervised.hyperparameters.beta"),
    ({"hyperparameters": {"n_epochs": 2}, "method": {"type": "supervised", "supervised": {"hyperparameters": {}}}},
     stored(), "hyperparameters"),
])
def test_a_request_without_a_lorajob_meaning_is_refused_naming_the_parameter(request_, training, param):
    with pytest.raises(jobs.RequestError) as refused:
        build(request_, training=training)
    assert refused.value.param == param, refused.value.message


@pytest.mark.parametrize("body, param, code", [
    ({"hyperparameters": {"prompt_loss_weight": 0.1}}, "hyperparameters.prompt_loss_weight", "unsupported_parameter"),
    ({"method": {"type": "reinforcement"}}, "method.type", "unsupported_parameter"),
    ({"suffix": "s" * 65}, "suffix", "invalid_parameter"),
    ({"hyperparameters": {"n_epochs": "3"}}, "hyperparameters.n_epochs", "invalid_parameter"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}] * 2}, "integrations", "invalid_parameter"),
    ({"weights": "bf16"}, "weights", "unsupported_parameter"),
    ({"integrations": [{"type": "wandb", "wandb": {"project": "p", "name": "run"}}]}, "integrations.0.wandb.name",
     "unsupported_parameter"),
])
def test_the_request_schema_names_the_field_at_fault(body, param, code):
    with pytest.raises(ValidationError) as error:
        jobs.CreateJob.model_validate({"model": "m", "training_file": "file-x"} | body)
    described = jobs.describe_validation_error(error.value)
    assert (described.param, described.code) == (param, code), described.message


def lorajob(phase: str | None = None, **status) -> dict:
    body = build({"suffix": "sums"})
    body["metadata"]["creationTimestamp"] = "2026-12-07T10:00:00Z"
    body["status"] = ({"phase": phase} if phase else {}) | status
    return body


@pytest.mark.parametrize("phase, expected", [
    (None, "validating_files"), ("Pending", "validating_files"), ("Queued", "queued"), ("Converting", "running"),
    ("Training", "running"), ("Succeeded", "succeeded"), ("Failed", "failed"), ("Suspended", "paused"),
])
def test_phases_map_to_the_apis_statuses(phase, expected):
    assert jobs.job_status(lorajob(phase)) == expected


def test_a_cancelled_job_stays_cancelled_and_a_finished_one_names_its_model_or_error():
    obj = lorajob("Suspended")
    obj["metadata"]["annotations"][jobs.CANCELLED_ANNOTATION] = "1765101000"
    assert jobs.job_object(obj)["status"] == "cancelled" and jobs.job_object(obj)["finished_at"] == 1765101000
    done = jobs.job_object(lorajob("Succeeded", completionTime="2026-12-07T10:05:00Z",
                                   outputs={"adapterPath": "gs://b/adapter"}, data={"trainedTokens": 1234}))
    assert done["fine_tuned_model"] == "ft:qwen3-4b:team-a:sums:ftjob-abc" and done["trained_tokens"] == 1234
    failed = jobs.job_object(lorajob("Failed", conditions=[
        {"type": "Failed", "status": "True", "reason": "InvalidData", "message": "column 'answer' missing"}]))
    assert failed["error"] == {"code": "InvalidData", "message": "column 'answer' missing", "param": None}


def test_events_and_checkpoints_come_from_the_status_newest_first_with_stable_ids():
    checkpoints = [{"step": s, "time": f"2026-12-07T10:0{s}:00Z", "trainLoss": 1 / s, "evalLoss": 2 / s, "path": f"/c/{s}"}
                   for s in (2, 4)]
    obj = lorajob("Training", checkpoints=checkpoints,
                  progress={"step": 5, "totalSteps": 8, "loss": 0.1, "advancedTime": "2026-12-07T10:06:00Z"})
    kube = [{"metadata": {"uid": "u1"}, "type": "Warning", "reason": "Retrying", "message": "pod lost",
             "lastTimestamp": "2026-12-07T10:03:00Z", "count": 1}]
    events = jobs.job_events(obj, kube)
    assert [e["message"] for e in events] == ["Step 5/8: training loss=0.1", "Checkpoint saved at step 4",
                                              "Retrying: pod lost", "Checkpoint saved at step 2", "Created fine-tuning job"]
    assert events[2]["level"] == "warn" and events[0]["data"]["step"] == 5
    assert [e["id"] for e in jobs.job_events(obj, kube)] == [e["id"] for e in events]
    listed = jobs.job_checkpoints(obj)
    assert [c["step_number"] for c in listed] == [4, 2]
    assert listed[0]["fine_tuned_model_checkpoint"] == "ft:qwen3-4b:team-a:sums:ftjob-abc:ckpt-step-4"
    assert listed[0]["metrics"] == {"step": 4, "train_loss": 0.25, "valid_loss": 0.5}


def test_pages_follow_after_and_say_whether_more_follow():
    items = [{"id": f"x{i}"} for i in range(5)]
    assert paginate(items, None, 2) == (items[:2], True)
    assert paginate(items, "x2", 2) == (items[3:], False)
    assert paginate(items, "gone", 2) == ([], False)


def test_a_template_may_not_set_what_each_request_decides():
    with pytest.raises(ValidationError, match="the template sets dataset, training.steps, output.baseOutputDirectory"):
        ServerConfig.model_validate({"storage": "/data", "namespaces": ["a"], "models": {"m": {"template": {
            "dataset": {}, "training": {"steps": 1}, "output": {"baseOutputDirectory": "/x"}}}}})


def test_the_rate_limit_refuses_past_its_burst_and_refills_over_a_minute():
    limits = RateLimits(per_minute=3)
    assert [limits.take("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limits.take("b", 0.0), "per namespace"
    assert limits.take("a", 20.0) and not limits.take("a", 20.0)


def test_the_jobs_end_is_its_newest_event_even_beside_an_event_of_the_same_second():
    obj = lorajob("Succeeded", completionTime="2026-12-07T10:05:00Z", outputs={"adapterPath": "/a"})
    kube = [{"metadata": {"uid": "u2"}, "type": "Normal", "reason": "Succeeded", "message": "all steps completed",
             "lastTimestamp": "2026-12-07T10:05:00Z"}]
    events = jobs.job_events(obj, kube)
    assert events[0]["message"] == "The job has successfully completed: ft:qwen3-4b:team-a:sums:ftjob-abc"
    assert [e["created_at"] for e in events] == sorted((e["created_at"] for e in events), reverse=True)


def test_review_answers_are_reused_for_their_time_and_the_oldest_go_past_the_bound():
    asked = []

    def ask(key):
        return lambda: asked.append(key) or f"answer {key}"

    kept = ReviewCache(seconds=60, size=2)
    assert [kept.get((k,), ask(k)) for k in ("a", "a", "b", "c", "a")] == ["answer a"] * 2 + ["answer b", "answer c", "answer a"]
    assert asked == ["a", "b", "c", "a"], "a was the oldest when c came"
    expired = ReviewCache(seconds=0)
    expired.get(("a",), ask("a")), expired.get(("a",), ask("a"))
    assert asked[-2:] == ["a", "a"]


def test_jobs_of_the_same_second_list_in_the_order_they_were_created():
    first, second = lorajob(), lorajob()
    second["metadata"]["name"] = "ftjob-aaa"  # sorts before the first's name
    assert [o["metadata"]["name"] for o in jobs.newest_first([first, second])] == ["ftjob-aaa", "ftjob-abc"]


@pytest.fixture(params=["folder", "memory"])
def store(request, tmp_path) -> FileStore:
    """A store in a local folder and one behind an fsspec URL (as gs:// is)."""
    if request.param == "folder":
        yield FileStore(str(tmp_path / "storage"))
        return
    root = f"memory://lorajob-api-{tmp_path.name}"
    yield FileStore(root)
    fsspec.filesystem("memory").rm(root.removeprefix("memory:/"), recursive=True)


def test_the_store_keeps_each_namespaces_files_apart_and_copies_a_jobs_dataset(store, tmp_path):
    spooled = tmp_path / "spooled.jsonl"
    with spooled.open("wb") as sink:
        upload = UploadCheck(sink, max_bytes=10_000, max_lines=100, errors_listed=3)
        upload.feed((json.dumps(CHAT) + "\n").encode() * 3)
        upload.finish()
    first = store.put("team-a", str(spooled), "train.jsonl", upload)
    second = store.put("team-a", str(spooled), "valid.jsonl", upload)
    assert (first.lines, first.layout, first.bytes) == (3, "chat", upload.bytes)
    assert [f.id for f in store.list("team-a")][0] in (first.id, second.id) and len(store.list("team-a")) == 2
    assert store.get("team-b", first.id) is None and store.list("team-b") == []
    assert (store.count("team-a"), store.count("team-b")) == (2, 0)
    assert store.get("team-a", "file-../../etc") is None

    folder = store.job_folder("team-a", "ftjob-x")
    store.copy_to("team-a", first.id, f"{folder}/data/train.jsonl")
    with store.fs.open(f"{folder}/data/train.jsonl") as copied:
        assert [json.loads(line) for line in copied.read().splitlines()] == [CHAT] * 3
    assert store.url(folder).endswith("team-a/jobs/ftjob-x") and store.url(folder).startswith(("memory://", "/"))
    store.remove_job_folder(folder)
    assert not store.fs.exists(folder)
    store.delete("team-a", first.id)
    assert [f.id for f in store.list("team-a")] == [second.id]


@pytest.mark.parametrize("text, valid", [("ftjob-abc123", True), ("ftjob-", False), ("ftjob-..", False),
                                         ("ftjob-a/b", False), ("ftjob-ABC", False), ("x-abc", False)])
def test_only_a_name_the_api_gives_is_a_job_id(text, valid):
    assert jobs.is_job_id(text) is valid


def test_events_of_the_same_second_keep_the_order_they_happened_in():
    kube = [{"metadata": {"uid": f"u{i}"}, "type": "Normal", "reason": reason, "message": "",
             "lastTimestamp": "2026-12-07T10:01:00Z"} for i, reason in enumerate(("Queued", "Training", "Exporting"))]
    events = jobs.job_events(lorajob("Exporting"), kube)
    assert [e["message"] for e in events][:3] == ["Exporting: ", "Training: ", "Queued: "]
