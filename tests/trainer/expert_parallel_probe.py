"""Run by test_expert_parallel.py in a process of 4 CPU devices: one tiny MoE checkpoint's forward and adapter
gradients on expert-parallel meshes against one device, and the compiled train steps' collectives.

    python expert_parallel_probe.py CHECKPOINT MODEL_NAME [--hlo]

prints one `REPORT {json}` line: per case (mesh, routing, capacity factor) the loss of each side, the largest
difference of the final hidden states and of each adapter's gradient (each relative to the largest magnitude of
the one-device value), and the dispatch counts; with --hlo, per mesh the experts' all-to-alls and the all-gathers whose
result holds every expert of an expert weight.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lorajob_trainer import loss as loss_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import run as run_lib
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.optim import build_optimizer

DISPATCH_ALL_TO_ALL = r" all-to-all(?:-start)?\(.*op_name=\"[^\"]*/all_to_all\""
"""An all-to-all of `jax.lax.all_to_all` (the experts' dispatch), not one the partitioner inserts to reshard."""
LENGTH = 128
"""Positions per row: 1 row per device, 2 experts per token, so 256 (token, expert) rows leave each device."""


def config(checkpoint: Path, model_name: str, *overrides: str) -> TrainConfig:
    return TrainConfig.from_args([
        "run_name=probe", "base_output_directory=/tmp/unused", f"model_name={model_name}",
        f"load_parameters_path={checkpoint}", "hf_train_files=['unused']", "steps=1", f"max_target_length={LENGTH}",
        "per_device_batch_size=1", "lora.lora_rank=4", "lora.lora_alpha=8", "remat_policy=none", *overrides,
    ])


def build(train_config: TrainConfig, devices: list, router: str) -> run_lib.Run:
    """The run on `devices`; `router` "zero": every router weight 0, so that every token picks experts 0 and 1
    (equal logits: top-k takes the lowest ids), all held by device 0 of an expert axis of 2."""
    mesh = mesh_lib.build_mesh(train_config.mesh, devices)
    with jax.set_mesh(mesh):
        model = run_lib.loaded_model(train_config, mesh, jnp.float32)
    run = run_lib.build(train_config.step_shape, build_optimizer(train_config), model, mesh, jnp.float32, "none")
    if router == "zero":
        for path, variable in nnx.to_flat_state(run.base):
            if "router" in map(str, path) and path[-1] == "kernel":
                variable.set_value(jnp.zeros_like(variable.get_value()))
    return run


def batch() -> dict[str, np.ndarray]:
    """One micro-batch of 4 rows (one per device on the mesh), every position trained."""
    ids = np.random.default_rng(0).integers(1, 200, (1, 4, LENGTH)).astype(np.int32)
    return {"inputs": ids, "targets": np.roll(ids, -1, axis=-1), "weights": np.ones(ids.shape, np.float32),
            "segment_ids": np.ones_like(ids), "positions": np.broadcast_to(np.arange(LENGTH), ids.shape).astype(np.int32)}


def adapters(run: run_lib.Run) -> dict[str, jax.Array]:
    """The run's adapters with every B moved off zero (a fixed draw per name), so that every gradient is nonzero."""
    start = run.adapters()
    return {name: value + 0.05 * jax.random.normal(jax.random.key(i), value.shape)
            for i, (name, value) in enumerate(sorted(start.items()))}


def forward_and_grads(run: run_lib.Run) -> dict:
    """Loss, final hidden states, dispatch counts and adapter gradients of the step's objective on `batch()`."""

    def objective(lora, micro):
        model = nnx.merge(run.graphdef, run.layout.state(lora), run.base)
        loss_sum, weight_sum, _, dispatch = loss_lib.losses_with_load_balancing(model, micro, LENGTH)
        hidden = loss_lib.hidden_states(model, micro["inputs"], micro["positions"], micro["segment_ids"])
        return loss_sum / weight_sum, (hidden, dispatch)

    with jax.set_mesh(run.mesh):
        lora = jax.device_put(adapters(run), run.shardings["lora"])
        micro = jax.device_put({k: v[0] for k, v in batch().items()}, mesh_lib.batch_sharding(run.mesh, 0))
        (loss, (hidden, dispatch)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(lora, micro)
    return {"loss": float(loss), "hidden": np.asarray(hidden), "dispatch": np.asarray(dispatch).tolist(),
            "grads": {name: np.asarray(g) for name, g in grads.items()}}


def compare(got: dict, reference: dict) -> dict:
    def relative(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

    return {"loss": [got["loss"], reference["loss"]], "hidden": relative(got["hidden"], reference["hidden"]),
            "grads": {name: relative(got["grads"][name], g) for name, g in reference["grads"].items()},
            "grad_magnitudes": {name: float(np.max(np.abs(g))) for name, g in reference["grads"].items()},
            "dispatch": got["dispatch"]}


def expert_weight_gathers(hlo: str, run: run_lib.Run) -> list[str]:
    """All-gather results of the compiled step holding every expert of an expert weight or adapter: an array
    whose last three sizes are (experts, in, out) of one of them, as held or as `ExpertsLinear.arrays` reorders."""
    wanted = set()
    for path, variable in nnx.to_flat_state(run.base):
        if "experts" in map(str, path):
            *_, held, rows, out = variable.get_value().shape
            experts = held // 2 if "gate_up_proj" in map(str, path) else held
            wanted |= {(held, rows, out), (experts, rows, held // experts * out)}
    for name, value in run.adapters().items():
        if ".experts." in name:
            wanted.add(tuple(value.shape[-3:]))
    found = []
    for line in hlo.splitlines():
        if match := re.search(r"= (.*?) all-gather(?:-start)?\(", line):
            for dims in re.findall(r"\[([\d,]+)\]", match[1]):
                if tuple(int(d) for d in dims.split(",")[-3:]) in wanted:
                    found.append(dims)
    return found


def main(argv: list[str]) -> None:
    checkpoint, model_name, *flags = argv
    devices = jax.devices()
    assert len(devices) == 4, devices
    report: dict = {"cases": {}, "hlo": {}}
    references = {router: forward_and_grads(build(config(Path(checkpoint), model_name), devices[:1], router))
                  for router in ("as trained", "zero")}
    cases = [("expert=2 x fsdp=2", ["mesh.expert=2"], "as trained", 0.0),
             ("expert=4", ["mesh.expert=4"], "as trained", 0.0),
             ("expert=2 x fsdp=2", ["mesh.expert=2"], "zero", 0.0),
             ("expert=2 x fsdp=2", ["mesh.expert=2"], "zero", 1.0)]
    for mesh, overrides, router, factor in cases:
        train_config = config(Path(checkpoint), model_name, *overrides, f"expert_capacity_factor={factor}")
        got = forward_and_grads(build(train_config, devices, router))
        report["cases"][f"{mesh}, router {router}, capacity factor {factor}"] = compare(got, references[router])
    if "--hlo" in flags:
        for mesh, overrides in (("expert=4", ["mesh.expert=4"]), ("expert=2 x fsdp=2", ["mesh.expert=2"]),
                                ("fsdp=4", ["mesh.expert=1"])):
            run = build(config(Path(checkpoint), model_name, *overrides), devices, "as trained")
            with jax.set_mesh(run.mesh):
                hlo = run.steps.train.lower(*run.arguments()).compile().as_text()
            report["hlo"][mesh] = {"dispatch_all_to_all": len(re.findall(DISPATCH_ALL_TO_ALL, hlo)),
                                   "expert_weight_gathers": expert_weight_gathers(hlo, run)}
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
