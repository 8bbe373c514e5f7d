"""Model families: every family by name, a model built abstractly, and the training forward (model loading is
lorajob_trainer.loading's, above this package, weights.py and maxtext.py).

Forward used for training (`forward`): tokens int32[B, L], positions int32[B, L] and segment ids
int32[B, L] -> float32 logits [B, L, vocab]. Segment ids number the packed sequences of a row
1, 2, ...; 0 marks padding. A token attends to earlier tokens of its own segment only (the
attention mask is built here, because Tunix's Llama 3 and Gemma 3 forwards take a dense mask and
no segment ids). Positions restart at 0 in each segment.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lorajob_trainer.models.families import GEMMA3, LLAMA3, QWEN3, Family, ModelConfigError, TensorMap
from lorajob_trainer.models.gemma4 import GEMMA4
from lorajob_trainer.models.qwen3_moe import QWEN3_MOE

__all__ = [
    "Family",
    "FAMILIES",
    "ModelConfigError",
    "TensorMap",
    "abstract_model",
    "attention_mask",
    "family_for_hf_config",
    "forward",
    "tracing_rngs",
]

FAMILIES: dict[str, Family] = {family.name: family for family in (QWEN3, LLAMA3, GEMMA3, QWEN3_MOE, GEMMA4)}
"""Every model family by name: the dense ones of families.py and those with their own module."""

def family_for_hf_config(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ModelConfigError(f"config.json model_type {model_type!r} is not supported (supported: {', '.join(known)})")


def tracing_rngs(seed: int = 0) -> nnx.Rngs:
    """`nnx.Rngs(seed)` for building a model under `nnx.eval_shape`, its streams' counters held as NumPy.

    Each draw advances a counter through `Variable.set_value`, which compares the new value's sharding with the
    old one's; asked of a tracer, `.sharding` raises an error whose message walks the whole trace so far, so with
    traced counters building a model takes time quadratic in its size (qwen3-32b: 16 s). NumPy counters stay
    concrete (1.1 s); the keys drawn and every shape are as before."""
    rngs = nnx.Rngs(seed)
    for stream in vars(rngs).values():
        if isinstance(stream, nnx.RngStream):
            stream.count.set_value(np.zeros((), np.uint32))
    return rngs


def abstract_model(family: Family, tunix_config: Any, hf_config: dict[str, Any]) -> nnx.Module:
    """The model with shapes and sharding metadata only (nothing allocated)."""
    return nnx.eval_shape(lambda: family.build(tunix_config, hf_config, tracing_rngs()))


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, L, L]: causal, within the same segment, never to or from padding (segment 0)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal[None] & same & real


def forward(model: nnx.Module, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """float32 logits [B, L, vocab] of a Tunix model of any supported family (see module docstring)."""
    logits, _ = model(tokens, positions, None, attention_mask(segment_ids))
    return logits.astype(jnp.float32)
