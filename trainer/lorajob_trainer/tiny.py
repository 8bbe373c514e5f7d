"""Tiny random models in Hugging Face format, plus a tiny tokenizer, built offline.

Used by the tests and the demo: `python -m lorajob_trainer.tiny --family qwen3 --out DIR` writes
config.json, model.safetensors (or several shards), generation_config.json and a tokenizer trained
here with the `tokenizers` library (BPE over generated text, with a chat template). Needs neither
the Hugging Face Hub nor torch.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Any

import numpy as np

VOCAB_SIZE = 256
SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<|im_start|>", "<|im_end|>")
PAD_ID, UNK_ID, BOS_ID, IM_START_ID, EOS_ID = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
}

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # rope_theta != 1e6 on purpose: Tunix 0.1.7's attention ignores it (see models/attention.py).
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_act": "silu",
        "rope_theta": 10_000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # Llama 3.1 frequency scaling with a short original context, so it changes several frequencies.
    "llama3": {
        **_COMMON,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "rope_theta": 500_000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
    # Four experts, top-2, without renormalising the top-k weights (transformers' default; Tunix always
    # renormalises, see models/qwen3_moe.py); rope_theta != 1e6 as for qwen3.
    "qwen3-moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "moe_intermediate_size": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    # Six layers so the Gemma 3 pattern reaches its global layer (theta 1e6, linear scaling 8).
    "gemma3": {
        **_COMMON,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1_000_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 16,
        "sliding_window": 4,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    if family not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for family {family!r}; families: {', '.join(TINY_CONFIGS)}")
    return {**TINY_CONFIGS[family], **overrides}


def random_hf_weights(hf_config: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 HF tensors for `hf_config` (norm weights near their neutral value)."""
    import jax.numpy as jnp
    from flax import nnx

    from lorajob_trainer import models, weights

    family = models.family_for_hf_config(hf_config)
    tunix_config = family.config_from_hf(hf_config, jnp.float32)
    abstract = models.abstract_model(family, tunix_config, hf_config)
    shapes = {weights.path_key(path): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(nnx.state(abstract))}
    rng = np.random.default_rng(seed)
    neutral_norm = 0.0 if family.name == "gemma3" else 1.0  # Gemma scales by (1 + w)
    params = {
        key: (
            neutral_norm + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.2 * rng.standard_normal(shape)
        ).astype(np.float32)
        for key, shape in sorted(shapes.items())
    }
    return weights.hf_tensors(params, family.tensor_maps(tunix_config))


def write_hf_checkpoint(
    directory: str | Path, hf_config: dict[str, Any], tensors: dict[str, np.ndarray], *, shards: int = 1
) -> Path:
    """config.json, generation_config.json and safetensors (`shards` files)."""
    from lorajob_trainer import weights

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}) + "\n"
    )
    weights.save_hf_safetensors(directory, tensors, shards=shards)
    return directory


def make_tiny_checkpoint(
    family: str, directory: str | Path, *, seed: int = 0, shards: int = 1, tokenizer: bool = True, **overrides: Any
) -> Path:
    """A tiny random HF checkpoint of `family` in `directory`; `overrides` change config.json keys."""
    hf_config = tiny_config(family, **overrides)
    directory = write_hf_checkpoint(directory, hf_config, random_hf_weights(hf_config, seed), shards=shards)
    if tokenizer:
        write_tiny_tokenizer(directory)
    return directory


def _training_text(seed: int = 0, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "a", "model", "adapter", "learns", "to", "add", "numbers", "answer", "is", "what", "plus"]
    text = []
    for _ in range(lines):
        a, b = rng.randrange(100), rng.randrange(100)
        text.append(f"what is {a} plus {b}? the answer is {a + b}.")
        text.append(" ".join(rng.choice(words) for _ in range(8)))
    return text


def write_tiny_tokenizer(directory: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (chat template, special tokens) loadable by AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(string.printable.strip() + "\n▁"),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens > {VOCAB_SIZE}")
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args(argv)
    print(make_tiny_checkpoint(args.family, args.out, seed=args.seed, shards=args.shards))


if __name__ == "__main__":
    main()
