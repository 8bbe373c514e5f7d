"""LoRA training throughput: our JAX trainer step vs HF transformers + PEFT (PyTorch), same shape and device.

    python bench/trainer_bench.py --shape tiny [--steps 10] [--batch 8] [--seq 128] [--rank 16] [--loss-chunk N] [--remat minimal]
                                  [--peak-tflops 989] [--frameworks jax,torch]

Shapes are model configurations with random weights made on the device (no files, no network).
Qwen3: `tiny` (the test model), `small` (~40M), `real-vocab` (`small` with Qwen3's 151,936-entry
vocabulary), `0.6b` (Qwen3-0.6B) and `8b` (Qwen3-8B). Mixture of experts: `tiny-moe` (the tiny
Qwen3 MoE test model: 4 experts, top-2), `tiny-gemma4` (Gemma 4 26B-A4B's layout at tiny sizes: a
dense MLP beside 4 routed experts, top-2), `30b-a3b` (Qwen3-30B-A3B: 128 experts, top-8) and
`26b-a4b` (Gemma 4 26B-A4B: 128 experts, top-8). Each framework runs in a child process of its own
(clean peak-memory figures): a few warm-up steps (compilation), then `--steps` timed optimizer steps
on a fixed random batch, LoRA on the family's default targets (all seven projections of Qwen3;
attention and one adapter per routed expert of Qwen3 MoE; attention, dense MLP and experts of
Gemma 4; PEFT gets the experts as `target_parameters`), AdamW with clipping, bf16 on accelerators
and float32 on CPU. Prints tokens/s (of real tokens), step time, MFU (LoRA model FLOPs: 4N +
attention + adapters with N the parameters a token uses, routed experts at top-k / experts; see
lorajob_trainer.metrics), peak memory, and the JAX/PyTorch throughput ratio. The load-balancing loss
is trained as each checkpoint config says (off for these, as in the Hub's configs; both frameworks
alike). On CPU, MFU needs `--peak-tflops`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lorajob_trainer.contract.config import default_loss_chunk
from lorajob_trainer.contract.records import REMAT_POLICIES
from lorajob_trainer.metrics import peak_host_memory_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 2

QWEN3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
         "rope_theta": 1_000_000.0, "attention_bias": False, "max_position_embeddings": 40960,
         "torch_dtype": "bfloat16"}
SHAPES = {
    "tiny": None,  # lorajob_trainer.tiny's qwen3 config
    "small": {**QWEN3, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True},
    "real-vocab": {**QWEN3, "vocab_size": 151936, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64, "tie_word_embeddings": True},
    "0.6b": {**QWEN3, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "8b": {**QWEN3, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "tiny-moe": None,  # lorajob_trainer.tiny's qwen3-moe config
    "30b-a3b": {**QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False},
}
GEMMA4_26B = {
    # Gemma 4 26B-A4B's text model (Tunix's ModelConfig.gemma4_26b_a4b); transformers fills in the rest.
    "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112, "num_hidden_layers": 30,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
    "num_global_key_value_heads": 2, "attention_k_eq_v": True, "sliding_window": 1024,
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 128,
    "top_k_experts": 8, "moe_intermediate_size": 704,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}
GEMMA4_SHAPES = {
    "26b-a4b": GEMMA4_26B,
    "tiny-gemma4": {**GEMMA4_26B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "global_head_dim": 32, "num_global_key_value_heads": 1, "sliding_window": 16, "num_experts": 4,
                    "top_k_experts": 2, "moe_intermediate_size": 32,
                    "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
}
SHAPES.update(dict.fromkeys(GEMMA4_SHAPES))


def hf_config(shape: str) -> dict:
    """The shape's config.json as a dict (Gemma 4's completed by transformers' Gemma4TextConfig)."""
    if shape in GEMMA4_SHAPES:
        import transformers

        return transformers.Gemma4TextConfig(**GEMMA4_SHAPES[shape]).to_dict()
    if SHAPES[shape] is not None:
        return dict(SHAPES[shape])
    from lorajob_trainer import tiny

    return tiny.tiny_config("qwen3-moe" if shape == "tiny-moe" else "qwen3")


# ---------------------------------------------------------------- JAX (this project's step)


def bench_dtype():
    """bfloat16 on accelerators, float32 on CPU (as the trainer's dtype=auto)."""
    import jax
    import jax.numpy as jnp

    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


HOST_DRAWN_ELEMENTS = 1 << 24
"""Weights this small are drawn on the host and copied over (no compile at all); larger ones by the jit."""


def random_like(abstract, seed: int):
    """Arrays of the tree of ShapeDtypeStructs `abstract`, placed as they say. Each weight with its own compiled
    draw is slow where there are many: a 0.6B model's 392 unscanned LoRA factors took 2.5 minutes on a v5e host with
    one threefry kernel each (48 s to compile here; one jit returning 392 slices of grouped draws still 11 s), and
    one jit for all the large ones holds all their float32 draws at once (22 GB for an 8B base). So the small
    weights come from numpy on the host, and each large one (the scanned base layers: a dozen) from a jit of its
    own drawing in its own dtype from XLA's bit generator (`rbg`, quick to compile). Floats 0.02 x normal, integers
    (quantised weights) uniform over 0-6."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    leaves, treedef = jax.tree.flatten(abstract)
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed, impl="rbg"), len(leaves))

    def draw(key, shape, dtype):
        if jnp.issubdtype(dtype, jnp.floating):
            return (jax.random.normal(key, shape, dtype) * 0.02).astype(dtype)
        return (jax.random.bits(key, shape, jnp.uint8) % 7).astype(dtype)

    values = []
    for key, leaf in zip(keys, leaves, strict=True):
        if leaf.size <= HOST_DRAWN_ELEMENTS:
            host = (0.02 * rng.standard_normal(leaf.shape, np.float32) if jnp.issubdtype(leaf.dtype, jnp.floating)
                    else rng.integers(0, 7, leaf.shape))
            values.append(jax.device_put(jnp.asarray(host, leaf.dtype), leaf.sharding))
        else:
            values.append(jax.jit(draw, static_argnums=(1, 2), out_shardings=leaf.sharding)(key, leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, values)


def random_lora_model(hf: dict, rank: int, dtype, mesh):
    """(The model of config `hf` with random weights made in place on the mesh and LoRA on its family's
    default targets, its Tunix config)."""
    import jax
    from flax import nnx

    from lorajob_trainer import lora as lora_lib
    from lorajob_trainer import models
    from lorajob_trainer.mesh import variable_sharding

    family = models.family_for_hf_config(hf)
    tunix_config = family.config_from_hf(hf, dtype)
    graphdef, state = nnx.split(models.abstract_model(family, tunix_config, hf))
    variables = [variable for _, variable in nnx.to_flat_state(state)]
    abstract = [jax.ShapeDtypeStruct(tuple(variable.get_value().shape), dtype, sharding=variable_sharding(mesh, variable))
                for variable in variables]
    for variable, value in zip(variables, random_like(abstract, 0), strict=True):
        variable.set_value(value)
    model = lora_lib.apply_lora(nnx.merge(graphdef, state), rank=rank, alpha=2.0 * rank,
                                target_regex=lora_lib.module_path_regex(family.name), mesh=mesh, rngs=nnx.Rngs(0))
    return model, tunix_config


def bench_jax(args) -> dict:
    import jax
    import jax.numpy as jnp

    from lorajob_trainer import mesh as mesh_lib
    from lorajob_trainer import metrics
    from lorajob_trainer import models
    from lorajob_trainer import run as run_lib
    from lorajob_trainer.contract.config import MeshConfig, TrainConfig
    from lorajob_trainer.optim import build_optimizer

    hf = hf_config(args.shape)
    dtype = bench_dtype()
    mesh = mesh_lib.build_mesh(MeshConfig())
    model, tunix_config = random_lora_model(hf, args.rank, dtype, mesh)

    config = TrainConfig.from_dict({
        "run_name": "bench", "base_output_directory": "/tmp/bench", "model_name": "tiny-qwen3",
        "load_parameters_path": "random", "hf_train_files": ["random"], "steps": 1000, "learning_rate": 1e-4,
        "warmup_steps_fraction": 0.0, "max_target_length": args.seq, "loss_chunk_length": args.loss_chunk or default_loss_chunk(args.batch),
    })
    family = models.family_for_hf_config(hf)
    lora_model = run_lib.lora_model_of(model, family, tunix_config, hf, None, abstract=False)
    run = run_lib.build(config.step_shape, build_optimizer(config), lora_model, mesh, dtype, args.remat)
    steps, base, flops = run.steps, run.base, run.flops
    adapters = run.adapters()
    opt_state = run.optimizer_state(adapters)
    rows = args.batch
    tokens = jax.random.randint(jax.random.key(1), (1, rows, args.seq + 1), 0, hf["vocab_size"], jnp.int32)
    batch = {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "weights": jnp.ones((1, rows, args.seq), jnp.float32),
        "segment_ids": jnp.ones((1, rows, args.seq), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), (1, rows, args.seq)),
    }
    batch = jax.device_put(batch, mesh_lib.batch_sharding(mesh, leading_dims=1))
    with jax.set_mesh(mesh):
        compile_start = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            adapters, opt_state, out = steps.train(adapters, opt_state, base, batch)
            float(out["loss"])
        compile_s = time.perf_counter() - compile_start
        start = time.perf_counter()
        for _ in range(args.steps):
            adapters, opt_state, out = steps.train(adapters, opt_state, base, batch)
        loss = float(out["loss"])
        elapsed = time.perf_counter() - start
    tokens_per_s = rows * args.seq * args.steps / elapsed
    peak = metrics.peak_flops_per_device(jax.devices()[0].device_kind, args.peak_tflops)
    device_peak = metrics.peak_device_memory_bytes(jax.local_devices())
    return {
        "framework": "jax", "device": jax.devices()[0].device_kind, "dtype": str(jnp.dtype(dtype)),
        "params": sum(x.size for x in jax.tree.leaves(base)), "adapter_params": flops.adapter_params,
        "warmup_s": compile_s, "step_s": elapsed / args.steps, "tokens_per_s": tokens_per_s,
        "mfu": metrics.mfu(tokens_per_s, flops, jax.device_count(), peak), "final_loss": loss,
        "gflops_per_token": flops.per_token / 1e9, "peak_flops": peak * jax.device_count() if peak else None,
        "peak_memory_bytes": device_peak if device_peak is not None else peak_host_memory_bytes(),
    }


# ---------------------------------------------------------------- PyTorch: HF transformers + PEFT


def bench_torch(args) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lorajob_trainer import lora, models

    hf = hf_config(args.shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config)
    family = models.family_for_hf_config(hf).name
    modules, parameters = lora.peft_target_lists(family, lora.default_targets(family))
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=modules,
                                             target_parameters=parameters or None, lora_dropout=0.0,
                                             task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens = torch.randint(0, hf["vocab_size"], (args.batch, args.seq), device=device)

    def step() -> float:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    warm_start = time.perf_counter()
    for _ in range(WARMUP_STEPS):
        float(step())
    warmup_s = time.perf_counter() - warm_start
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    synchronize()
    elapsed = time.perf_counter() - start
    return {
        "framework": "torch+peft", "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "warmup_s": warmup_s, "step_s": elapsed / args.steps,
        "tokens_per_s": args.batch * args.seq * args.steps / elapsed, "final_loss": float(loss),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_host_memory_bytes(),
    }


# ---------------------------------------------------------------- driver


def child(args) -> None:
    result = bench_jax(args) if args.framework == "jax" else bench_torch(args)
    print("RESULT " + json.dumps(result), flush=True)


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a bench's child process, with this checkout's trainer package first (and `extra`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
            **extra}


def run_child(script: str, argv: list[str], single_thread: bool) -> dict:
    """The `RESULT {json}` line of `script argv` run in a child process (a clean peak-memory figure)."""
    env = child_env()
    if single_thread:
        # The same CPU budget for both, immune to other load: one XLA thread, one OpenMP thread.
        env["OMP_NUM_THREADS"] = "1"
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    completed = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        raise SystemExit(f"{Path(script).name} {' '.join(argv[-4:])} failed:\n{completed.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def report(args, results: dict[str, dict]) -> None:
    print(f"shape={args.shape} batch={args.batch} seq={args.seq} rank={args.rank} steps={args.steps}")
    for result in results.values():
        mfu = f"{100 * result['mfu']:.1f}%" if result.get("mfu") is not None else "n/a"
        print(f"  {result['framework']:<11} {result['device']:<16} {result['dtype']:<15} "
              f"{result['tokens_per_s']:>10.0f} tok/s  {1000 * result['step_s']:>9.1f} ms/step  MFU {mfu:>6}  "
              f"peak mem {result['peak_memory_bytes'] / 2**30:6.2f} GiB  warm-up {result['warmup_s']:.1f} s  "
              f"loss {result['final_loss']:.3f}")
    if "jax" in results:
        jax_result = results["jax"]
        print(f"  model: {jax_result['params'] / 1e6:.1f}M params, {jax_result['adapter_params'] / 1e6:.2f}M adapter "
              f"params, {jax_result['gflops_per_token']:.3f} GFLOP/token (LoRA model FLOPs)")
    if {"jax", "torch"} <= set(results) and results["jax"]["peak_flops"]:
        torch_mfu = results["torch"]["tokens_per_s"] * results["jax"]["gflops_per_token"] * 1e9 / results["jax"]["peak_flops"]
        print(f"  PyTorch+PEFT MFU on the same FLOPs model: {100 * torch_mfu:.1f}%")
    if {"jax", "torch"} <= set(results):
        ratio = results["jax"]["tokens_per_s"] / results["torch"]["tokens_per_s"]
        print(f"  JAX / PyTorch+PEFT throughput: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--loss-chunk", type=int, default=None,
                        help="loss_chunk_length: positions per row per LM-head chunk (default: the trainer's for --batch rows)")
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="minimal",
                        help="remat_policy (default: minimal, what remat auto runs on a CPU; bench/chip_bench.py plans "
                             "auto's choice for a TPU chip)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (needed on CPU)")
    parser.add_argument("--frameworks", default="jax,torch")
    parser.add_argument("--single-thread", action="store_true", help="CPU: one thread for each framework")
    parser.add_argument("--framework", choices=["jax", "torch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.framework:
        child(args)
        return
    argv = sys.argv[1:]
    frameworks = args.frameworks.split(",")
    results = {
        framework: run_child(__file__, [*argv, "--framework", framework], args.single_thread) for framework in frameworks
    }
    report(args, results)


if __name__ == "__main__":
    main()
