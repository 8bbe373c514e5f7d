"""Two processes x two virtual CPU devices (jax.distributed on loopback) train like one process x four.

Each process runs the real entry point with the environment the operator's JobSets set
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). The global batch is the same in
both layouts, so the losses must match; and since every process reads only the slices its own
devices hold, a process sets up training with about half the model in memory, not all of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trainer_testkit import arithmetic_rows, base_args, free_port, tiny_checkpoint, trainer_env, write_jsonl

TIMEOUT = 900

# The trainer image has no torch; this venv has it (for the PEFT parity tests), and tensorboardX,
# which tunix's metrics logger imports, loads it whenever it is importable (~0.6 GB RSS, 3 s).
# Hiding it from the import system makes the trainer processes start as they do in the image.
HIDE_TORCH = (
    "import importlib.machinery, runpy, sys\n"
    "class HideTorch(importlib.machinery.PathFinder):\n"
    "    @classmethod\n"
    "    def find_spec(cls, name, path=None, target=None):\n"
    "        return None if name.partition('.')[0] == 'torch' else super().find_spec(name, path, target)\n"
    "sys.meta_path = [HideTorch if f is importlib.machinery.PathFinder else f for f in sys.meta_path]\n"
)
REPORT_PEAK_RSS = (  # one line: the run launcher puts it in a `finally:` block
    "from lorajob_trainer import metrics; print('PEAK_RSS_BYTES', metrics.peak_host_memory_bytes(), file=sys.stderr)\n"
)

# Runs the entry point, then reports this process's peak RSS on the last line of stderr.
LAUNCHER = HIDE_TORCH + (
    "try:\n"
    "    runpy.run_module('lorajob_trainer.train', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    " + REPORT_PEAK_RSS
)

# Sets a training process up as the entry point does (distributed runtime, mesh, base weights,
# LoRA, optimizer state, data) and stops before the first step; then reports its peak RSS.
SETUP_LAUNCHER = HIDE_TORCH + (
    "from lorajob_trainer import distributed, train\n"
    "from lorajob_trainer.config import TrainConfig\n"
    "distributed.initialize()\n"
    "train.build_trainer(TrainConfig.from_args(sys.argv[1:]))\n"
    + REPORT_PEAK_RSS
)


def launch(args: list[str], *, devices: int, process_id: int = 0, num_processes: int = 1, port: int = 0,
           launcher: str = LAUNCHER):
    env = {
        **trainer_env(devices),
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    }
    return subprocess.Popen([sys.executable, "-c", launcher, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(process) -> int:
    """Wait; fail with the output unless the run succeeded; return its peak RSS in bytes."""
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, stderr[-4000:]
    return int(stderr.strip().splitlines()[-1].split()[-1])


def run_single(args: list[str], launcher: str = LAUNCHER) -> int:
    return finish(launch(args, devices=4, launcher=launcher))


def run_two_processes(args: list[str], launcher: str = LAUNCHER) -> list[int]:
    port = free_port()
    processes = [
        launch(args, devices=2, process_id=i, num_processes=2, port=port, launcher=launcher) for i in range(2)
    ]
    return [finish(process) for process in processes]


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


@pytest.mark.slow
def test_two_processes_give_the_single_process_losses(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(100))
    common = ("steps=6", "per_device_batch_size=2", "gradient_accumulation_steps=2", "checkpoint_period=3",
              "enable_tensorboard=False")

    run_single(base_args(model_dir, tmp_path / "single", train_file, *common))
    run_two_processes(base_args(model_dir, tmp_path / "multi", train_file, *common))

    single, multi = losses(tmp_path / "single"), losses(tmp_path / "multi")
    assert len(single) == len(multi) == 6
    # The first step sees identical adapters; later ones differ only by the summation order of the
    # cross-process gradient reduction, which Adam (lr 1e-2) carries forward.
    np.testing.assert_allclose(multi[0], single[0], rtol=1e-6)
    np.testing.assert_allclose(multi, single, rtol=5e-4)
    assert sorted(p.name for p in (tmp_path / "multi" / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]


# A Qwen3 of 3.2 GiB in float32, four safetensors files. The JAX/XLA/tunix runtime alone takes
# ~0.35 GiB of RSS, about a tenth of it, so half the model stands out in a process's peak.
WIDE_QWEN3 = {"hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128}


@pytest.mark.slow
def test_each_process_holds_about_half_the_model(tmp_path):
    """Set up for training, each of two processes peaks well under the model's size; one process holds it all.

    Measured up to the first step: a step then adds XLA's working set, which on CPU devices is host
    memory too (each device all-gathers one layer's weights at a time, FSDP), see
    bench/load_memory.py for whole-run figures.
    """
    model_dir = tmp_path / "wide"
    subprocess.run(
        [sys.executable, "-c",
         f"from lorajob_trainer import tiny; tiny.make_tiny_checkpoint('qwen3', {str(model_dir)!r}, shards=4, "
         f"**{WIDE_QWEN3!r})"],
        env=trainer_env(), check=True,
    )
    model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(40))
    args = base_args(model_dir, tmp_path / "out", train_file, "steps=2", "per_device_batch_size=1",
                     "max_target_length=16", "enable_checkpointing=False", "enable_tensorboard=False",
                     "lora.lora_rank=2")

    single_rss = run_single(args, launcher=SETUP_LAUNCHER)
    process_rss = run_two_processes(args, launcher=SETUP_LAUNCHER)

    print(f"model {model_bytes / 2**30:.2f} GiB; peak RSS single {single_rss / 2**30:.2f} GiB, "
          f"per process {[round(r / 2**30, 2) for r in process_rss]} GiB")
    assert single_rss > model_bytes, (model_bytes, single_rss)
    # While the layers are stacked for the scan (models/decoder.py), one variable is held twice: its layers'
    # arrays and their stack. The largest is an MLP weight of every layer, float32 on CPU, half per process.
    layers, hidden, mlp = WIDE_QWEN3["num_hidden_layers"], WIDE_QWEN3["hidden_size"], WIDE_QWEN3["intermediate_size"]
    largest_stacked_variable = layers * hidden * mlp * 4 / 2
    for rss in process_rss:
        # Half the model, plus the runtime (~0.1) and what LoRA, optimizer, data and the reads'
        # buffers take: 0.75, plus that stacked variable. A process that read whole tensors, kept the files
        # mapped (file pages count in RSS) or stacked all layers at once would exceed it.
        assert rss < 0.75 * model_bytes + largest_stacked_variable, (model_bytes, single_rss, process_rss)
        # Ideal saving against one process holding everything is half the model.
        assert single_rss - rss > 0.4 * model_bytes, (model_bytes, single_rss, process_rss)


# ---------------------------------------------------------------- start-up environment and mesh shape


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, ("single", "", 1, 0), id="nothing-set"),
        pytest.param({"JAX_PLATFORMS": "proxy", "JAX_NUM_PROCESSES": "4"}, ("pathways", "", 1, 0), id="pathways"),
        pytest.param({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "head"},
                     ("multi-controller", "head:8476", 2, 1), id="default-port"),
        pytest.param({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0", "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
                     ("multi-controller", "10.0.0.1:1234", 2, 0), id="explicit-port"),
    ],
)
def test_launch_mode_comes_from_the_environment(env, expected):
    from lorajob_trainer import distributed

    launch = distributed.launch_from_env(env)
    assert (launch.mode, launch.coordinator_address, launch.num_processes, launch.process_id) == expected


@pytest.mark.parametrize(
    ("env", "named"),
    [
        pytest.param({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS", id="no-coordinator"),
        pytest.param({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "h"}, "JAX_PROCESS_ID", id="no-process-id"),
        pytest.param({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES", id="not-a-number"),
        pytest.param({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h"},
                     "JAX_PROCESS_ID", id="id-out-of-range"),
    ],
)
def test_incomplete_distributed_environment_is_named(env, named):
    from lorajob_trainer import distributed

    with pytest.raises(distributed.DistributedConfigError, match=named):
        distributed.launch_from_env(env)


@pytest.mark.parametrize(
    ("axes", "devices", "slices", "expected"),
    [
        pytest.param({}, 8, 1, (1, 8, 1, 1), id="fsdp-fills"),
        pytest.param({"tensor": 2}, 8, 1, (1, 4, 1, 2), id="tensor-within"),
        pytest.param({"expert": 4}, 8, 1, (1, 2, 4, 1), id="expert-within"),
        pytest.param({}, 16, 2, (2, 8, 1, 1), id="data-across-slices"),
        pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, 8, 1, (2, 2, 1, 2), id="explicit"),
    ],
)
def test_mesh_shape(axes, devices, slices, expected):
    from lorajob_trainer.config import MeshConfig
    from lorajob_trainer.mesh import mesh_shape

    assert mesh_shape(MeshConfig(**axes), devices, slices) == expected


def test_mesh_that_does_not_use_every_device_is_rejected():
    from lorajob_trainer.config import MeshConfig
    from lorajob_trainer.mesh import MeshError, mesh_shape

    with pytest.raises(MeshError, match="8 are available"):
        mesh_shape(MeshConfig(fsdp=2, tensor=2), 8, 1)
    with pytest.raises(MeshError, match="does not divide"):
        mesh_shape(MeshConfig(tensor=3), 8, 1)
