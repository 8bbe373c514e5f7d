"""QLoRA (lora.base_quantization): the frozen decoder projections held quantised per output channel by Qwix, the
adapters in full precision; a run trains and exports an ordinary PEFT adapter for the unquantised base."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer.contract import config as config_lib
from lorajob_trainer import export, loading, lora, models
from lorajob_trainer import train as train_lib

STEPS = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


def _weights(model: nnx.Module, kind) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, kind))}


def test_every_decoder_projection_is_held_quantised_and_adapters_only_on_the_targets(tiny_model):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model, _ = loading.load_model("tiny-qwen3", tiny_model, mesh=mesh, dtype=jnp.float32)
    loaded = _weights(model, nnx.Param)
    targets = ["q_proj", "v_proj"]
    adapted = lora.apply_lora(model, rank=4, alpha=8.0, target_regex=lora.module_path_regex("qwen3", targets), mesh=mesh,
                              rngs=nnx.Rngs(0), base_quantization="int8")
    held = _weights(adapted, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    quantised = sorted(key.removesuffix(".array.qvalue") for key in held if key.endswith(".array.qvalue"))
    projections = sorted(key for key, value in loaded.items() if key.startswith("layers.") and value.ndim >= 2)
    assert quantised == projections, "every decoder projection, adapted or not, and nothing else"
    assert "embedder.input_embedding" in held and held["embedder.input_embedding"].dtype == jnp.float32
    for key in quantised:
        qvalue, scale = held[f"{key}.array.qvalue"], held[f"{key}.array.scale"]
        assert qvalue.dtype == jnp.int8
        weight = np.asarray(loaded[key], np.float32).reshape(qvalue.shape)
        error = np.abs(np.asarray(qvalue, np.float32) * np.asarray(scale) - weight)
        assert np.all(error <= np.asarray(scale) / 2 + 1e-7), f"{key} is the loaded weight, quantised per channel"
    adapters = _weights(adapted, nnx.LoRAParam)
    assert sorted({key.split(".")[3] for key in adapters}) == targets
    assert {value.dtype for value in adapters.values()} == {jnp.dtype(jnp.float32)}


def test_routed_experts_are_held_quantised_and_the_routers_as_loaded(tmp_path):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    directory = tiny_checkpoint(tmp_path / "moe", "qwen3-moe")
    model, _ = loading.load_model("tiny-qwen3-moe", directory, mesh=mesh, dtype=jnp.float32)
    loaded = _weights(model, nnx.Param)
    adapted = lora.apply_lora(model, rank=4, alpha=8.0, target_regex=lora.module_path_regex("qwen3-moe"), mesh=mesh,
                              rngs=nnx.Rngs(0), base_quantization="int8")
    held = _weights(adapted, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    experts = sorted(key.removesuffix(".w_scale") for key in held if key.endswith(".w_scale"))
    assert experts and all(".experts." in key or "_proj" in key for key in experts), experts
    for key in experts:
        qvalue, scale = held[f"{key}.w"], held[f"{key}.w_scale"]
        assert qvalue.dtype == jnp.int8 and scale.shape == (qvalue.shape[0], 1, qvalue.shape[2])
        error = np.abs(np.asarray(qvalue, np.float32) * np.asarray(scale) - np.asarray(loaded[f"{key}.w"], np.float32))
        assert np.all(error <= np.asarray(scale) / 2 + 1e-7), key
    routers = [key for key in held if key.endswith("router.kernel")]
    assert routers and all(held[key].dtype == jnp.float32 for key in routers)
    adapters = _weights(adapted, nnx.LoRAParam)
    # Every quantised expert projection (and attention projection) carries its own adapter pair.
    assert {key.removesuffix(".w_lora_a") for key in adapters if key.endswith(".w_lora_a")} >= set(experts), adapters
    assert {value.dtype for value in adapters.values()} == {jnp.dtype(jnp.float32)}
    ids = jnp.zeros((1, 8), jnp.int32)
    logits = models.forward(adapted, ids, jnp.arange(8)[None], jnp.ones((1, 8), jnp.int32))
    assert np.all(np.isfinite(np.asarray(logits)))


def test_dora_on_a_quantised_base_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="needs the base weights in full precision") as refused:
        config_lib.LoraConfig(use_dora=True, base_quantization="int8")
    assert "baseQuantization to none" in str(refused.value)  # the way out, in the error the user reads


@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_a_qlora_run_trains_and_exports_an_ordinary_adapter_for_the_unquantised_base(tiny_model, tmp_path, quantization):
    data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(200))
    args = base_args(tiny_model, tmp_path / "out", data, f"steps={STEPS}", "checkpoint_period=1000",
                     "enable_tensorboard=False", f"lora.base_quantization={quantization}")
    assert train_lib.main(args) == 0
    run = tmp_path / "out" / "run"
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses) == STEPS and np.mean(losses[-4:]) < 0.7 * np.mean(losses[:3]), losses

    adapter = export.export_adapter(run / "checkpoints" / str(STEPS), tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and not any("quant" in key for key in config)
    with safe_open(adapter / "adapter_model.safetensors", "np") as tensors:
        assert tensors.metadata()["lorajob.base_quantization"] == quantization
        assert all(tensors.get_tensor(name).dtype == np.float32 for name in tensors.keys())


def test_planning_counts_four_bit_weights_at_half_a_byte():
    from lorajob_trainer import plan

    four_bit = [jax.ShapeDtypeStruct((1024, 3), dtype) for dtype in (jnp.int4, jnp.uint4)]
    assert plan.per_chip_bytes(four_bit) == 2 * 1536
    assert plan.per_chip_bytes([jax.ShapeDtypeStruct((1024, 3), jnp.int8)]) == 3072
