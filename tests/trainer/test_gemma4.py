"""Gemma 4 beyond the shared parity tests (test_parity.py runs those on GEMMA4_SHAPES): the multimodal
checkpoint layout, the layer structure that LoRA sees, the configs that are refused, and the training forward in
the splash kernel (in Pallas' interpreter) against the dense attention."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from lorajob_trainer import convert, export, loading, lora, models, weights
from lorajob_trainer.models import gemma4
from test_parity import ATOL, jax_logits, load_hf, lora_model_with_random_adapters, tokens, torch_logits
from test_splash_attention import kernel_forwards
from trainer_testkit import GEMMA4_SHAPES, gemma4_checkpoint, splash_in_interpreter

pytestmark = pytest.mark.torch


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def hf_config(shape: str, **changes) -> dict:
    import transformers

    return {**transformers.Gemma4TextConfig(**GEMMA4_SHAPES[shape]).to_dict(), **changes}


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A Gemma4ForConditionalGeneration checkpoint (language model under `model.language_model.`, a vision tower)."""
    directory = gemma4_checkpoint(tmp_path_factory.mktemp("mm"), "gemma4-31b", multimodal=True, seed=2)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "gemma4"
    return directory


def test_a_maxtext_checkpoint_is_refused_with_what_to_do(multimodal, mesh, tmp_path):
    (tmp_path / "maxtext" / "0" / "items").mkdir(parents=True)
    refused = "MaxText checkpoints of gemma4 models are not supported.*huggingFace"
    with pytest.raises(weights.WeightsError, match=refused):
        loading.load_model("tiny-gemma4", tmp_path / "maxtext", mesh=mesh, dtype=jnp.float32, format="maxtext", config_dir=multimodal)


def test_language_model_of_a_multimodal_checkpoint_matches_transformers(multimodal, mesh):
    model, spec = loading.load_model("tiny-gemma4", multimodal, mesh=mesh, dtype=jnp.float32)
    assert spec.family.name == "gemma4"
    ids = tokens()
    np.testing.assert_allclose(jax_logits(model, ids), torch_logits(load_hf(multimodal), ids), atol=ATOL, rtol=0)


def test_multimodal_adapter_and_merged_export_load_in_transformers(multimodal, mesh, tmp_path):
    """The exported adapter names the language model's modules only (PEFT cannot adapt the vision tower's);
    the merged export is the whole checkpoint, vision tower included."""
    from peft import PeftModel
    from safetensors.numpy import load_file

    model, params, metadata = lora_model_with_random_adapters("gemma4", multimodal, mesh)
    step_dir = lora.save_adapter_checkpoint(tmp_path / "ckpt", params, metadata)
    adapter = export.export_adapter(step_dir, tmp_path / "adapter")
    assert all(".language_model.layers." in name for name in load_file(adapter / "adapter_model.safetensors"))
    ids = tokens()
    ours = jax_logits(model, ids)
    peft_logits = torch_logits(PeftModel.from_pretrained(load_hf(multimodal), adapter), ids)
    np.testing.assert_allclose(ours, peft_logits, atol=ATOL, rtol=0)
    merged = export.export_merged(step_dir, tmp_path / "merged")
    base_names = set(load_file(next(multimodal.glob("*.safetensors"))))
    merged_names = {name for path in merged.glob("*.safetensors") for name in load_file(path)}
    assert merged_names == base_names
    np.testing.assert_allclose(ours, torch_logits(load_hf(merged), ids), atol=ATOL, rtol=0)


def test_peft_adapter_on_a_multimodal_base_converts_to_peft_logits(multimodal, mesh, tmp_path):
    """PEFT's own Gemma 4 default targets the language model by a regex; such an adapter converts in."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model

    torch.manual_seed(0)
    regex = r".*language_model\..*\.(q_proj|k_proj|v_proj|o_proj|down_proj)"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=regex, init_lora_weights=False, lora_dropout=0.0)
    get_peft_model(load_hf(multimodal), config).save_pretrained(tmp_path / "adapter")
    params, metadata = lora.load_adapter_checkpoint(
        convert.convert_adapter("tiny-gemma4", multimodal, tmp_path / "adapter", tmp_path / "converted")
    )
    assert metadata.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    model, _ = loading.load_model("tiny-gemma4", multimodal, mesh=mesh, dtype=jnp.float32)
    regex = lora.module_path_regex("gemma4", metadata.target_modules)
    model = lora.apply_lora(model, rank=4, alpha=8.0, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0))
    lora.set_lora_params(model, params)
    ids = tokens()
    peft_logits = torch_logits(PeftModel.from_pretrained(load_hf(multimodal), tmp_path / "adapter"), ids)
    np.testing.assert_allclose(jax_logits(model, ids), peft_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shape", GEMMA4_SHAPES)
def test_every_projection_has_its_own_adapter(shape):
    """k and v adapters are separate modules; a k_eq_v global layer adapts k only, KV-shared layers neither."""
    hf = hf_config(shape)
    config = gemma4.gemma4_config(hf, jnp.float32)
    template = convert.lora_template(gemma4.GEMMA4, config, hf, 2, lora.module_path_regex("gemma4"))
    adapted = {key.rsplit(".", 1)[0] for key in template}  # module paths
    sources = gemma4.kv_sources(hf)
    for i, layer_type in enumerate(hf["layer_types"]):
        kv = {f"layers.{i}.attn.kv_einsum.{p}_einsum" for p in "kv"} & adapted
        if sources[i] != i:
            assert kv == set(), i
        elif hf["attention_k_eq_v"] and layer_type == "full_attention":
            assert kv == {f"layers.{i}.attn.kv_einsum.k_einsum"}, i
        else:
            assert len(kv) == 2, i
        assert f"layers.{i}.attn.q_einsum" in adapted and f"layers.{i}.mlp.down_proj" in adapted


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5, "moe_intermediate_size": 8}, "top_k"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}}},
            "sliding_attention rope_type 'yarn'",
        ),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 1.0}}}, "full_attention.rope_theta"),
        ({"vocab_size_per_layer_input": 512}, "vocab_size_per_layer_input"),
        # Tunix shares the last unshared global layer's keys and values only if it is the last unshared layer.
        ({"num_kv_shared_layers": 4}, "KV sharing"),
    ],
    ids=["top-k", "untied", "bias", "yarn", "no-global-rope", "ple-vocab", "kv-sharing"],
)
def test_unsupported_configs_are_rejected(changes, message):
    with pytest.raises(models.ModelConfigError, match=message):
        gemma4.gemma4_config(hf_config("gemma4-e2b", **changes), jnp.float32)


def test_multimodal_config_needs_a_text_config():
    with pytest.raises(models.ModelConfigError, match="no text_config"):
        gemma4.gemma4_config({"model_type": "gemma4", "vision_config": {}}, jnp.float32)


def test_tunix_moe_routing_differs_from_transformers(mesh, tmp_path):
    """Tunix's own MoERagged with the same weights misses transformers by far (it routes on the experts'
    normalised input, transformers on the residual stream): our MoE block is what matters."""
    directory = gemma4_checkpoint(tmp_path / "moe", "gemma4-26b", seed=3)
    model, spec = loading.load_model("tiny-gemma4", directory, mesh=mesh, dtype=jnp.float32)
    flat = nnx.to_flat_state(nnx.state(model))
    ours = {weights.path_key(path): variable.get_value() for path, variable in flat}
    tunix = gemma4.gemma4_lib.Gemma4(spec.tunix_config, rngs=nnx.Rngs(0))
    gemma4.adapt(tunix, spec.tunix_config, nnx.Rngs(0))
    for i, layer in enumerate(tunix.layers):  # back to Tunix's MoE, with our (transformers') weights
        layer.moe = gemma4.gemma4_lib.moe.MoERagged(spec.tunix_config, rngs=nnx.Rngs(0))
        layer.moe_pre_ffw_norm = gemma4.gemma4_lib.RMSNorm(
            spec.tunix_config.embed_dim, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32
        )

        def weight(name, i=i):
            return ours[f"layers.{i}.moe.{name}"]

        gate_up = weight("experts.gate_up_proj.w")  # [E, D, 2F] -> Tunix's [E, 2, F, D]
        experts, dim, fused = gate_up.shape
        layer.moe.gating_einsum.set_value(gate_up.reshape(experts, dim, 2, fused // 2).transpose(0, 2, 3, 1))
        layer.moe.linear.set_value(weight("experts.down_proj.w"))
        layer.moe.router_logits.set_value(weight("router.kernel"))
        layer.moe.router_scale.set_value(weight("router_scale"))
        layer.moe.per_expert_scale.set_value(weight("per_expert_scale"))
        layer.moe_pre_ffw_norm.scale.set_value(weight("pre_norm.scale"))
    nnx.update(tunix, nnx.State.from_flat_path([(path, v) for path, v in flat if "moe" not in path]))
    copied = {weights.path_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(tunix))}
    copied = {key: value for key, value in copied.items() if ".moe" not in key}
    assert copied.keys() == {key for key in ours if ".moe" not in key}
    assert all(np.array_equal(value, ours[key]) for key, value in copied.items())
    ids = tokens()
    reference = torch_logits(load_hf(directory), ids)
    np.testing.assert_allclose(jax_logits(model, ids), reference, atol=ATOL, rtol=0)
    assert np.abs(jax_logits(tunix, ids) - reference).max() > 100 * ATOL


SPLASH_LENGTH = 256
FLOAT32_REORDERED = 1e-4
"""Two float32 computations of the same attention, relative to the largest value compared."""
"""Two of the kernel's 128-position blocks; the tiny models' sliding window (4) is far shorter."""


def packed_rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, positions and segment ids [2, SPLASH_LENGTH]: row 0 packs two sequences (positions restart), row 1
    is one sequence followed by padding."""
    ids = tokens(2, SPLASH_LENGTH, seed=6)
    segments = np.ones_like(ids)
    segments[0, 150:], segments[1, 200:] = 2, 0
    positions = np.tile(np.arange(SPLASH_LENGTH), (2, 1))
    positions[0, 150:] -= 150
    return ids, positions, segments


def logits_and_adapter_gradients(model, mesh, batch) -> tuple[np.ndarray, dict, int]:
    """The training forward's logits, the gradients of sum(logits · a fixed cotangent) by every adapter, and the
    splash kernel's forwards in the traced program, jitted on `mesh`."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    cotangent = jnp.asarray(np.random.default_rng(7).normal(size=(*batch[0].shape, model.config.num_embed)), jnp.float32)

    def objective(adapters, ids, positions, segments):
        logits = models.forward(nnx.merge(graphdef, adapters, rest), ids, positions, segments)
        return jnp.sum(jnp.where(segments[..., None] > 0, logits, 0.0) * cotangent), logits

    with jax.set_mesh(mesh):
        function = jax.jit(jax.value_and_grad(objective, has_aux=True))
        traced = function.trace(adapters, *map(jnp.asarray, batch))
        (_, logits), gradients = function(adapters, *map(jnp.asarray, batch))
    return np.asarray(logits), nnx.to_flat_state(gradients), kernel_forwards(traced.jaxpr.jaxpr)


@pytest.mark.parametrize("shape", ["gemma4-26b", "gemma4-e2b"])
def test_the_training_forward_in_the_splash_kernel_equals_the_dense_attention(shape, mesh, tmp_path):
    """Sliding layers (the kernel's local mask), global layers (their own head size, k = v, partial RoPE) and, in
    E2B, layers on an earlier layer's keys and values: logits and every adapter's gradient as the dense attention's,
    over packed and padded rows."""
    model, _, _ = lora_model_with_random_adapters("gemma4", gemma4_checkpoint(tmp_path, shape, seed=4), mesh)
    batch = packed_rows()
    dense_logits, dense_gradients, dense_kernels = logits_and_adapter_gradients(model, mesh, batch)
    with splash_in_interpreter():
        logits, gradients, kernels = logits_and_adapter_gradients(model, mesh, batch)
    layers = GEMMA4_SHAPES[shape]["num_hidden_layers"]
    shared = GEMMA4_SHAPES[shape].get("num_kv_shared_layers", 0)
    assert dense_kernels == 0 and kernels >= layers  # every layer's forward, the shared ones too, in the kernel
    real = batch[2] > 0
    # float32 in another order of summation (the kernel's blockwise softmax): 1.3e-4 on logits near 2 seen in E2B
    scale = FLOAT32_REORDERED * np.abs(dense_logits[real]).max()
    np.testing.assert_allclose(logits[real], dense_logits[real], atol=scale, rtol=0)
    assert len(gradients) == len(dense_gradients) and shared < layers
    for (path, got), (_, expected) in zip(gradients, dense_gradients):
        expected = np.asarray(expected.get_value())
        assert np.abs(expected).max() > 0, path
        np.testing.assert_allclose(np.asarray(got.get_value()), expected, atol=FLOAT32_REORDERED * np.abs(expected).max(), rtol=0,
                                   err_msg=str(path))
