"""Two processes x two virtual CPU devices (jax.distributed on loopback) train like one process x four.

Each process runs the real entry point with the environment the operator's JobSets set
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). The global batch is the same in
both layouts, so the losses must match. That each process sets up training with about half the model
in memory (it reads only the slices its own devices hold) is measured by bench/load_memory.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from trainer_testkit import (arithmetic_rows, base_args, free_port, preference_rows, tiny_checkpoint, trainer_env,
                             write_jsonl)

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
# Runs the entry point as the trainer image does (torch hidden).
LAUNCHER = HIDE_TORCH + "runpy.run_module('lorajob_trainer.train', run_name='__main__', alter_sys=True)\n"


def launch(args: list[str], *, devices: int, process_id: int = 0, num_processes: int = 1, port: int = 0):
    env = {
        **trainer_env(devices),
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
    }
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(process) -> None:
    """Wait; fail with the output unless the run succeeded."""
    _, stderr = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0, stderr[-4000:]


def run_single(args: list[str]) -> None:
    finish(launch(args, devices=4))


def run_two_processes(args: list[str]) -> None:
    port = free_port()
    for process in [launch(args, devices=2, process_id=i, num_processes=2, port=port) for i in range(2)]:
        finish(process)


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    return [record["loss"] for record in records if "loss" in record]


METHODS = {
    "sft": (arithmetic_rows, ()),
    "dpo": (preference_rows, ("method=dpo", "train_data_columns=['prompt','chosen','rejected']")),
}
"""A method's rows and arguments. A DPO pair's two rows are read by the process whose device holds them."""


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_two_processes_give_the_single_process_losses(tmp_path, method):
    rows, arguments = METHODS[method]
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", rows(100))
    common = ("steps=6", "per_device_batch_size=2", "gradient_accumulation_steps=2", "checkpoint_period=3",
              "enable_tensorboard=False", *arguments)

    run_single(base_args(model_dir, tmp_path / "single", train_file, *common))
    run_two_processes(base_args(model_dir, tmp_path / "multi", train_file, *common))

    single, multi = losses(tmp_path / "single"), losses(tmp_path / "multi")
    assert len(single) == len(multi) == 6
    # The first step sees identical adapters; later ones differ only by the summation order of the
    # cross-process gradient reduction, which Adam (lr 1e-2) carries forward.
    np.testing.assert_allclose(multi[0], single[0], rtol=1e-6)
    np.testing.assert_allclose(multi, single, rtol=5e-4)
    assert sorted(p.name for p in (tmp_path / "multi" / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["3", "6"]


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
    from lorajob_trainer.contract.config import MeshConfig
    from lorajob_trainer.mesh import mesh_shape

    assert mesh_shape(MeshConfig(**axes), devices, slices) == expected


def test_mesh_that_does_not_use_every_device_is_rejected():
    from lorajob_trainer.contract.config import MeshConfig
    from lorajob_trainer.mesh import MeshError, mesh_shape

    with pytest.raises(MeshError, match="8 are available"):
        mesh_shape(MeshConfig(fsdp=2, tensor=2), 8, 1)
    with pytest.raises(MeshError, match="does not divide"):
        mesh_shape(MeshConfig(tensor=3), 8, 1)
