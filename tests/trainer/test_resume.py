"""A run killed with SIGKILL and started again ends with the same adapters as an uninterrupted run.

The killed run is the real entry point in a subprocess (asynchronous checkpoints, shuffled and
packed data, gradient accumulation); it is killed as soon as its first checkpoint is complete, so
it dies mid-run, possibly mid-write. The resumed run must pick the latest complete checkpoint
(ignoring a half-written one) and restore adapters, optimizer state and data position: replaying
or skipping data, or losing optimizer state, would change the final weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer import train as train_lib
from lorajob_trainer.config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
PERIOD = 5


def config_args(model_dir: Path, output_dir: Path, train_file: Path) -> list[str]:
    return base_args(
        model_dir, output_dir, train_file, f"steps={STEPS}", f"checkpoint_period={PERIOD}",
        "gradient_accumulation_steps=2", "per_device_batch_size=2", "max_num_checkpoints_to_keep=2",
        "enable_tensorboard=False",
    )


def complete_steps(checkpoint_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in checkpoint_dir.glob("*") if p.name.isdigit())


def run_to_completion(args: list[str]):
    trainer = train_lib.build_trainer(TrainConfig.from_args(args))
    try:
        result = trainer.run()
    finally:
        trainer.close()
    return trainer, result


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(150))

    reference, _ = run_to_completion(config_args(model_dir, tmp_path / "reference", train_file))

    interrupted_args = config_args(model_dir, tmp_path / "interrupted", train_file)
    checkpoint_dir = tmp_path / "interrupted" / "run" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "trainer"), "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "lorajob_trainer.train", *interrupted_args],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 600
    while not complete_steps(checkpoint_dir) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, f"run ended by itself:\n{process.stderr.read()[-3000:]}"
    killed_at = complete_steps(checkpoint_dir)
    assert killed_at and killed_at[-1] < STEPS, f"killed too late to test resume: {killed_at}"
    # A write that never completed (as a kill during an async save leaves it) must be ignored.
    (checkpoint_dir / f"{STEPS - PERIOD}.orbax-checkpoint-tmp-1").mkdir()

    resumed, result = run_to_completion(interrupted_args)
    assert result.resumed_from == killed_at[-1]
    assert result.final_step == STEPS
    differences = {
        name: float(np.max(np.abs(np.asarray(resumed.lora[name]) - np.asarray(value))))
        for name, value in reference.lora.items()
    }
    assert max(differences.values()) <= 1e-6, differences
