"""Our JAX models against transformers' PyTorch models on tiny random checkpoints (fp32).

Tolerance: max |logit difference| <= 1e-4 with logits of magnitude ~10 (observed ~1e-5).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from lorajob_trainer import convert, export, loading, lora, models, tiny
from lorajob_trainer.checkpoint import CheckpointMetadata
from trainer_testkit import GEMMA4_SHAPES, gemma4_checkpoint, random_adapters

pytestmark = [pytest.mark.torch, pytest.mark.slow(minutes=5)]
FAMILIES = ["qwen3", "llama3", "gemma3", "qwen3-moe"]
ATOL = 1e-4
SEQ = 40  # longer than the tiny Gemma 3 sliding window (4) and Llama 3.1's original context (64 / 4)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


CHECKPOINTS = FAMILIES + list(GEMMA4_SHAPES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (family, directory), each made once for the module; Gemma 4 checkpoints are written by
    transformers (one per size's features)."""
    made: dict[str, tuple[str, Path]] = {}

    def checkpoint(name: str) -> tuple[str, Path]:
        if name not in made:
            directory = tmp_path_factory.mktemp(name)
            made[name] = (("gemma4", gemma4_checkpoint(directory, name, seed=3)) if name in GEMMA4_SHAPES
                          else (name, tiny.make_tiny_checkpoint(name, directory, seed=3)))
        return made[name]

    return checkpoint


@pytest.fixture(scope="module", params=CHECKPOINTS)
def checkpoint(request, checkpoints):
    """(family, directory) of each checkpoint."""
    return checkpoints(request.param)


def tokens(batch: int = 2, length: int = SEQ, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, tiny.VOCAB_SIZE, (batch, length))


def jax_logits(model, ids: np.ndarray) -> np.ndarray:
    positions = np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1))
    segments = np.ones_like(ids)
    return np.asarray(models.forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(segments)))


def torch_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(ids)).logits.float().numpy()


def load_hf(directory):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )


def test_logits_match_transformers(checkpoint, mesh):
    family, directory = checkpoint
    model, _ = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    ids = tokens()
    np.testing.assert_allclose(jax_logits(model, ids), torch_logits(load_hf(directory), ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_unpatched_tunix_rope_is_wrong(family, mesh, checkpoints):
    """The Tunix 0.1.7 model with the same weights misses HF by far: the RoPE fix is what matters."""
    _, directory = checkpoints(family)
    model, spec = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    plain = nnx.eval_shape(lambda: spec.family.model_class(spec.tunix_config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(plain)
    unpatched = nnx.merge(graphdef, nnx.state(model))
    ids = tokens()
    reference = torch_logits(load_hf(directory), ids)
    assert np.abs(jax_logits(unpatched, ids) - reference).max() > 100 * ATOL
    np.testing.assert_allclose(jax_logits(model, ids), reference, atol=ATOL, rtol=0)


VARIANTS = ["lora", "rslora", "dora"]
RSLORA_ON = ("qwen3", "qwen3-moe")
"""rsLoRA changes only the adapters' scale (alpha/√r), the same code for every family: checked on a dense model and
on routed experts (their own adapters), not on each checkpoint again."""
CASES = [(name, variant) for name in CHECKPOINTS for variant in VARIANTS if variant != "rslora" or name in RSLORA_ON]
CASE_IDS = [f"{name}-{variant}" for name, variant in CASES]


def _alpha(variant: str) -> float:
    """Scale 2 either way (8/4; rsLoRA 4/√4), so float32 rounding stays as small; plain LoRA at alpha 4 would
    scale by 1, so a lost use_rslora shows."""
    return 4.0 if variant == "rslora" else 8.0


def variant_targets(family: str, variant: str) -> list[str]:
    """The family's default targets; for DoRA without routed experts (DoRA adapts projections only)."""
    targets = lora.default_targets(family)
    return [t.name for t in lora.target_modules(family, targets) if not t.parameter] if variant == "dora" else targets


def lora_model_with_random_adapters(family, directory, mesh, variant="lora", rank=4):
    model, spec = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    targets = variant_targets(family, variant)
    regex = lora.module_path_regex(family, targets)
    model = lora.apply_lora(model, rank=rank, alpha=_alpha(variant), target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0),
                            rslora=variant == "rslora", dora=variant == "dora")
    params = random_adapters(lora.get_lora_params(model))
    lora.set_lora_params(model, params)
    metadata = CheckpointMetadata(
        step=7,
        lora_rank=rank,
        lora_alpha=_alpha(variant),
        use_rslora=variant == "rslora",
        use_dora=variant == "dora",
        target_modules=targets,
        lora_module_path="",
        base_model=f"tiny-{family}",
        family=family,
        load_parameters_path=str(directory),
    )
    return model, params, metadata


@dataclasses.dataclass(frozen=True)
class SavedAdapter:
    family: str
    directory: Path
    """The base checkpoint."""
    step_dir: Path
    """Random adapters saved as the trainer saves them."""
    logits: np.ndarray
    """Our LoRA model's logits over `tokens()`."""


@pytest.fixture(scope="module")
def saved_adapters(checkpoints, mesh, tmp_path_factory):
    """(checkpoint name, variant) -> its random adapters, made and saved once for both exports."""
    made: dict[tuple[str, str], SavedAdapter] = {}

    def saved_adapter(name: str, variant: str) -> SavedAdapter:
        if (name, variant) not in made:
            family, directory = checkpoints(name)
            model, params, metadata = lora_model_with_random_adapters(family, directory, mesh, variant)
            step_dir = lora.save_adapter_checkpoint(tmp_path_factory.mktemp(f"{name}-{variant}") / "ckpt", params, metadata)
            made[name, variant] = SavedAdapter(family, directory, step_dir, jax_logits(model, tokens()))
        return made[name, variant]

    return saved_adapter


@pytest.mark.parametrize(("name", "variant"), CASES, ids=CASE_IDS)
def test_exported_adapter_matches_peft(saved_adapters, name, variant, tmp_path):
    from peft import PeftModel

    saved_adapter = saved_adapters(name, variant)
    out = export.export_adapter(saved_adapter.step_dir, tmp_path / "adapter")
    base = load_hf(saved_adapter.directory)
    ids = tokens()
    assert np.abs(saved_adapter.logits - torch_logits(base, ids)).max() > 100 * ATOL  # the adapters do change the output
    np.testing.assert_allclose(saved_adapter.logits, torch_logits(PeftModel.from_pretrained(base, out), ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=CASE_IDS)
def test_merged_export_matches_lora_model(saved_adapters, name, variant, tmp_path):
    saved_adapter = saved_adapters(name, variant)
    merged = export.export_merged(saved_adapter.step_dir, tmp_path / "merged")
    np.testing.assert_allclose(saved_adapter.logits, torch_logits(load_hf(merged), tokens()), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("name", "variant"), CASES, ids=CASE_IDS)
def test_peft_made_adapter_converts_to_peft_logits(checkpoints, mesh, tmp_path, name, variant):
    """An adapter PEFT wrote (k_proj and v_proj with their own lora_A) converts in and gives PEFT's logits."""
    from peft import PeftModel
    from safetensors.numpy import load_file
    from test_convert_export import make_peft_adapter

    family, directory = checkpoints(name)
    adapter = make_peft_adapter(family, directory, tmp_path / "adapter", variant=variant)
    tensors = load_file(adapter / "adapter_model.safetensors")
    attn = f"{lora.PEFT_PREFIX}.0.self_attn"
    assert not np.array_equal(tensors[f"{attn}.k_proj.lora_A.weight"], tensors[f"{attn}.v_proj.lora_A.weight"])
    params, metadata = lora.load_adapter_checkpoint(
        convert.convert_adapter(f"tiny-{family}", directory, adapter, tmp_path / "converted")
    )
    model, _ = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    regex = lora.module_path_regex(family, metadata.target_modules)
    assert (metadata.use_rslora, metadata.use_dora) == (variant == "rslora", variant == "dora")
    model = lora.apply_lora(
        model, rank=metadata.lora_rank, alpha=metadata.lora_alpha, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0),
        rslora=metadata.use_rslora, dora=metadata.use_dora,
    )
    lora.set_lora_params(model, params)
    ids = tokens()
    peft_logits = torch_logits(PeftModel.from_pretrained(load_hf(directory), adapter), ids)
    np.testing.assert_allclose(jax_logits(model, ids), peft_logits, atol=ATOL, rtol=0)
