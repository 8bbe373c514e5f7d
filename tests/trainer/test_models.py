"""Model families, the RoPE fix, the forward with packed segments, and LoRA targets/application."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from lorajob_trainer import loading, lora, models, tiny
from lorajob_trainer.contract import catalog
from lorajob_trainer.models import attention, families, rope


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, mesh):
    directory = tiny.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=2)
    return loading.load_model("tiny-qwen3", directory, mesh=mesh, dtype=jnp.float32)


def run(model, ids, positions, segments) -> np.ndarray:
    return np.asarray(models.forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments)))


# --- RoPE --------------------------------------------------------------------------------------


def test_rope_spec_reads_transformers_4_and_5_layouts():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    legacy = {"rope_theta": 500000.0, "rope_scaling": scaling}
    current = {"rope_parameters": {**scaling, "rope_theta": 500000.0}}
    assert families.rope_spec(legacy) == families.rope_spec(current)
    assert families.rope_spec(legacy).rope_type == "llama3"


def test_unsupported_rope_type_is_rejected():
    with pytest.raises(rope.RopeConfigError, match="rope type 'yarn' is not supported"):
        families.rope_spec({"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_llama3_scaling_keeps_high_and_slows_low_frequencies():
    plain = rope.inverse_frequencies(rope.RopeSpec(theta=500000.0), 128)
    scaled = rope.inverse_frequencies(
        rope.RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, original_max_position_embeddings=8192), 128
    )
    assert scaled[0] == plain[0]  # wavelength 2*pi < 8192 / 4
    assert scaled[-1] == pytest.approx(plain[-1] / 8)  # wavelength far above 8192


def test_rope_theta_is_honoured(tmp_path, mesh):
    """Same weights, theta 1e4 vs 1e6: unpatched Tunix 0.1.7 would give identical logits."""
    outputs = []
    for theta in (1e4, 1e6):
        directory = tiny.make_tiny_checkpoint("qwen3", tmp_path / str(theta), seed=2, rope_theta=theta, tokenizer=False)
        model, _ = loading.load_model("tiny-qwen3", directory, mesh=mesh, dtype=jnp.float32)
        ids = np.arange(32).reshape(1, 32)
        outputs.append(run(model, ids, np.arange(32)[None], np.ones_like(ids)))
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-2


def test_every_layer_has_our_attention_with_the_checkpoint_rope(qwen3):
    model, _ = qwen3
    assert {type(layer.attn) for layer in model.layers} == {attention.Qwen3Attention}
    assert {layer.attn.rope_spec for layer in model.layers} == {rope.RopeSpec(theta=10_000.0)}


# --- configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen3", {"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("gemma3", {"query_pre_attn_scalar": 7}, "query_pre_attn_scalar=7"),
        ("gemma3", {"layer_types": ["full_attention"] * 6}, "layer_types"),
        ("gemma3", {"num_key_value_heads": 4}, "fused qkv"),
        ("llama3", {"num_attention_heads": None}, "lacks 'num_attention_heads'"),
    ],
    ids=["model-type", "activation", "softcap", "query-scalar", "layer-types", "fused-qkv", "missing-key"],
)
def test_unsupported_configs_are_rejected(family, change, message):
    config = tiny.tiny_config(family, **change)
    with pytest.raises(ValueError, match=message):
        models.family_for_hf_config(config).config_from_hf(config, jnp.float32)


def test_every_catalogue_family_has_model_code_and_every_family_a_model():
    assert {info.family for info in catalog.MODELS.values()} == set(models.FAMILIES)
    assert all(name == family.name for name, family in models.FAMILIES.items())


def test_model_name_must_match_the_checkpoint_family(qwen3, mesh):
    _, spec = qwen3
    with pytest.raises(models.ModelConfigError, match="holds a qwen3 model but 'tiny-llama3' is a llama3 model"):
        loading.load_model("tiny-llama3", spec.checkpoint, mesh=mesh)


def test_tiny_tokenizer_has_a_chat_template(qwen3):
    from transformers import AutoTokenizer

    _, spec = qwen3
    tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text == "<|im_start|>user\nwhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < tiny.VOCAB_SIZE and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(tokenizer("the answer is 5.")["input_ids"]) == "the answer is 5."
    assert json.loads((spec.checkpoint / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


# --- forward with packed segments --------------------------------------------------------------


def test_attention_mask_is_causal_within_segments():
    mask = np.asarray(models.attention_mask(jnp.array([[1, 1, 2, 2, 0]])))[0]
    expected = np.array(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=bool
    )
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gemma3", "qwen3-moe"])
def test_packed_sequences_equal_separate_ones(family, tmp_path, mesh):
    directory = tiny.make_tiny_checkpoint(family, tmp_path, seed=2, tokenizer=False)
    model, _ = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 256, 7), rng.integers(0, 256, 5)
    packed = np.concatenate([first, second, [0, 0]])[None]
    positions = np.concatenate([np.arange(7), np.arange(5), [0, 0]])[None]
    segments = np.array([[1] * 7 + [2] * 5 + [0, 0]])
    out = run(model, packed, positions, segments)[0]
    alone = [
        run(model, seq[None], np.arange(len(seq))[None], np.ones((1, len(seq)), int))[0] for seq in (first, second)
    ]
    np.testing.assert_allclose(out[:7], alone[0], atol=1e-5)
    np.testing.assert_allclose(out[7:12], alone[1], atol=1e-5)


# --- LoRA targets and application --------------------------------------------------------------


def test_default_targets_cover_attention_and_mlp():
    for family in ("qwen3", "llama3", "gemma3"):
        assert lora.default_targets(family) == [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]


def test_target_regexes():
    assert lora.module_path_regex("qwen3", ["q_proj", "down_proj"]) == r"layers/\d+/(attn/q_proj|mlp/down_proj)"
    gemma = lora.module_path_regex("gemma3", ["k_proj"])
    assert gemma == r"layers/\d+/(attn/kv_einsum/k_einsum)"
    assert lora.names_for_regex("gemma3", gemma, num_layers=6) == ["k_proj"]
    with pytest.raises(lora.LoraError, match="unknown target modules \\['qkv'\\]"):
        lora.module_path_regex("llama3", ["qkv"])


def test_apply_lora_adds_adapters_only_where_asked(qwen3, mesh):
    model, _ = qwen3
    regex = lora.module_path_regex("qwen3", ["q_proj", "o_proj", "up_proj"])
    lora_model = lora.apply_lora(model, rank=4, alpha=8.0, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0))
    shapes = {key: tuple(value.shape) for key, value in lora.get_lora_params(lora_model).items()}
    assert shapes == {
        f"layers.{i}.{key}": shape
        for i in range(2)
        for key, shape in {
            "attn.q_proj.w_lora_a": (64, 4),
            "attn.q_proj.w_lora_b": (4, 4, 16),
            "attn.o_proj.w_lora_a": (4, 16, 4),
            "attn.o_proj.w_lora_b": (4, 64),
            "mlp.up_proj.kernel_lora_a": (64, 4),
            "mlp.up_proj.kernel_lora_b": (4, 128),
        }.items()
    }
    ids = np.arange(8)[None]
    np.testing.assert_array_equal(  # B starts at zero: the adapted model equals the base model
        run(lora_model, ids, ids, np.ones_like(ids)), run(model, ids, ids, np.ones_like(ids))
    )


def test_apply_lora_rejects_a_regex_matching_nothing(qwen3, mesh):
    model, _ = qwen3
    with pytest.raises(lora.LoraError, match="matches no module"):
        lora.apply_lora(model, rank=4, alpha=8.0, target_regex="layers/\\d+/nothing", mesh=mesh, rngs=nnx.Rngs(0))


def test_set_lora_params_checks_keys_and_shapes(qwen3, mesh):
    model, _ = qwen3
    regex = lora.module_path_regex("qwen3", ["v_proj"])
    lora_model = lora.apply_lora(model, rank=2, alpha=2.0, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0))
    params = {key: np.ones(value.shape, np.float32) for key, value in lora.get_lora_params(lora_model).items()}
    lora.set_lora_params(lora_model, params)
    assert all(np.all(np.asarray(v) == 1) for v in lora.get_lora_params(lora_model).values())
    with pytest.raises(lora.LoraError, match="missing \\['layers.0.attn.v_proj.w_lora_a'\\]"):
        lora.set_lora_params(lora_model, {k: v for k, v in params.items() if k != "layers.0.attn.v_proj.w_lora_a"})
    with pytest.raises(lora.LoraError, match="has shape \\(3,\\)"):
        lora.set_lora_params(lora_model, params | {"layers.0.attn.v_proj.w_lora_a": np.ones(3, np.float32)})


STATED_SIZE_DIFFERS = {"llama3.2-1b": 1.23e9}
"""Models whose name rounds their size further than the tolerance: the model card's count."""


@pytest.mark.parametrize("name", [name for name, info in catalog.MODELS.items() if info.hf_repo])
def test_every_catalogue_model_has_its_released_config_and_its_size(name):
    """A plan needs no network: each catalogue model's config.json facts ship with the trainer, and the model they
    build has the size its name says, within 20% (a wrong width or depth is further off; Gemma 4 E models: the
    effective size, without the per-layer input embeddings; MoE: the total, 30 of qwen3-30b-a3b)."""
    hf = catalog.released_config(name)
    family = models.family_for_hf_config(hf)
    assert family.name == catalog.MODELS[name].family
    state = nnx.state(models.abstract_model(family, family.config_from_hf(hf, jnp.bfloat16), hf))
    sizes = {".".join(map(str, path)): value.size for path, value in nnx.to_flat_state(state)}
    total = sum(size for path, size in sizes.items() if "per_layer_input_embedding" not in path)
    stated = STATED_SIZE_DIFFERS.get(name) or float(re.search(r"-e?(\d+(?:\.\d+)?)b", name).group(1)) * 1e9
    assert abs(total - stated) < 0.2 * stated, (name, total / 1e9)
