"""The plan compiles the step the trainer runs: on four devices with a tensor axis of 2, the abstract run the plan
compiles (`run.abstract_run`) takes a batch of the shape of the trainer's data feed (every device counts towards the global batch, a tensor-parallel
one too: the plan had counted only the data-parallel ones, compiling a batch half the size), and the two compiled
steps need the same memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from lorajob_trainer import loading, plan
    from lorajob_trainer import run as run_lib
    from lorajob_trainer import train as train_lib
    from lorajob_trainer.contract.config import TrainConfig

    config = TrainConfig.from_args(sys.argv[2:])
    hf_config = loading.read_hf_config(loading.local_config_directory(sys.argv[1]))
    trainer = train_lib.build_trainer(config)
    batch = trainer.train_feed.next_batch(1)
    with jax.set_mesh(trainer.mesh):
        ran = trainer.run.steps.train.lower(trainer.lora, trainer.opt_state, trainer.run.base, batch).compile()
    planned = plan.compile_train_step(config, hf_config, jax.devices())
    abstract = run_lib.abstract_run(config, hf_config, jax.devices())

    def memory(analysis):
        return [analysis.argument_size_in_bytes, analysis.output_size_in_bytes, analysis.temp_size_in_bytes]

    json.dump({
        "mesh": dict(trainer.mesh.shape),
        "trainer_batch": {name: list(value.shape) for name, value in batch.items()},
        "plan_batch": {name: list(value.shape) for name, value in abstract.batch.items()},
        "trainer_memory": memory(ran.memory_analysis()),
        "plan_memory": memory(planned.executable.memory_analysis()),
    }, sys.stdout)
    """
)


def test_the_plan_compiles_the_trainers_step_with_a_tensor_axis(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(64))
    args = base_args(model_dir, tmp_path / "out", train_file, "steps=1", "mesh.tensor=2", "per_device_batch_size=2",
                     "remat_policy=full")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), *args], env=trainer_env(devices=4),
                            capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["mesh"]["tp"] == 2 and seen["mesh"]["fsdp"] == 2
    assert seen["trainer_batch"]["inputs"] == [1, 2 * 4, 64]  # 2 rows per device, all 4 devices
    assert seen["plan_batch"] == seen["trainer_batch"]
    assert seen["plan_memory"] == seen["trainer_memory"]
