"""compilation_cache_dir (a LoRAJob's output.compilationCache): the trainer keeps its compiled train step there, and
a later run of the same model and shapes loads it instead of compiling (JAX's own log says which)."""

from __future__ import annotations

import subprocess
import sys

from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

HIT = "Persistent compilation cache hit for 'jit_train_step'"


def test_a_second_run_loads_the_train_step_the_first_compiled(tmp_path):
    model = tiny_checkpoint(tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(16))
    cache = tmp_path / "cache"
    env = {key: value for key, value in trainer_env().items() if key != "JAX_COMPILATION_CACHE_DIR"}
    # JAX logs each persistent-cache hit and miss; entries are kept whatever their compile time (tiny ones here).
    env |= {"JAX_LOG_COMPILES": "1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    def train(run: str) -> str:
        args = base_args(model, tmp_path / "out", data, f"run_name={run}", "steps=1", "enable_tensorboard=False",
                         f"compilation_cache_dir={cache}")
        done = subprocess.run([sys.executable, "-m", "lorajob_trainer.train", *args], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    first = train("first")
    assert HIT not in first
    assert list(cache.glob("jit_train_step-*")), sorted(path.name for path in cache.iterdir())
    assert HIT in train("second")
