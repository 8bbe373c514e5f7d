"""A run stopped by SIGTERM or killed with SIGKILL and started again ends with the same adapters as an
uninterrupted run.

The stopped run is the real entry point in a subprocess (asynchronous checkpoints, shuffled and
packed data, gradient accumulation). The resumed run must pick the latest complete checkpoint
(never a half-written one) and restore adapters, optimizer state and data position: replaying or
skipping data, or losing optimizer state, would change the final weights.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from trainer_testkit import arithmetic_rows, base_args, free_port, tiny_checkpoint, trainer_env, write_jsonl

from lorajob_trainer.contract import exit_codes
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import TrainConfig

pytestmark = pytest.mark.slow(minutes=3)

STEPS = 40
PERIOD = 5
TIMEOUT_S = 600


def config_args(model_dir: Path, output_dir: Path, train_file: Path) -> list[str]:
    return base_args(
        model_dir, output_dir, train_file, f"steps={STEPS}", f"checkpoint_period={PERIOD}",
        "gradient_accumulation_steps=2", "per_device_batch_size=2", "max_num_checkpoints_to_keep=2",
        "enable_tensorboard=False",
    )


def complete_steps(checkpoint_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoint_dir.glob("*") if p.name.isdigit())


def unfinished_writes(checkpoint_dir: Path) -> list[Path]:
    return list(checkpoint_dir.glob("*.orbax-checkpoint-tmp*"))


def run_to_completion(args: list[str]):
    trainer = train_lib.build_trainer(TrainConfig.from_args(args))
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return trainer, result


class Interrupted:
    """The trainer in a subprocess, writing under `<output>/run`."""

    def __init__(self, tmp_path: Path, inputs):
        self.args = config_args(inputs.model_dir, tmp_path / "interrupted", inputs.train_file)
        self.run_directory = tmp_path / "interrupted" / "run"
        self.checkpoints = self.run_directory / "checkpoints"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lorajob_trainer.train", *self.args],
            env=trainer_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.deadline = time.monotonic() + TIMEOUT_S

    def poll_until(self, condition) -> None:
        """Poll (the condition is a file appearing, which has no notification) until it holds while the run goes on."""
        while not condition():
            assert self.process.poll() is None, f"run ended by itself:\n{self.process.stderr.read()[-3000:]}"
            assert time.monotonic() < self.deadline, "timed out"
            time.sleep(0.001)

    def finish(self) -> tuple[int, str]:
        _, stderr = self.process.communicate(timeout=TIMEOUT_S)
        return self.process.returncode, stderr


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The model, data and final adapters of an uninterrupted run (in-process)."""
    root = tmp_path_factory.mktemp("resume")
    model_dir = tiny_checkpoint(root / "model")
    train_file = write_jsonl(root / "train.jsonl", arithmetic_rows(150))
    reference, _ = run_to_completion(config_args(model_dir, root / "reference", train_file))
    return SimpleNamespace(model_dir=model_dir, train_file=train_file,
                           reference={name: np.asarray(value) for name, value in reference.lora.items()})


def assert_resumes_to_the_reference(args: list[str], inputs, from_step: int | None) -> None:
    resumed, result = run_to_completion(args)
    assert result.resumed_from == from_step
    assert result.final_step == STEPS
    differences = {
        name: float(np.max(np.abs(np.asarray(resumed.lora[name]) - value))) for name, value in inputs.reference.items()
    }
    assert max(differences.values()) <= 1e-6, differences


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_resume_matches_uninterrupted_run(tmp_path, inputs):
    run = Interrupted(tmp_path, inputs)
    run.poll_until(lambda: complete_steps(run.checkpoints))
    run.process.send_signal(signal.SIGTERM)
    returncode, stderr = run.finish()

    assert returncode == exit_codes.PREEMPTED, stderr[-3000:]
    progress = json.loads((run.run_directory / "progress.json").read_text())
    stopped_at = progress["step"]
    assert progress["state"] == "preempted", progress
    assert PERIOD <= stopped_at < STEPS
    assert f"stopped by SIGTERM after step {stopped_at}; checkpoint saved at step {stopped_at}" in stderr
    assert complete_steps(run.checkpoints)[-1] == stopped_at
    assert not unfinished_writes(run.checkpoints), "the checkpoint was not complete when the trainer exited"
    assert_resumes_to_the_reference(run.args, inputs, from_step=stopped_at)


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_resumes_from_the_latest_complete_one(tmp_path, inputs):
    run = Interrupted(tmp_path, inputs)
    while True:
        # A write under way after one has completed: freeze the trainer there, and kill it if the write
        # is still unfinished (it may have completed between the look and the stop: then try the next).
        run.poll_until(lambda: complete_steps(run.checkpoints) and unfinished_writes(run.checkpoints))
        run.process.send_signal(signal.SIGSTOP)
        if unfinished_writes(run.checkpoints):
            break
        run.process.send_signal(signal.SIGCONT)
    run.process.send_signal(signal.SIGKILL)
    returncode, _ = run.finish()

    assert returncode == -signal.SIGKILL
    half_written = unfinished_writes(run.checkpoints)
    latest = complete_steps(run.checkpoints)[-1]
    assert half_written and all(int(p.name.split(".")[0]) > latest for p in half_written), (half_written, latest)
    assert_resumes_to_the_reference(run.args, inputs, from_step=latest)


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step_with_one_checkpoint(tmp_path, inputs):
    """Kubernetes signals each pod on its own; JAX's preemption sync makes every process stop at one step,
    so the checkpoint saved there is written by all of them."""
    args = base_args(inputs.model_dir, tmp_path / "out", inputs.train_file, "steps=1000", f"checkpoint_period={PERIOD}",
                     "per_device_batch_size=2", "enable_tensorboard=False")
    checkpoints = tmp_path / "out" / "run" / "checkpoints"
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "lorajob_trainer.train", *args],
            env={**trainer_env(devices=2), "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(index),
                 "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for index in range(2)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    while not complete_steps(checkpoints):
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outcomes = []
    for process in processes:
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        outcomes.append((process.returncode, stderr))

    assert [code for code, _ in outcomes] == [exit_codes.PREEMPTED] * 2, [err[-2000:] for _, err in outcomes]
    stopped_at = complete_steps(checkpoints)[-1]
    assert PERIOD < stopped_at < 1000
    for _, stderr in outcomes:
        assert f"stopped by SIGTERM after step {stopped_at}; checkpoint saved at step {stopped_at}" in stderr
    assert not unfinished_writes(checkpoints)
