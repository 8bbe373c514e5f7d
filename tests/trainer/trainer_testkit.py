"""Shared builders for the trainer-loop tests: tiny checkpoints (with tokenizer) and datasets.

Everything is generated locally; nothing comes from the Hugging Face Hub.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


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
