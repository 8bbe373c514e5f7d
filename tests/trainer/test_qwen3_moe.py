"""Qwen3 MoE beyond the shared parity tests (test_parity.py runs logits, PEFT both ways and merged
export for it): the routing difference from Tunix, per-expert adapters in PEFT's expert format,
config checks and refusals, the Orbax base, and a short training run (expert adapters train, MFU counts
active parameters)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from lorajob_trainer import export, loading, lora, models, tiny, weights
from lorajob_trainer.checkpoint import CheckpointMetadata
from lorajob_trainer.models import families
from trainer_testkit import random_adapters
from test_parity import ATOL, jax_logits, load_hf, mesh, tokens, torch_logits  # noqa: F401

pytestmark = pytest.mark.torch
FAMILY = "qwen3-moe"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def load(directory, mesh):
    return loading.load_model(f"tiny-{FAMILY}", directory, mesh=mesh, dtype=jnp.float32)


def with_tunix_moe(model, spec):
    """The same weights in Tunix 0.1.7's own MoELayer (our RoPE fix kept: only the MoE block differs)."""
    plain = nnx.eval_shape(lambda: families.Family.build(spec.family, spec.tunix_config, spec.hf_config, nnx.Rngs(0)))
    graphdef, state = nnx.split(plain)
    ours = {weights.path_key(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
    flat = nnx.to_flat_state(state)
    for path, variable in flat:
        key = weights.path_key(path)
        layer, _, rest = key.partition(".mlp.")
        if rest in ("gate_proj", "up_proj"):
            value = ours[f"{layer}.mlp.experts.gate_up_proj.w"][0 if rest == "gate_proj" else 1 :: 2]
        elif rest == "down_proj":
            value = ours[f"{layer}.mlp.experts.down_proj.w"]
        else:
            value = ours[key]
        variable.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize("normalize", [False, True])
def test_tunix_moe_renormalises_top_k_where_transformers_does_not(normalize, mesh, tmp_path):
    """With norm_topk_prob false (transformers' default) Tunix's MoELayer misses HF; with true it agrees,
    so the top-k normalisation is the difference our block fixes. Ours matches HF in both."""
    directory = tiny.make_tiny_checkpoint(FAMILY, tmp_path, seed=3, tokenizer=False, norm_topk_prob=normalize)
    model, spec = load(directory, mesh)
    ids = tokens()
    reference = torch_logits(load_hf(directory), ids)
    np.testing.assert_allclose(jax_logits(model, ids), reference, atol=ATOL, rtol=0)
    tunix_error = np.abs(jax_logits(with_tunix_moe(model, spec), ids) - reference).max()
    if normalize:
        assert tunix_error <= ATOL
    else:
        assert tunix_error > 100 * ATOL


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_tiny_checkpoint(FAMILY, tmp_path_factory.mktemp(FAMILY), seed=3, tokenizer=False)


def test_expert_adapters_are_per_expert_and_load_in_peft(checkpoint, mesh, tmp_path):
    """Expert-only LoRA: one rank-r adapter per expert, exported in PEFT's ParamWrapper layout, equal logits."""
    from peft import PeftModel

    rank, alpha = 3, 6.0
    model, spec = load(checkpoint, mesh)
    config = spec.tunix_config
    regex = lora.module_path_regex(FAMILY, EXPERTS)
    model = lora.apply_lora(model, rank=rank, alpha=alpha, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0))
    params = random_adapters(lora.get_lora_params(model))
    experts_, dim, hidden = config.num_experts, config.embed_dim, config.hidden_dim
    assert {k: v.shape for k, v in params.items() if k.startswith("layers.0.")} == {
        "layers.0.mlp.experts.gate_up_proj.w_lora_a": (experts_, dim, rank),
        "layers.0.mlp.experts.gate_up_proj.w_lora_b": (experts_, rank, 2 * hidden),
        "layers.0.mlp.experts.down_proj.w_lora_a": (experts_, hidden, rank),
        "layers.0.mlp.experts.down_proj.w_lora_b": (experts_, rank, dim),
    }
    lora.set_lora_params(model, params)
    metadata = CheckpointMetadata(
        step=1, lora_rank=rank, lora_alpha=alpha, target_modules=EXPERTS, lora_module_path="",
        base_model=f"tiny-{FAMILY}", family=FAMILY, load_parameters_path=str(checkpoint),
    )  # fmt: skip
    out = export.export_adapter(lora.save_adapter_checkpoint(tmp_path / "ckpt", params, metadata), tmp_path / "peft")
    ids = tokens()
    base = load_hf(checkpoint)
    base_logits = torch_logits(base, ids)
    ours = jax_logits(model, ids)
    assert np.abs(ours - base_logits).max() > 100 * ATOL
    peft_model = PeftModel.from_pretrained(base, out)
    assert set(peft_model.peft_config["default"].target_parameters) == set(EXPERTS)
    np.testing.assert_allclose(ours, torch_logits(peft_model, ids), atol=ATOL, rtol=0)


def test_each_expert_has_its_own_adapter(checkpoint, mesh):
    """Changing expert 1's adapter changes only the tokens routed to expert 1."""
    model, _ = load(checkpoint, mesh)
    regex = lora.module_path_regex(FAMILY, ["mlp.experts.down_proj"])
    model = lora.apply_lora(model, rank=2, alpha=2.0, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0))
    ids = tokens()
    before = jax_logits(model, ids)
    params = {k: np.array(v) for k, v in lora.get_lora_params(model).items()}
    key = "layers.1.mlp.experts.down_proj.w_lora_b"
    params[key][1] = 1.0
    lora.set_lora_params(model, params)
    changed = np.abs(jax_logits(model, ids) - before).max(axis=-1) > 0
    assert 0 < changed.sum() < changed.size


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mlp_only_layers": [1]}, "mlp_only_layers=\\[1\\]"),
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is not within 1..num_experts=4"),
    ],
)
def test_unsupported_configs_are_refused(overrides, message):
    hf = tiny.tiny_config(FAMILY, **overrides)
    with pytest.raises(models.ModelConfigError, match=message):
        models.family_for_hf_config(hf).config_from_hf(hf, jnp.float32)


def test_a_config_saved_by_current_transformers_builds_the_same_model():
    """transformers 5 saves the expert count as num_local_experts (Qwen3MoeConfig's attribute_map)."""
    from transformers import Qwen3MoeConfig

    released = tiny.tiny_config(FAMILY)
    saved = Qwen3MoeConfig(**released).to_dict()
    assert "num_local_experts" in saved and "num_experts" not in saved
    family = models.family_for_hf_config(saved)
    assert family.config_from_hf(saved, jnp.float32) == family.config_from_hf(released, jnp.float32)


def test_training_moves_every_expert_adapter_and_lowers_the_loss(tmp_path):
    from lorajob_trainer import train as train_lib
    from lorajob_trainer.contract.config import TrainConfig
    from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

    model_dir = tiny_checkpoint(tmp_path / "model", family=FAMILY)
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(64))
    config = TrainConfig.from_args(
        base_args(
            model_dir, tmp_path / "out", train_file, f"model_name=tiny-{FAMILY}", "steps=12", "checkpoint_period=12"
        )
    )
    trainer = train_lib.build_trainer(config)
    before = {name: np.array(value) for name, value in trainer.lora.items()}
    # MFU counts the parameters a token uses: top-2 of 4 experts, so half of each expert stack.
    hf = tiny.tiny_config(FAMILY)
    d, f, e, layers = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_experts"], hf["num_hidden_layers"]
    attention = d * 4 * 16 * 2 + d * 2 * 16 * 2
    experts_active = 3 * d * f * e * hf["num_experts_per_tok"] // e
    assert trainer.run.flops.frozen_matmul_params == layers * (attention + d * e + experts_active) + d * hf["vocab_size"]
    expert_adapters = sum(v.size for name, v in before.items() if ".experts." in name)
    assert expert_adapters > 0
    other_adapters = sum(v.size for name, v in before.items() if ".experts." not in name)
    assert trainer.run.flops.adapter_params == other_adapters + expert_adapters // 2
    trainer.train()
    trainer.close()
    moved = [name for name, value in before.items() if not np.array_equal(value, np.asarray(trainer.lora[name]))]
    assert sorted(moved) == sorted(before)
    records = [json.loads(line) for line in (config.run_directory / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses


def test_orbax_base_checkpoint_loads_the_same_model(checkpoint, mesh, tmp_path):
    from lorajob_trainer import convert

    converted = convert.convert_base(f"tiny-{FAMILY}", checkpoint, tmp_path / "base", dtype=jnp.float32)
    ids = tokens()
    np.testing.assert_array_equal(jax_logits(load(converted, mesh)[0], ids), jax_logits(load(checkpoint, mesh)[0], ids))
