"""Shared builders for the trainer-loop tests: a byte-level tokenizer, datasets, a tiny LoRA model.

Everything is generated locally; nothing comes from the Hugging Face Hub.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np


def tiny_checkpoint(directory: Path, family: str = "qwen3", **overrides) -> Path:
    """A tiny random HF checkpoint with its tokenizer (lorajob_trainer.tiny), made once per directory."""
    from lorajob_trainer import tiny

    if not (directory / "config.json").is_file():
        tiny.make_tiny_checkpoint(family, directory, **overrides)
    return directory


def arithmetic_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Question/answer rows with a learnable pattern (two-digit addition)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        rows.append({"question": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def interim_lora_loader(config, mesh, dtype):
    """`load_model` for `train()` until lorajob_trainer.lora lands: part A's loader + qwix LoRA."""
    import qwix
    from flax import nnx

    from lorajob_trainer import models
    from lorajob_trainer.train import LoraModel, attention_width

    model, spec = models.load_model(config.model_name, config.load_parameters_path, mesh=mesh, dtype=dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    provider = qwix.LoraProvider(
        module_path="|".join(f".*{t}" for t in targets), rank=config.lora.lora_rank, alpha=config.lora.lora_alpha
    )
    dummy = {"input_tokens": np.ones((mesh.size, 1), np.int32), "positions": np.zeros((mesh.size, 1), np.int32),
             "cache": None, "attention_mask": np.ones((mesh.size, 1, 1), bool)}
    model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(config.seed), **dummy)
    return LoraModel(model, targets, attention_width(spec.tunix_config))
