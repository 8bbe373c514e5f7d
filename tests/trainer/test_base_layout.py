"""The base weights stored layers-second (step.BaseLayout), as the step takes them on tpu7x, change how the step's
base argument is held and nothing it computes.

Forced on CPU over two devices (fsdp 2): each stacked weight of a matrix or more per layer holds its layers on axis
1, its sharding's spec permuted alike (the fsdp split stays on the same dimension of the weight), a stacked vector
per layer stays as it was, a stacked routed experts' weight is held packed (experts.packed_rows); two train steps
(the second with trained adapters), the eval step and greedy generation give exactly what the plain layout gives.
On TPU topologies compiled without a TPU: tpu7x's devices take the layers-second layout, v6e's and v5p's the plain
one, and (large) on tpu7x it needs fewer temporaries than the plain layout for Qwen3 30B-A3B: most stacked weights
are converted to the tpu7x matrix unit's tiling once for both layer loops, not once per loop
(docs/train-step-memory.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from flax import nnx
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

from lorajob_trainer import plan
from lorajob_trainer import run as run_lib
from lorajob_trainer.contract import catalog
from lorajob_trainer.contract.config import TrainConfig

pytestmark = pytest.mark.slow(minutes=1)

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from lorajob_trainer import mesh as mesh_lib, run as run_lib, train
    from lorajob_trainer.contract.config import TrainConfig
    from lorajob_trainer.models import experts
    from lorajob_trainer.optim import build_optimizer

    config = TrainConfig.from_args(sys.argv[1:])
    train.configure_compilation_cache(config)  # as the trainer: no persistent cache on several CPU devices
    mesh = mesh_lib.build_mesh(config.mesh)
    dtype = run_lib.compute_dtype(config)
    rng = np.random.default_rng(0)

    def run_of(layers_second):
        with jax.set_mesh(mesh):
            model = run_lib.loaded_model(config, mesh, dtype)
        return run_lib.build(config.step_shape, build_optimizer(config), model, mesh, dtype, "full",
                             base_layers_second=layers_second)

    def batch_for(run):
        vocab = run.model.hf_config["vocab_size"]
        shape = run.batch["inputs"].shape
        host = {"inputs": rng.integers(0, vocab, shape), "targets": rng.integers(0, vocab, shape),
                "weights": (rng.random(shape) < 0.7).astype(np.float32), "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(shape[-1]), shape)}
        return {name: jax.device_put(np.asarray(host[name], spec.dtype), spec.sharding)
                for name, spec in run.batch.items()}

    def described(run):
        held = {}
        for path, variable in nnx.to_flat_state(run.base):
            value = variable.get_value()
            spec = getattr(value.sharding, "spec", ())
            held["/".join(map(str, path))] = {"shape": list(value.shape), "spec": [repr(axis) for axis in spec]}
        return held

    def unpacked(value):
        return experts.unpacked_rows(value, (), None) if value.dtype == experts.PACKED_DTYPE else value

    plain, second = run_of(False), run_of(True)
    restored = jax.tree.map(unpacked, jax.jit(second.base_layout.for_model)(second.base))
    pairs = zip(jax.tree.leaves(restored), jax.tree.leaves(plain.base), strict=True)
    batches = [batch_for(plain) for _ in range(2)]
    seen = {"layers_second": [plain.base_layout.layers_second, second.base_layout.layers_second],
            "plain_base": described(plain), "second_base": described(second), "steps": [], "differences": {},
            "round_trip_exact": jax.tree.structure(restored) == jax.tree.structure(plain.base)
                                and all(np.array_equal(a, b) for a, b in pairs)}
    with jax.set_mesh(mesh):
        results = []
        for run in (plain, second):
            adapters = run.adapters()
            opt_state = run.optimizer_state(adapters)
            metrics = []
            for batch in batches:
                adapters, opt_state, step_metrics = run.steps.train(adapters, opt_state, run.base, batch)
                metrics.append({name: float(value) for name, value in step_metrics.items()})
            sums = {name: float(value) for name, value in run.steps.evaluate(adapters, run.base, batches[0]).items()}
            generator = run.generator(4, [])
            prompts = [[5, 9, 13, 2, 7], [11, 3]]
            generated = [g.tokens for g in generator.generate(adapters, run.base, prompts, generator.batch_rows(2))]
            results.append({"metrics": metrics, "eval": sums, "generated": generated,
                            "adapters": {name: np.asarray(value) for name, value in adapters.items()}})
    for result in results:
        seen["steps"].append({key: result[key] for key in ("metrics", "eval", "generated")})
    seen["differences"] = {name: float(np.max(np.abs(value - results[1]["adapters"][name])))
                           for name, value in results[0]["adapters"].items()}
    json.dump(seen, sys.stdout)
    """
)


@pytest.mark.parametrize(("family", "dtype", "packed_weights"), [("qwen3", "auto", 0), ("qwen3-moe", "bfloat16", 2)])
def test_layers_second_base_computes_what_the_plain_base_does(tmp_path, family, dtype, packed_weights):
    """A routed experts' weight is held packed only in bf16, as on TPU (dtype auto is float32 on CPU)."""
    model_dir = tiny_checkpoint(tmp_path / "model", family, num_hidden_layers=3)
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(8))
    args = base_args(model_dir, tmp_path / "out", train_file, f"model_name=tiny-{family}", f"dtype={dtype}", "steps=2",
                     "per_device_batch_size=1", "max_target_length=32", "gradient_accumulation_steps=2")
    result = subprocess.run([sys.executable, "-c", SCRIPT, *args], env=trainer_env(devices=2), capture_output=True, text=True,
                            timeout=600, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout)
    assert seen["layers_second"] == [False, True]
    plain, second = seen["plain_base"], seen["second_base"]
    assert plain.keys() == second.keys()
    moved = packed = 0
    for path, held in plain.items():
        stored = second[path]
        if path.startswith("layers/blocks/") and "/experts/" in path:  # routed experts' stacks: held packed
            packed += 1
            shape = held["shape"]
            assert stored == {"shape": [*shape[:-2], shape[-2] // 2, shape[-1]], "spec": held["spec"]}, path
        elif path.startswith("layers/blocks/") and len(held["shape"]) >= 3:
            moved += 1
            shape, spec = held["shape"], held["spec"] + ["None"] * (len(held["shape"]) - len(held["spec"]))
            assert stored["shape"] == [shape[1], shape[0], *shape[2:]], path
            assert stored["spec"] == [spec[1], spec[0], *spec[2:]], path
        else:
            assert stored == held, path
    assert moved + packed >= 7, "every stacked projection of the scanned layers (q, k, v, o and the MLP's)"
    assert packed == packed_weights, "the routed experts' gate_up_proj and down_proj"
    assert any("fsdp" in axis for held in second.values() for axis in held["spec"]), "the weights are split"
    assert seen["round_trip_exact"], "the step's base, moved back first and unpacked, is the model's, bit for bit"
    # Exactly equal: moving axes copies values, and on CPU the moved-back weights feed the same matmuls.
    plain_steps, second_steps = seen["steps"]
    assert second_steps == plain_steps
    assert len(plain_steps["metrics"]) == 2 and plain_steps["metrics"][1]["grad_norm"] > 0
    assert set(seen["differences"].values()) == {0.0}, seen["differences"]


def _abstract_run(topology: str, layers: int = 2, layers_second: bool | None = None,
                  model: str = "llama3.1-8b") -> run_lib.Run:
    config = TrainConfig.from_dict({
        "run_name": "plan", "base_output_directory": "/tmp/plan", "model_name": model,
        "load_parameters_path": "unused", "hf_train_files": ["unused"], "steps": 1, "max_target_length": 1024,
        "per_device_batch_size": 1, "remat_policy": "full", "lora": {"lora_rank": 16, "lora_alpha": 32},
    })
    hf = catalog.at_depth(catalog.released_config(model), layers)
    return run_lib.abstract_run(config, hf, plan.topology_devices(topology), base_layers_second=layers_second)


@pytest.mark.parametrize(("topology", "layers_second"),
                         [("tpu7x:2x2x1", True), ("v6e:2x4", False), ("v5p:2x2x1", False)])
def test_only_tpu7x_takes_its_stacked_base_layers_second(topology, layers_second):
    run = _abstract_run(topology)
    assert run.base_layout.layers_second == layers_second
    weights = {tuple(map(str, path)): variable.get_value() for path, variable in nnx.to_flat_state(run.base)}
    kernel = next(value for path, value in weights.items() if path[:2] == ("layers", "blocks") and "q_proj" in path)
    layers_axis = 1 if layers_second else 0
    assert kernel.shape[layers_axis] == 2 and kernel.shape[1 - layers_axis] == 4096, kernel.shape


@pytest.mark.large
def test_layers_second_base_needs_fewer_temporaries_on_tpu7x():
    """Qwen3 30B-A3B, all 48 layers, 1,024 tokens per device on tpu7x-8, mesh.expert auto (8) (2026-12-07, with the
    vocab-parallel loss: 12.24 GB of temporaries per device with the plain layout, 9.68 layers-second; at 12 layers
    3.25 and 3.48; five minutes on two idle cores, twelve on loaded ones). Llama 3.1 8B at 32 layers, which this test
    compiled before that loss (4.59 GB plain, 4.23 layers-second), now needs 3.05 GB plain and 3.10 layers-second:
    the layout no longer lowers its peak (docs/train-step-memory.md)."""
    temporaries = {}
    for layers_second in (False, True):
        run = _abstract_run("tpu7x:2x2x1", layers=48, layers_second=layers_second, model="qwen3-30b-a3b")
        with jax.set_mesh(run.mesh):
            compiled = run.steps.train.lower(*run.arguments()).compile()
        temporaries[layers_second] = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries[True] < temporaries[False] - 0.25e9, temporaries
