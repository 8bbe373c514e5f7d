"""The trainer's own train step compiled by the real TPU compiler for a v6e slice, without a TPU (libtpu's
deviceless compile, lorajob_trainer.plan): what it needs per chip stays within what one layer at a time needs.

Four layers of Llama 3.1 8B's width: the step's temporaries per chip must stay under a bound computed from the
config for a step that gathers one layer's weights at a time and keeps only each layer's input between the
passes. The unscanned step without batch-sharded activations needed about 1.2 GB more per layer at this width
(39 GB at 32 layers on v6e-8), which this bound cannot hold.

Two layers of Qwen3 30B-A3B's width on v6e-8: the same bound, with every expert's weights as the layer's and the
routed rows of this chip's own tokens as its MLP activations. Experts computed on tokens gathered from every chip
needed 3.90 GB here against the bound of 2.18 GB x 1.5 (2.07 GB mixing each chip's own tokens, models/experts.py).

The bound holds no attention scores: on TPU the attention runs in the splash kernel (models/splash.py), which keeps
none. Two layers of Qwen3 0.6B at 8,192 tokens: 0.69 GB of temporaries against the bound's 0.53 x 1.5; with
dense attention's [T, T] scores 4.91 GB.
"""

from __future__ import annotations

import pytest

from lorajob_trainer import plan
from lorajob_trainer.contract import catalog
from lorajob_trainer.contract.config import TrainConfig

pytestmark = pytest.mark.slow(minutes=6)

TOPOLOGY = "v6e:2x2"
SEQ = 1024
MARGIN = 1.5
"""Headroom over the bound for the compiler's own buffers (fusion outputs, collectives' staging, padding)."""


def config(remat: str, model: str = "llama3.1-8b") -> TrainConfig:
    return TrainConfig.from_dict({
        "run_name": "plan", "base_output_directory": "/tmp/plan", "model_name": model,
        "load_parameters_path": "unused", "hf_train_files": ["unused"], "steps": 1,
        "max_target_length": SEQ, "per_device_batch_size": 1, "remat_policy": remat,
        "lora": {"lora_rank": 16, "lora_alpha": 32},
    })


def released_at_depth(model: str, layers: int) -> dict:
    """The catalogue's config.json facts of `model`, cut to its first `layers` layers."""
    return catalog.at_depth(catalog.released_config(model), layers)


def one_layer_at_a_time_bytes(hf: dict, layers: int, seq: int) -> int:
    """Per chip, bf16 weights and activations, one row of `seq` tokens per chip: each layer's input kept for the
    backward pass, plus one layer's gathered weights (for a MoE layer every expert's and the router), its MLP
    activations (of a MoE layer: this chip's tokens' rows to their top-k experts), and the LM head gathered for
    the chunked loss."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    heads, kv_heads, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    bf16 = 2
    if "num_experts" in hf:
        f, experts = hf["moe_intermediate_size"], hf["num_experts"]
        mlp_weights, mlp = (3 * d * f + d) * experts, 3 * seq * hf["num_experts_per_tok"] * f * bf16
    else:
        f = hf["intermediate_size"]
        mlp_weights, mlp = 3 * d * f, 3 * seq * f * bf16
    layer_weights = (2 * d * heads * head_dim + 2 * d * kv_heads * head_dim + mlp_weights) * bf16
    kept_inputs = layers * seq * d * bf16
    head = d * v * bf16
    return kept_inputs + layer_weights + mlp + head


@pytest.mark.parametrize(("model", "layers", "topology", "seq"), [
    pytest.param("llama3.1-8b", 4, TOPOLOGY, SEQ, marks=pytest.mark.large), ("qwen3-30b-a3b", 2, "v6e:2x4", SEQ),
    pytest.param("qwen3-0.6b", 2, TOPOLOGY, 8192, marks=pytest.mark.large),
])
def test_step_needs_one_layer_at_a_time_on_v6e(model, layers, topology, seq):
    hf = released_at_depth(model, layers)
    step_config = config("full", model).model_copy(update={"max_target_length": seq})
    compiled = plan.compile_train_step(step_config, hf, plan.topology_devices(topology))
    bound = one_layer_at_a_time_bytes(hf, layers, seq)
    assert compiled.layers_scanned == layers
    assert compiled.memory.temporaries < MARGIN * bound, (
        f"temporaries {compiled.memory.temporaries / 1e9:.2f} GB per chip, bound {bound / 1e9:.2f} GB x {MARGIN}"
    )


def test_argument_bytes_are_the_abstract_arrays():
    """The compiler's argument bytes per chip are the inputs' shards: base, adapters, optimizer state, batch."""
    hf = released_at_depth("qwen3-0.6b", 2)
    memory = plan.compile_train_step(config("minimal"), hf, plan.topology_devices(TOPOLOGY)).memory
    expected = memory.base_weights + memory.adapters + memory.optimizer_state + memory.batch
    assert memory.base_weights > 0 and memory.adapters > 0 and memory.optimizer_state > 0
    assert memory.arguments == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize(("model", "layers", "remat", "seq", "attention_block"), [
    ("qwen3-0.6b", 2, "none", 192, None), pytest.param("qwen3-0.6b", 2, "full", 192, None, marks=pytest.mark.large),
    ("qwen3-0.6b", 2, "full", 256, 256), pytest.param("qwen3-30b-a3b", 1, "none", 256, 256, marks=pytest.mark.large),
    pytest.param("gemma3-1b", 2, "none", 1024, 512, marks=pytest.mark.large),  # 256-wide heads: 512-position blocks
])
def test_the_plans_executed_flops_are_the_compilers(model, layers, remat, seq, attention_block):
    """The roofline's FLOPs (metrics.LoraFlops.executed_per_token: the model's, remat's recompute, the masked
    attention scores) against the compiler's count of the step unrolled, on a family other than the one its
    remat factor was measured on (Qwen3, whose head is its input embedding; Gemma 3). At lengths the splash kernel's
    blocks divide the attention runs in it, whose FLOPs the compiler does not count: the rest must be the
    compiler's, and at other lengths the dense attention's are counted. The MoE step's expert adapters run in
    `ragged_dot`, whose weight gradients the compiler's cost analysis counts densely, every expert over every row
    (`ragged_dot_weight_gradients_counted_densely`); the chip does not run them so (models/experts.py), and the
    FLOPs model counts each row with its own expert. The FSDP-style MoE step: the expert-parallel one also runs its
    grouped matmuls over the empty slots of its capacity, which the FLOPs model does not count (the compiler's count
    of qwen3-30b-a3b's step on v6e-16 at 2,048 tokens per chip and capacity factor 2: 1.37x the FSDP-style
    step's)."""
    hf = released_at_depth(model, layers)
    step_config = config(remat, model).model_copy(update={"max_target_length": seq, "loss_chunk_length": seq})
    step_config = TrainConfig.model_validate({**step_config.model_dump(), "mesh": {"expert": 1}})
    step = plan.compile_train_step(step_config, hf, plan.topology_devices(TOPOLOGY), scan_layers=False)
    assert step.layers_scanned == 0
    assert step.attention_block == attention_block
    assert (step.kernel_flops_per_token > 0) == (attention_block is not None)
    counted = step.executed_flops_per_token - step.kernel_flops_per_token
    counted += ragged_dot_weight_gradients_counted_densely(hf, step_config.lora.lora_rank)
    assert counted * step.tokens_per_device == pytest.approx(step.flops, rel=0.03)


def ragged_dot_weight_gradients_counted_densely(hf: dict, rank: int) -> float:
    """FLOPs per token the TPU compiler's cost analysis adds to a MoE step beyond what runs: each of a token's
    routed rows gets the weight gradients of both adapter matrices of every other expert too (2 * rank * (in + out)
    each), for the fused gate-up projection (hidden -> 2 x expert width) and the down projection."""
    if "num_experts" not in hf:
        return 0.0
    width, expert_width = hf["hidden_size"], hf["moe_intermediate_size"]
    per_expert = 2 * rank * ((width + 2 * expert_width) + (expert_width + width))
    return hf["num_hidden_layers"] * hf["num_experts_per_tok"] * (hf["num_experts"] - 1) * per_expert


@pytest.mark.parametrize(("variable", "shape", "names", "spec"), [
    ("lora", (16, 5376), (None, "tp"), (None, ("tp", "fsdp"))),  # B of a kernel split (fsdp, tp): whole before
    ("lora", (16, 32, 128), (None, "tp", None), ("fsdp", "tp", None)),  # split on its rank: no shard is padded
    ("lora", (5376, 16), ("fsdp", None), ("fsdp", None)),  # already split over fsdp
    ("lora", (16, 100), (None, "tp"), (None, "tp")),  # each split would pad its shards to TPU tiles: kept whole
    ("base", (16, 5376), (None, "tp"), (None, "tp")),  # only adapters
])
def test_adapters_are_split_over_fsdp_where_that_shrinks_their_shards(variable, shape, names, spec):
    """An adapter, its gradient and its Adam moments shrink with the fsdp axis as the base weights do."""
    from flax import nnx
    from jax import ShapeDtypeStruct
    from jax.sharding import PartitionSpec

    from lorajob_trainer import mesh as mesh_lib

    mesh = mesh_lib.build_mesh(config("full").mesh, plan.topology_devices(TOPOLOGY))
    assert mesh.shape["fsdp"] == 4
    kind = nnx.LoRAParam if variable == "lora" else nnx.Param
    held = kind(ShapeDtypeStruct(shape, "float32"), sharding=names)
    assert mesh_lib.variable_sharding(mesh, held).spec == PartitionSpec(*spec)


@pytest.mark.large
def test_expert_parallel_step_sends_tokens_not_weights_on_v6e():
    """Two layers of Qwen3 30B-A3B's width on v6e-8, one row of 1,024 tokens per chip: the FSDP-style step
    (mesh.expert=1) gathers every expert's weights for every pass; the expert-parallel one (mesh.expert=8) sends
    each chip's rows of tokens to their experts' chips and back instead. Its all-to-all bytes, counted from the
    compiled HLO (collectives.py), less the few the partitioner adds to either step, are those of 4 to 6 exchanges
    per layer of its capacity's slots (forward,
    backward, and the recompute of remat "full"), it gathers far less, it needs no more HBM, and it reads an eighth
    of the experts' weights per pass."""
    from lorajob_trainer.models import experts

    hf = released_at_depth("qwen3-30b-a3b", 2)
    devices = plan.topology_devices("v6e:2x4")
    steps = {}
    for expert in (1, 8):
        step_config = config("full", "qwen3-30b-a3b").model_copy(update={"mesh": {"expert": expert}})
        steps[expert] = plan.compile_train_step(TrainConfig.model_validate(step_config.model_dump()), hf, devices)
    assert steps[8].mesh["expert"] == 8 and steps[1].mesh["expert"] == 1
    fsdp, parallel = steps[1].collective_bytes, steps[8].collective_bytes
    rows = SEQ * hf["num_experts_per_tok"]
    slot_bytes = 8 * experts.expert_capacity(rows, 8, 2.0) * hf["hidden_size"] * 2 * 7 / 8
    # The partitioner's own all-to-alls (11 MB here) are in both steps; the rest are the experts' exchanges.
    exchanged = parallel["all-to-all"] - fsdp["all-to-all"]
    assert fsdp["all-to-all"] < exchanged / 20
    assert 4 * 2 * slot_bytes <= exchanged <= 6 * 2 * slot_bytes * 1.01
    assert parallel["all-gather"] < fsdp["all-gather"] / 4
    assert steps[8].memory.total <= steps[1].memory.total
    # The roofline's HBM term: each chip reads its eighth of the experts, every other weight whole.
    expert_bytes = 2 * 3 * hf["num_experts"] * hf["hidden_size"] * hf["moe_intermediate_size"] * 2
    assert steps[1].weights_read_bytes - steps[8].weights_read_bytes == pytest.approx(expert_bytes * 7 / 8, rel=1e-6)
