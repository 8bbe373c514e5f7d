"""The models lorajob knows by name (imports without JAX).

One place for the name -> family mapping that the LoRAJob API (its enum), the operator
(defaults such as the tokenizer) and the trainer (which model code to use) share.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any


@dataclass(frozen=True)
class ModelInfo:
    family: str
    """Model code family (a key of `models.FAMILIES`: qwen3, llama3, gemma3, qwen3-moe, gemma4)."""
    hf_repo: str | None
    """Default Hugging Face repo id of the base weights and tokenizer; None for generated tiny models."""


MODELS: dict[str, ModelInfo] = {
    "qwen3-0.6b": ModelInfo("qwen3", "Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": ModelInfo("qwen3", "Qwen/Qwen3-1.7B"),
    "qwen3-4b": ModelInfo("qwen3", "Qwen/Qwen3-4B"),
    "qwen3-8b": ModelInfo("qwen3", "Qwen/Qwen3-8B"),
    "qwen3-14b": ModelInfo("qwen3", "Qwen/Qwen3-14B"),
    "qwen3-32b": ModelInfo("qwen3", "Qwen/Qwen3-32B"),
    "qwen3-30b-a3b": ModelInfo("qwen3-moe", "Qwen/Qwen3-30B-A3B"),
    "qwen3-235b-a22b": ModelInfo("qwen3-moe", "Qwen/Qwen3-235B-A22B"),
    "llama3.1-8b": ModelInfo("llama3", "meta-llama/Llama-3.1-8B"),
    "llama3.1-70b": ModelInfo("llama3", "meta-llama/Llama-3.1-70B"),
    "llama3.2-1b": ModelInfo("llama3", "meta-llama/Llama-3.2-1B"),
    "llama3.2-3b": ModelInfo("llama3", "meta-llama/Llama-3.2-3B"),
    "gemma3-1b": ModelInfo("gemma3", "google/gemma-3-1b-pt"),
    "gemma3-4b": ModelInfo("gemma3", "google/gemma-3-4b-pt"),
    "gemma3-12b": ModelInfo("gemma3", "google/gemma-3-12b-pt"),
    "gemma3-27b": ModelInfo("gemma3", "google/gemma-3-27b-pt"),
    "gemma4-e2b": ModelInfo("gemma4", "google/gemma-4-E2B"),
    "gemma4-e4b": ModelInfo("gemma4", "google/gemma-4-E4B"),
    "gemma4-26b": ModelInfo("gemma4", "google/gemma-4-26B-A4B"),
    "gemma4-31b": ModelInfo("gemma4", "google/gemma-4-31B"),
    # Tiny random models the project generates itself (tests, demos); the family comes from config.json.
    "tiny-qwen3": ModelInfo("qwen3", None),
    "tiny-llama3": ModelInfo("llama3", None),
    "tiny-gemma3": ModelInfo("gemma3", None),
    "tiny-qwen3-moe": ModelInfo("qwen3-moe", None),
    "tiny-gemma4": ModelInfo("gemma4", None),
}


def family_of(model_name: str) -> str:
    try:
        return MODELS[model_name].family
    except KeyError:
        raise ValueError(f"unknown model {model_name!r}; known models: {', '.join(MODELS)}") from None


@functools.cache
def _released_configs() -> dict[str, dict[str, Any]]:
    return json.loads(resources.files("lorajob_trainer.contract").joinpath("released_configs.json").read_text())


def released_config(model_name: str) -> dict[str, Any]:
    """The facts of the model's released config.json (what a plan needs without the network); KeyError naming
    the models that have them. The Gemma 4 models' come from Tunix's ModelConfig presets (`gemma4_e2b`, `gemma4_e4b`,
    `gemma4_31b`, `gemma4_26b_a4b`), in the keys transformers' Gemma4TextConfig writes; those of qwen3-1.7b to -32b,
    Llama 3.2 and 3.1-70b and Gemma 3 agree with Tunix's presets and the model cards' parameter counts (a test
    holds every model to the size its name says); qwen3-235b-a22b's widths as the Qwen3-MoE family of
    qwen3-30b-a3b, from its published architecture (94 layers, 4,096 wide, 64/4 heads, 128 experts of 1,536, 8 per
    token)."""
    configs = _released_configs()
    if model_name not in configs:
        raise KeyError(f"no released config.json facts for {model_name!r}; known: {', '.join(configs)}")
    return dict(configs[model_name])


def at_depth(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config.json of the same model cut to its first `layers` decoder layers (its per-layer list of attention
    kinds cut to match): the real widths at a depth a bench can compile or a chip can hold."""
    shallower = dict(hf_config, num_hidden_layers=layers)
    if "layer_types" in shallower:
        shallower["layer_types"] = shallower["layer_types"][:layers]
    return shallower
