"""Shared builders for the trainer-loop tests: tiny checkpoints (with tokenizer) and datasets.

Everything is generated locally; nothing comes from the Hugging Face Hub.
"""

from __future__ import annotations

from pathlib import Path

from lorajob_trainer.demo import arithmetic_rows, write_jsonl

__all__ = ["arithmetic_rows", "base_args", "free_port", "tiny_checkpoint", "trainer_env", "write_jsonl"]


def tiny_checkpoint(directory: Path, family: str = "qwen3", **overrides) -> Path:
    """A tiny random HF checkpoint with its tokenizer (lorajob_trainer.tiny), made once per directory."""
    from lorajob_trainer import tiny

    if not (directory / "config.json").is_file():
        tiny.make_tiny_checkpoint(family, directory, **overrides)
    return directory


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
