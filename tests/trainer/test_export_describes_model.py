"""The exported adapter and merged model are the model that was trained, and say so.

One short real run (`python -m lorajob_trainer.train`) on a tiny Qwen3 with a non-default shape
(3 layers) and a non-default adapter (rank 4, alpha 8, three of the seven projections), then
`python -m lorajob_trainer.export --merged`. Checked against what the run was asked to do and
against independent arithmetic / implementations:

- merged weights = base + (alpha / r) * B @ A for exactly the adapted tensors, all others bit-equal;
- merged logits (Hugging Face transformers) = our LoRA model's logits (JAX) = base + PEFT adapter
  logits (transformers + peft);
- config.json / adapter_config.json state the layers, dtype, rank, alpha and target modules trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from trainer_testkit import arithmetic_rows, tiny_checkpoint, write_jsonl

pytestmark = pytest.mark.torch

REPO_ROOT = Path(__file__).resolve().parents[2]
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "v_proj", "down_proj"]
UNTARGETED = ["k_proj", "o_proj", "gate_proj", "up_proj"]
NUM_LAYERS = 3
LOGITS_TOLERANCE = 2e-4
"""float32 throughout; XLA and PyTorch sum in different orders."""


def run_module(module: str, *arguments: str, cwd: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "trainer"), os.environ.get("PYTHONPATH", "")]),
        "JAX_PLATFORMS": "cpu",
    }
    completed = subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True, env=env,
                               timeout=600, cwd=cwd)
    assert completed.returncode == 0, f"{module} failed:\n{completed.stdout[-2000:]}\n{completed.stderr[-4000:]}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("export")
    base = tiny_checkpoint(root / "base", num_hidden_layers=NUM_LAYERS)
    data = write_jsonl(root / "train.jsonl", arithmetic_rows(64))
    run_module(
        "lorajob_trainer.train",
        "run_name=run", f"base_output_directory={root / 'out'}", "model_name=tiny-qwen3",
        f"load_parameters_path={base}", f"hf_train_files=['{data}']", "train_data_columns=['question','answer']",
        "steps=3", "per_device_batch_size=2", "max_target_length=64", "learning_rate=2e-2",
        f"lora.lora_rank={RANK}", f"lora.lora_alpha={ALPHA}", f"lora.target_modules={json.dumps(TARGETS)}",
        "enable_tensorboard=False", "async_checkpointing=False",
        cwd=root,
    )
    checkpoint = root / "out" / "run" / "checkpoints"
    run_module("lorajob_trainer.export", "--checkpoint", str(checkpoint), "--out", str(root / "export"), "--merged",
               cwd=root)
    return {"base": base, "checkpoint": checkpoint, "adapter": root / "export", "merged": root / "export" / "merged"}


def read_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    assert tensors, f"no safetensors in {directory}"
    return tensors


def peft_delta(adapter: dict[str, np.ndarray], layer: int, module: str) -> np.ndarray:
    """(alpha / r) * B @ A in float64 from the exported PEFT tensors (A: [r, in], B: [out, r])."""
    prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module == 'down_proj' else 'self_attn'}.{module}"
    a = adapter[f"{prefix}.lora_A.weight"].astype(np.float64)
    b = adapter[f"{prefix}.lora_B.weight"].astype(np.float64)
    return (ALPHA / RANK) * (b @ a)


def hf_name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}.weight"


# ---------------------------------------------------------------- the descriptions


def test_adapter_config_describes_the_trained_adapter(exported):
    config = json.loads((exported["adapter"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["r"] == RANK
    assert config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert config["base_model_name_or_path"], "adapter_config.json names no base model"
    adapter = load_file(exported["adapter"] / "adapter_model.safetensors")
    adapted = {(int(key.split(".")[4]), key.split(".")[6]) for key in adapter}
    assert adapted == {(layer, module) for layer in range(NUM_LAYERS) for module in TARGETS}


def test_merged_config_describes_the_trained_model(exported):
    base_config = json.loads((exported["base"] / "config.json").read_text())
    merged_config = json.loads((exported["merged"] / "config.json").read_text())
    for key in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "tie_word_embeddings"):
        assert merged_config.get(key) == base_config[key], f"config.json {key}: {merged_config.get(key)!r}"
    assert merged_config["num_hidden_layers"] == NUM_LAYERS
    dtype = merged_config.get("torch_dtype") or merged_config.get("dtype")
    assert dtype == "float32"
    stored = {str(t.dtype) for t in read_tensors(exported["merged"]).values()}
    assert stored == {dtype}, f"config.json says {dtype}, the weights are {stored}"


# ---------------------------------------------------------------- the weights


def test_merged_weights_are_base_plus_exactly_the_lora_delta(exported):
    base = read_tensors(exported["base"])
    merged = read_tensors(exported["merged"])
    adapter = load_file(exported["adapter"] / "adapter_model.safetensors")
    assert set(merged) == set(base)
    for layer in range(NUM_LAYERS):
        for module in TARGETS:
            name = hf_name(layer, module)
            delta = peft_delta(adapter, layer, module)
            assert np.abs(delta).max() > 1e-4, f"{name}: the trained adapter is still zero (B unchanged)"
            np.testing.assert_allclose(merged[name].astype(np.float64) - base[name], delta, rtol=0, atol=1e-6,
                                       err_msg=name)
    adapted = {hf_name(layer, module) for layer in range(NUM_LAYERS) for module in TARGETS}
    for name in sorted(set(base) - adapted):
        assert np.array_equal(merged[name], base[name]), f"{name} changed although no adapter targets it"
    assert all(hf_name(0, module) not in adapted for module in UNTARGETED)


def sample_tokens(model_dir: Path) -> np.ndarray:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = arithmetic_rows(2, seed=7)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"]},
                                            {"role": "assistant", "content": r["answer"]}], tokenize=False)
             for r in rows]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = min(len(i) for i in ids)
    return np.array([i[:length] for i in ids], dtype=np.int32)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def our_lora_logits(exported, tokens: np.ndarray) -> np.ndarray:
    """The trained LoRA model as the trainer runs it: base weights + adapters from the checkpoint."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    from lorajob_trainer import loading, lora, models

    params, metadata = lora.load_adapter_checkpoint(exported["checkpoint"])
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    model, spec = loading.load_model("tiny-qwen3", exported["base"], mesh=mesh, dtype=jnp.float32)
    model = lora.apply_lora(model, rank=RANK, alpha=ALPHA, target_regex=lora.module_path_regex(spec.family.name, TARGETS),
                            mesh=mesh, rngs=nnx.Rngs(0))
    lora.set_lora_params(model, params)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(models.forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.ones_like(tokens)))


def test_merged_logits_equal_the_lora_models(exported):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = sample_tokens(exported["base"])
    merged = torch_logits(AutoModelForCausalLM.from_pretrained(exported["merged"]).eval(), tokens)
    base_model = AutoModelForCausalLM.from_pretrained(exported["base"]).eval()
    base = torch_logits(base_model, tokens)
    with_adapter = torch_logits(PeftModel.from_pretrained(base_model, exported["adapter"]).eval(), tokens)
    ours = our_lora_logits(exported, tokens)

    assert np.abs(merged - base).max() > 10 * LOGITS_TOLERANCE, "the merged model predicts like the base model"
    np.testing.assert_allclose(merged, ours, rtol=0, atol=LOGITS_TOLERANCE, err_msg="merged vs our LoRA model")
    np.testing.assert_allclose(merged, with_adapter, rtol=0, atol=LOGITS_TOLERANCE, err_msg="merged vs base + PEFT")
