"""Shared builders for the trainer-loop tests: tiny checkpoints (with tokenizer) and datasets.

Everything is generated locally; nothing comes from the Hugging Face Hub.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from lorajob_trainer.demo import arithmetic_rows, preference_rows, write_jsonl

__all__ = [
    "GEMMA4_SHAPES",
    "arithmetic_rows",
    "base_args",
    "free_port",
    "gemma4_checkpoint",
    "preference_rows",
    "random_adapters",
    "tiny_checkpoint",
    "trainer_env",
    "write_jsonl",
]


def tiny_checkpoint(directory: Path, family: str = "qwen3", **overrides) -> Path:
    """A tiny random HF checkpoint with its tokenizer (lorajob_trainer.tiny), made once per directory."""
    from lorajob_trainer import tiny

    if not (directory / "config.json").is_file():
        tiny.make_tiny_checkpoint(family, directory, **overrides)
    return directory


def random_adapters(adapters: dict[str, Any], seed: int = 5) -> dict[str, np.ndarray]:
    """Adapters like `adapters` (by name) with random A and B; a DoRA magnitude moved randomly off its value (the
    weight's norms as initialised) by up to ~30 %."""
    from lorajob_trainer import lora

    rng = np.random.default_rng(seed)
    return {
        key: (np.asarray(value) * (1 + 0.3 * rng.standard_normal(value.shape)) if key.endswith(lora.MAGNITUDE)
              else 0.3 * rng.standard_normal(value.shape)).astype(np.float32)
        for key, value in adapters.items()
    }


def base_args(model_dir: Path, output_dir: Path, train_file: Path, *overrides: str) -> list[str]:
    """`key=value` arguments of a small run on a tiny model with question/answer data."""
    return [
        "run_name=run",
        f"base_output_directory={output_dir}",
        "model_name=tiny-qwen3",
        f"load_parameters_path={model_dir}",
        f"hf_train_files=['{train_file}']",
        "train_data_columns=['question','answer']",
        "max_target_length=64",
        "per_device_batch_size=4",
        "lora.lora_rank=4",
        "lora.lora_alpha=8",
        "learning_rate=1e-2",
        *overrides,
    ]


def trainer_env(devices: int | None = None) -> dict[str, str]:
    """The environment of a trainer subprocess: this checkout's trainer package, JAX on CPU, no network;
    `devices` CPU devices (None: as many as this process has, so in-process and subprocess runs agree)."""
    import os

    repo_root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo_root / "trainer"), os.environ.get("PYTHONPATH", "")]),
        "JAX_PLATFORMS": "cpu",
        "HF_HUB_OFFLINE": "1",
    }
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a jax.distributed coordinator)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_GEMMA4_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    final_logit_softcapping=30.0,
    max_position_embeddings=512,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
)
GEMMA4_SHAPES = {
    # 31B: 5 sliding : 1 global, global layers with k = v, their own KV-head count and head size, partial RoPE.
    "gemma4-31b": dict(
        _GEMMA4_TEXT,
        num_hidden_layers=6,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=0,
    ),
    # 26B-A4B: the 31B's attention; a dense MLP beside 4 routed experts, 2 per token.
    "gemma4-26b": dict(
        _GEMMA4_TEXT,
        num_hidden_layers=6,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        hidden_size_per_layer_input=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    # E2B/E4B: per-layer inputs, the last 5 layers (sliding and global) reuse earlier layers' keys and
    # values, double-wide MLP there; 4 sliding : 1 global as in E2B.
    "gemma4-e2b": dict(
        _GEMMA4_TEXT,
        num_hidden_layers=10,
        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        num_kv_shared_layers=5,
        use_double_wide_mlp=True,
    ),
}


def gemma4_checkpoint(
    directory: Path, shape: str, *, multimodal: bool = False, seed: int = 0, **overrides: Any
) -> Path:
    """A tiny random Gemma 4 checkpoint written by transformers from its own config classes (GEMMA4_SHAPES,
    `overrides` on top); `multimodal`: the Gemma4ForConditionalGeneration layout with a tiny vision tower. Every weight is
    drawn at random (norm scales near 1) so that each takes part in the logits; query and key norm
    scales near 1/2, as Gemma 4 attends without 1/sqrt(head_dim) and full-scale ones make the
    softmax so sharp that float32 rounding alone moves logits by ~1e-4."""
    import torch
    import transformers

    if (directory / "config.json").is_file():
        return directory
    text = transformers.Gemma4TextConfig(**{**GEMMA4_SHAPES[shape], **overrides})
    if multimodal:
        vision = transformers.Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16,
        )
        model = transformers.Gemma4ForConditionalGeneration(
            transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
        )
    else:
        model = transformers.Gemma4ForCausalLM(text)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "inv_freq" not in name and "embed_scale" not in name:
                noise = torch.randn(tensor.shape, generator=generator)
                center = 0.5 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
                tensor.copy_(center + 0.1 * noise if tensor.ndim == 1 else 0.2 * noise)
    model.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def splash_in_interpreter() -> Iterator[None]:
    """The splash kernel wherever a TPU would run it (a training forward on a mesh, lengths its blocks divide:
    `splash.applies`' rule without the platform), in Pallas' interpreter: the kernel's path through a model, on a
    CPU."""
    import jax
    import pytest

    from lorajob_trainer.models import splash

    kernel = splash._kernel

    def applies(batch, length, heads, kv_heads, cache, mask):
        mesh = jax.sharding.get_abstract_mesh()
        return cache is None and mask is not None and not mesh.empty and length % splash.BLOCK == 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splash, "applies", applies)
        patch.setattr(splash, "_kernel", lambda heads, length, head_dim, window, interpret: kernel(
            heads, length, head_dim, window, True))
        yield
