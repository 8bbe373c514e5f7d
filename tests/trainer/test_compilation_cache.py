"""compilation_cache_dir (a LoRAJob's output.compilationCache): the trainer keeps its compiled train step there, and
a later run of the same model and shapes loads it instead of compiling (JAX's own log says which)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

HIT = "Persistent compilation cache hit for 'jit_train_step'"


def train_with_cache(tmp_path: Path, run: str, devices: int = 1) -> str:
    """One training step with compilation_cache_dir=tmp_path/cache; the trainer's log."""
    model = tiny_checkpoint(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(16))
    env = {key: value for key, value in trainer_env(devices).items() if key != "JAX_COMPILATION_CACHE_DIR"}
    # JAX logs each persistent-cache hit and miss; entries are kept whatever their compile time (tiny ones here).
    env |= {"JAX_LOG_COMPILES": "1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    args = base_args(model, tmp_path / "out", data, f"run_name={run}", "steps=1", "enable_tensorboard=False",
                     f"compilation_cache_dir={tmp_path / 'cache'}")
    done = subprocess.run([sys.executable, "-m", "lorajob_trainer.train", *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_a_second_run_loads_the_train_step_the_first_compiled(tmp_path):
    assert HIT not in train_with_cache(tmp_path, "first")
    assert list((tmp_path / "cache").glob("jit_train_step-*")), sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert HIT in train_with_cache(tmp_path, "second")


def test_several_cpu_devices_compile_instead_of_loading_steps_whose_collectives_lost_their_order(tmp_path):
    log = train_with_cache(tmp_path, "two-devices", devices=2)
    assert "persistent compilation cache off" in log
    assert not list((tmp_path / "cache").glob("jit_*"))
