"""A run that cannot complete its requested steps must say so: non-zero exit, what happened, which step.

Each test runs the real entry point (`python -m lorajob_trainer.train`) in a subprocess on a tiny
generated Qwen3 checkpoint with one example per step (packing and shuffling off), so the step at
which a bad example, a poisoned token or the end of the data arrives is known in advance.

The trainer reads its data in-process (no worker processes), so "a data worker dies" is the data
pipeline raising in the middle of a run: an example it cannot encode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from trainer_testkit import arithmetic_rows, tiny_checkpoint, trainer_env, write_jsonl

from lorajob_trainer.contract.records import PROGRESS_LINE_PREFIX

RUN_NAME = "run"


@dataclass
class Run:
    returncode: int
    output: str
    run_directory: Path
    stdout: str

    def metric_steps(self) -> list[int]:
        path = self.run_directory / "metrics.jsonl"
        if not path.is_file():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [record["step"] for record in records if "loss" in record]

    def progress(self) -> dict:
        return json.loads((self.run_directory / "progress.json").read_text())

    def progress_lines(self) -> list[dict]:
        """The progress lines on stdout (what the operator reads from the pod's log)."""
        return [json.loads(line.removeprefix(PROGRESS_LINE_PREFIX)) for line in self.stdout.splitlines()
                if line.startswith(PROGRESS_LINE_PREFIX)]


def train(tmp_path: Path, model_dir: Path, data_file: Path, *overrides: str, columns: str = "['question','answer']",
          launcher: tuple[str, ...] = ()) -> Run:
    """Run the trainer to completion or failure; one example per step."""
    output_directory = tmp_path / "out"
    arguments = [
        f"run_name={RUN_NAME}",
        f"base_output_directory={output_directory}",
        "model_name=tiny-qwen3",
        f"load_parameters_path={model_dir}",
        f"hf_train_files=['{data_file}']",
        f"train_data_columns={columns}",
        "max_target_length=32",
        "per_device_batch_size=1",
        "packing=False",
        "shuffle=False",
        "learning_rate=1e-3",
        "lora.lora_rank=4",
        "lora.lora_alpha=8",
        "enable_tensorboard=False",
        "async_checkpointing=False",
        "progress_lines=true",
        *overrides,
    ]
    env = trainer_env(devices=1)
    completed = subprocess.run(
        [*launcher, sys.executable, "-m", "lorajob_trainer.train", *arguments],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )
    return Run(completed.returncode, completed.stdout + completed.stderr, output_directory / RUN_NAME, completed.stdout)


def assert_failed_at(run: Run, step: int, *what: str, last_trained_step: int | None = None) -> None:
    """Non-zero exit; the log and the progress file (what the operator shows) say what failed at which step.

    `last_trained_step`: the last step whose metrics may be logged (default: the one before `step`).
    """
    assert run.returncode != 0, f"run reported success:\n{run.output[-3000:]}"

    def tells(text: str) -> bool:
        text = text.lower()
        return f"step {step}" in text and all(word in text for word in what)

    assert any(tells(line) for line in run.output.splitlines()), (
        f"no output line names step {step} and {what}:\n{run.output[-3000:]}")
    progress = run.progress()
    assert progress["state"] == "failed", progress
    assert tells(progress.get("message") or ""), f"progress file does not say what failed at step {step}: {progress}"
    assert run.progress_lines()[-1] == progress, "the last progress line on stdout is not the failure"
    last = step - 1 if last_trained_step is None else last_trained_step
    assert all(logged <= last for logged in run.metric_steps()), f"metrics claim steps {run.metric_steps()}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


# ---------------------------------------------------------------- end of the data


def test_exhausted_data_fails_at_the_step_when_epochs_are_not_allowed(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(4))
    run = train(tmp_path, tiny_model, data, "steps=6", "epoch_policy=fail")
    assert_failed_at(run, 5, "exhausted")


def test_exhausted_data_continues_into_the_next_epoch_and_logs_it(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(4))
    run = train(tmp_path, tiny_model, data, "steps=6", "epoch_policy=continue")
    assert run.returncode == 0, run.output[-3000:]
    assert "epoch 2 at step 5" in run.output, "the start of the second epoch is not logged with its step"
    assert run.metric_steps() == [1, 2, 3, 4, 5, 6]
    assert run.progress()["state"] == "succeeded"
    assert run.progress()["step"] == 6
    lines = run.progress_lines()
    assert [(line["step"], line["total_steps"], line["state"]) for line in lines] == [
        (0, 6, "compiling"), *((step, 6, "running") for step in range(1, 7)), (6, 6, "succeeded")]
    assert lines[-1] == run.progress()


# ---------------------------------------------------------------- the data pipeline breaks mid-run


def test_data_pipeline_failure_mid_run_names_the_step(tmp_path, tiny_model):
    rows = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
            for r in arithmetic_rows(6)]
    rows[2] = {"messages": [{"role": "user", "content": "an example with nothing to learn"}]}
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    run = train(tmp_path, tiny_model, data, "steps=6", columns="['messages']")
    assert_failed_at(run, 3, "assistant")


# ---------------------------------------------------------------- NaN loss


def poison_tokens(model_dir: Path, destination: Path, token_ids: list[int]) -> Path:
    """A copy of the checkpoint whose input embeddings of `token_ids` are NaN."""
    shutil.copytree(model_dir, destination)
    tensors = load_file(destination / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"].copy()
    embedding[token_ids] = np.nan
    tensors["model.embed_tokens.weight"] = embedding
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def chat_token_ids(model_dir: Path, row: dict[str, str]) -> set[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return set(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_nan_loss_stops_the_run_at_its_step(tmp_path, tiny_model):
    rows = arithmetic_rows(6)
    rows[3] = {"question": "zzz?", "answer": "zzz"}
    clean = set().union(*(chat_token_ids(tiny_model, row) for i, row in enumerate(rows) if i != 3))
    only_in_step_4 = sorted(chat_token_ids(tiny_model, rows[3]) - clean)
    assert only_in_step_4, "test setup: example 4 has no token of its own"
    poisoned = poison_tokens(tiny_model, tmp_path / "poisoned", only_in_step_4)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    run = train(tmp_path, poisoned, data, "steps=6")
    assert_failed_at(run, 4, "nan")


# ---------------------------------------------------------------- checkpoint write fails


def full_disk_launcher(directory: Path) -> tuple[str, ...]:
    """Command prefix that runs the trainer with `directory` on a 4 KiB tmpfs (a full disk), mounted in a
    private mount namespace so nothing outside the trainer process sees it."""
    directory.mkdir(parents=True)
    user_namespace = () if os.geteuid() == 0 else ("--map-root-user",)
    mount = f'mount -t tmpfs -o size=4k lorajob-full-disk "{directory}" && exec "$@"'
    return ("unshare", "--mount", *user_namespace, "sh", "-c", mount, "sh")


def test_failed_checkpoint_write_stops_the_run_at_its_step(tmp_path, tiny_model):
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(8))
    launcher = full_disk_launcher(tmp_path / "out" / RUN_NAME / "checkpoints")
    run = train(tmp_path, tiny_model, data, "steps=4", "checkpoint_period=2", launcher=launcher)
    assert_failed_at(run, 2, "checkpoint", last_trained_step=2)
    assert "no space left" in run.output.lower()


def test_failed_asynchronous_checkpoint_write_names_the_step_it_belonged_to(tmp_path, tiny_model):
    """Training goes on while the step-2 write runs in the background; the error, when it surfaces, is
    still reported against step 2 and the run still fails."""
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(8))
    launcher = full_disk_launcher(tmp_path / "out" / RUN_NAME / "checkpoints")
    run = train(tmp_path, tiny_model, data, "steps=4", "checkpoint_period=2", "async_checkpointing=True",
                launcher=launcher)
    assert_failed_at(run, 2, "checkpoint", last_trained_step=4)
