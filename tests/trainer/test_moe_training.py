"""MoE training: transformers' load-balancing loss (value, padding mask, weight in the step), the expert mesh
axis (weights and adapters sharded along the experts, same losses as one device) and active-parameter FLOPs."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from lorajob_trainer import loading, metrics, models, tiny
from lorajob_trainer import loss as loss_lib
from lorajob_trainer import run as run_lib
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.models import experts
from test_parity import load_hf, mesh, tokens  # noqa: F401  (mesh: a fixture)
from trainer_testkit import GEMMA4_SHAPES, arithmetic_rows, base_args, tiny_checkpoint, trainer_env, write_jsonl

FAMILY = "qwen3-moe"
COEF = 0.25
"""A load-balancing weight large enough that the aux term moves the total loss well beyond 1e-5."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_tiny_checkpoint(FAMILY, tmp_path_factory.mktemp(FAMILY), seed=3, tokenizer=False,
                                     router_aux_loss_coef=COEF)


def padded_batch(ids: np.ndarray, real_lengths: list[int]) -> tuple[dict[str, jax.Array], np.ndarray]:
    """(our micro-batch of `ids` with each row's tail beyond its real length padded, transformers' 2-D
    attention mask): as transformers' causal-LM loss, position t is trained on token t+1 when that is real."""
    mask = (np.arange(ids.shape[1])[None] < np.array(real_lengths)[:, None]).astype(np.int32)
    targets = np.concatenate([ids[:, 1:], np.zeros_like(ids[:, :1])], axis=1)
    weights = np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], axis=1).astype(np.float32)
    batch = {
        "inputs": ids, "targets": targets, "weights": weights, "segment_ids": mask,
        "positions": np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1)),
    }
    return {name: jnp.asarray(value) for name, value in batch.items()}, mask


@pytest.mark.torch
@pytest.mark.parametrize("policy", ["none", "full"])
def test_load_balancing_loss_matches_transformers(checkpoint, mesh, policy):
    """Our aux loss (router logits of every layer, top-k of the softmax, real tokens only) and LM loss +
    router_aux_loss_coef * aux equal transformers' `aux_loss` and `loss` at 1e-5 (fp32), with padding,
    also when the layers are rematerialised (the recorded logits leave the checkpointed layer)."""
    import torch

    model, _ = loading.load_model(f"tiny-{FAMILY}", checkpoint, mesh=mesh, dtype=jnp.float32)
    ids = tokens()
    batch, mask = padded_batch(ids, [ids.shape[1], ids.shape[1] - 13])

    graphdef, state = nnx.split(model)

    @jax.jit
    def ours(state, batch):
        model = nnx.merge(graphdef, state)
        return loss_lib.losses_with_load_balancing(model, batch, chunk_length=8, remat=policy)

    loss_sum, weight_sum, aux, _ = ours(state, batch)
    hf = load_hf(checkpoint)
    labels = torch.tensor(np.where(mask == 1, ids, -100))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), labels=labels,
                 output_router_logits=True)
    assert hf.router_aux_loss_coef == COEF
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5, atol=0)
    np.testing.assert_allclose(float(loss_sum / weight_sum + COEF * aux), float(out.loss), rtol=1e-5, atol=0)
    # The padding mask matters: over every position the value differs.
    unmasked = ours(state, {**batch, "segment_ids": jnp.ones_like(batch["segment_ids"])})[2]
    assert abs(float(unmasked) - float(aux)) > 1e-4


def test_load_balancing_loss_formula_on_hand_made_logits():
    """Two experts, top-1: tokens 0 and 1 pick expert 0, token 2 (masked) expert 1; E * sum_e f_e P_e."""
    logits = [jnp.array([[2.0, 0.0], [1.0, 0.0], [0.0, 3.0]])]
    probs = np.asarray(jax.nn.softmax(logits[0][:2], axis=-1))
    expected = 2 * (1.0 * probs[:, 0].mean() + 0.0 * probs[:, 1].mean())
    got = experts.load_balancing_loss(logits, 1, jnp.array([1, 1, 0]))
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)
    assert float(experts.load_balancing_loss(logits, 1, jnp.zeros(3))) == 0.0


@pytest.mark.parametrize(
    ("hf_config", "override", "expected"),
    [
        ({"router_aux_loss_coef": 0.01}, None, 0.0),  # transformers adds it only with output_router_logits
        ({"router_aux_loss_coef": 0.01, "output_router_logits": True}, None, 0.01),
        ({"output_router_logits": True}, None, 0.001),  # Qwen3MoeConfig's default
        ({}, 0.5, 0.5),
        ({"output_router_logits": True}, 0.0, 0.0),
    ],
)
def test_aux_loss_coefficient_defaults_to_the_checkpoint_config(hf_config, override, expected):
    hf = tiny.tiny_config(FAMILY, **hf_config)
    family = models.FAMILIES[FAMILY]
    abstract = models.abstract_model(family, family.config_from_hf(hf, jnp.float32), hf)
    assert run_lib.aux_loss_coef(override, hf, abstract) == expected


@pytest.mark.torch
def test_gemma4_moe_has_no_load_balancing_loss():
    """transformers' Gemma 4 defines no aux loss (no router_aux_loss_coef, no load_balancing_loss_func): we add none."""
    import transformers
    import transformers.models.gemma4.modeling_gemma4 as hf_gemma4

    hf = transformers.Gemma4TextConfig(**GEMMA4_SHAPES["gemma4-26b"]).to_dict()
    assert not hasattr(hf_gemma4, "load_balancing_loss_func")
    assert "router_aux_loss_coef" not in hf and "output_router_logits" not in hf
    family = models.FAMILIES["gemma4"]
    abstract = models.abstract_model(family, family.config_from_hf(hf, jnp.float32), hf)
    assert run_lib.aux_loss_coef(0.5, hf, abstract) is None


def moe_run_args(tmp_path, *overrides: str) -> list[str]:
    model_dir = tiny_checkpoint(tmp_path / "model", family=FAMILY)
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(64))
    return base_args(model_dir, tmp_path / "out", train_file, f"model_name=tiny-{FAMILY}", "enable_checkpointing=false",
                     "enable_tensorboard=false", *overrides)


def test_step_minimises_lm_loss_plus_weighted_aux_loss(tmp_path):
    """With 2 accumulation micro-batches the step's gradient is that of LM loss (over the step's trained
    tokens) + coef * the mean of the micro-batches' aux losses, which it reports as aux_loss.
    (metrics.jsonl's aux_loss: the expert-axis test reads it.)"""
    config = TrainConfig.from_args(moe_run_args(tmp_path, "steps=1", "gradient_accumulation_steps=2",
                                                "per_device_batch_size=2", f"router_aux_loss_coef={COEF}"))
    trainer = train_lib.build_trainer(config)
    batch = trainer.train_feed.next_batch(1)
    graphdef, _, _ = nnx.split(trainer.run.model.model, nnx.LoRAParam, ...)

    def lm_and_aux(adapters):
        """(LM loss of the step, mean aux loss of its micro-batches)."""
        state = trainer.run.layout.state(adapters)
        lm_sum, aux_sum = 0.0, 0.0
        for m in range(2):
            micro = {name: value[m] for name, value in batch.items()}
            model = nnx.merge(graphdef, state, trainer.run.base)
            loss_sum, _, aux, _ = loss_lib.losses_with_load_balancing(
                model, micro, config.loss_chunk_per_row, trainer.run.remat_policy
            )
            lm_sum, aux_sum = lm_sum + loss_sum, aux_sum + aux
        return lm_sum / jnp.sum(batch["weights"]), aux_sum / 2

    @jax.jit
    def reference(adapters):
        _, aux = lm_and_aux(adapters)
        lm_grads, aux_grads = (jax.grad(lambda a, i=i: lm_and_aux(a)[i])(adapters) for i in (0, 1))
        total = jax.tree.map(lambda lm, a: lm + COEF * a, lm_grads, aux_grads)
        return aux, optax.global_norm(total), optax.global_norm(lm_grads)

    reference_aux, norm, lm_norm = (float(x) for x in reference(dict(trainer.lora)))
    _, _, step_metrics = trainer.run.steps.train(trainer.lora, trainer.opt_state, trainer.run.base, batch)
    trainer.close()
    np.testing.assert_allclose(float(step_metrics["grad_norm"]), norm, rtol=1e-5)
    assert abs(norm - lm_norm) > 1e-3 * lm_norm
    np.testing.assert_allclose(float(step_metrics["aux_loss"]), reference_aux, rtol=1e-5)


def test_dense_model_reports_no_aux_loss(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(16))
    config = TrainConfig.from_args(base_args(model_dir, tmp_path / "out", train_file, "steps=1",
                                             "enable_checkpointing=false", "enable_tensorboard=false"))
    train_lib.train(config)
    (record,) = [json.loads(line) for line in (config.run_directory / "metrics.jsonl").read_text().splitlines()]
    assert "loss" in record and "aux_loss" not in record


EXPERT_MESH_SCRIPT = r"""
import json, sys
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import TrainConfig
trainer = train_lib.build_trainer(TrainConfig.from_args(sys.argv[1:]))
def shards(array):
    return {"spec": [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec],
            "shapes": sorted({tuple(s.data.shape) for s in array.addressable_shards}), "shape": list(array.shape)}
base = {"/".join(map(str, p)): v for p, v in trainer.run.base.flat_state()}
report = {"mesh": dict(trainer.mesh.shape), "repeats": trainer.run.layout.stacking.repeats,
          "base": {k: shards(v.get_value()) for k, v in base.items() if k.startswith("layers/blocks/0/mlp/experts/")},
          "lora": {k: shards(v) for k, v in trainer.lora.items() if k.startswith("layers.0.mlp.experts.")}}
trainer.train()
trainer.close()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_expert_axis_shards_experts_and_their_adapters_and_keeps_the_losses(tmp_path, quantization):
    """4 CPU devices as mesh expert=2 x fsdp=2: each expert stack and adapter holds a quarter of the experts
    per device (split over (expert, fsdp); the base's layers stacked for the scan on an unsplit leading axis);
    3 steps give the losses, aux losses and grad norms of one device with the same global batch (each device
    mixing its own tokens, models/experts.py; with QLoRA the experts gathered quantised)."""
    targets = "lora.target_modules=['q_proj','mlp.experts.gate_up_proj','mlp.experts.down_proj']"
    quantized = f"lora.base_quantization={quantization}"
    sharded_args = moe_run_args(tmp_path, "steps=3", "per_device_batch_size=1", "mesh.expert=2", targets,
                                "run_name=sharded", f"router_aux_loss_coef={COEF}", quantized)
    completed = subprocess.run([sys.executable, "-c", EXPERT_MESH_SCRIPT, *sharded_args], env=trainer_env(devices=4),
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.split("REPORT ", 1)[1])
    assert report["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "tp": 1}
    hf = tiny.tiny_config(FAMILY)
    num_experts, dim, hidden = hf["num_experts"], hf["hidden_size"], hf["moe_intermediate_size"]
    gate_up = report["base"]["layers/blocks/0/mlp/experts/gate_up_proj/w"]
    down = report["base"]["layers/blocks/0/mlp/experts/down_proj/w"]
    repeats = report["repeats"]
    assert repeats == hf["num_hidden_layers"]
    assert gate_up["spec"][:2] == down["spec"][:2] == [None, ["expert", "fsdp"]]
    assert gate_up["shapes"] == [[repeats, 2 * num_experts // 4, dim, hidden]]
    assert down["shapes"] == [[repeats, num_experts // 4, hidden, dim]]
    adapters = report["lora"]
    assert set(adapters) == {
        f"layers.0.mlp.experts.{part}.w_lora_{x}" for part in ("gate_up_proj", "down_proj") for x in "ab"
    }
    for name, adapter in adapters.items():
        assert adapter["spec"][0] == ["expert", "fsdp"], name
        assert adapter["shapes"] == [[num_experts // 4, *adapter["shape"][1:]]], name

    single = TrainConfig.from_args(moe_run_args(tmp_path, "steps=3", "per_device_batch_size=4", targets,
                                                "run_name=single", f"router_aux_loss_coef={COEF}", quantized))
    assert jax.device_count() == 1
    train_lib.train(single)

    def figures(run):
        records = [json.loads(line) for line in (tmp_path / "out" / run / "metrics.jsonl").read_text().splitlines()]
        return {key: [r[key] for r in records if "loss" in r] for key in ("loss", "aux_loss", "grad_norm")}

    sharded, reference = figures("sharded"), figures("single")
    for key in reference:
        np.testing.assert_allclose(sharded[key], reference[key], rtol=1e-5, err_msg=key)
    # Expert parallel (2 devices of 2 experts each): at capacity factor 2 each device has room for all its rows.
    records = [json.loads(line) for line in (tmp_path / "out" / "sharded" / "metrics.jsonl").read_text().splitlines()]
    assert [r["expert_rows_dropped"] for r in records if "loss" in r] == [0, 0, 0]
    assert all(r["expert_slots_padded"] > 0 for r in records if "loss" in r)
    progress = json.loads((tmp_path / "out" / "sharded" / "progress.json").read_text())
    assert progress["expert_rows_dropped"] == 0


def test_mfu_counts_active_parameters_of_routed_experts():
    """N counts each expert stack at top-k / experts; dense weights, the router and the head in full."""
    shapes = {
        "layers/0/mlp/router/kernel": (8, 4),
        "layers/0/mlp/experts/gate_up_proj/w": (8, 8, 16),  # 4 experts x 2 parts
        "layers/0/mlp/experts/down_proj/w": (4, 16, 8),
        "layers/0/attn/q_proj/w": (8, 2, 4),
        "layers/0/input_layernorm/scale": (8,),
        "embedder/input_embedding": (32, 8),
        "lm_head/w": (8, 32),
    }
    active = {"layers.0.mlp.experts.gate_up_proj.": 0.5, "layers.0.mlp.experts.down_proj.": 0.5}
    n = metrics.frozen_matmul_params(shapes, active)
    assert n == 8 * 4 + (8 * 8 * 16 + 4 * 16 * 8) // 2 + 8 * 2 * 4 + 8 * 32
    assert metrics.output_head_params(shapes) == 8 * 32
    flops = metrics.LoraFlops(frozen_matmul_params=n, head_params=8 * 32, attention_width=8, adapter_params=100,
                              seq_len=16)
    assert flops.per_token == 4 * n + 6 * 16 * 8 + 6 * 100
    assert metrics.mfu(1000.0, flops, 2, 1e9) == pytest.approx(1000.0 * flops.per_token / 2e9)
    assert metrics.frozen_matmul_params(shapes) > n  # all experts: the total, not the active, count


def test_n_counts_a_tied_embedding_as_the_head_and_no_lookup_table():
    """Gemma 4 E2B/E4B ties its head to the input embedding and also reads per-layer embedding tables by lookup."""
    shapes = {
        "embedder/input_embedding": (32, 8),
        "embedder/per_layer_input_embedding": (32, 3, 4),
        "embedder/per_layer_model_projection/w": (8, 3, 4),
        "layers/0/attn/q_einsum/w": (8, 2, 4),
    }
    assert metrics.frozen_matmul_params(shapes) == 32 * 8 + 8 * 3 * 4 + 8 * 2 * 4
    assert metrics.output_head_params(shapes) == 32 * 8


def test_the_pallas_grouped_matmul_equals_ragged_dot_with_its_gradients():
    """The adapters' kernel on TPU (run here in Pallas' interpreter): values and both gradients as `ragged_dot`'s,
    with an empty group, for the rank-16 shapes of either adapter (rank out, then rank in)."""
    keys = jax.random.split(jax.random.key(0), 4)
    group_sizes = jnp.array([100, 0, 60, 96], jnp.int32)
    for d_in, d_out in ((256, 16), (16, 256)):
        x = jax.random.normal(keys[0], (256, d_in), jnp.float32)
        w = jax.random.normal(keys[1], (4, d_in, d_out), jnp.float32)
        cotangent = jax.random.normal(keys[2], (256, d_out), jnp.float32)

        def loss(x, w, kernel, cotangent=cotangent):
            return jnp.sum(experts.grouped_matmul(x, w, group_sizes, kernel, interpret=True) * cotangent)

        for argnum in (0, 1):
            pallas = jax.grad(loss, argnums=argnum)(x, w, "pallas")
            xla = jax.grad(loss, argnums=argnum)(x, w, "xla")
            np.testing.assert_allclose(pallas, xla, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(loss(x, w, "pallas"), loss(x, w, "xla"), rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 2048, 1536), (2, 24, 128)], ids=["row-blocks", "whole"])
def test_a_packed_expert_weight_unpacks_bit_for_bit_in_the_kernel_and_in_xla(shape):
    """tpu7x's step holds the routed experts' bf16 stacks packed (step.BaseLayout): the TPU kernel (in Pallas'
    interpreter here; tests/chip on the chip) and the XLA rule off TPU give back every bit, whether the kernel splits
    an expert's rows into blocks (a 2,048 x 1,536 weight: 4 of 256 packed rows) or takes it whole."""
    w = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    packed = experts.packed_rows(w)
    assert packed.dtype == experts.PACKED_DTYPE and packed.shape == (shape[0], shape[1] // 2, shape[2])
    bits = np.asarray(jax.lax.bitcast_convert_type(w, jnp.uint16))
    for unpacked in (experts.unpack_kernel(packed, interpret=True), experts.unpacked_rows(packed, (), None)):
        np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(unpacked, jnp.uint16)), bits)
