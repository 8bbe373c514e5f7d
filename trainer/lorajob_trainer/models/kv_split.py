"""Gemma 3's (and Gemma 4's, see gemma4.py) key and value projections as two einsums, so each gets its own LoRA adapter.

Tunix 0.1.7 computes key and value with one `kv_einsum` (weight [2, K, D, H]); Qwix would give
that einsum one LoRA A shared by key and value, which is not what PEFT's independent
`k_proj` / `v_proj` adapters are. `split_kv_einsum` replaces the fused module by
`KeyValueEinsums`, which Tunix's attention calls unchanged (`key, value = self.kv_einsum(x)`).
"""

from __future__ import annotations

import jax
from flax import nnx
from tunix.models.gemma3 import model as gemma3_lib

from lorajob_trainer.mesh import sharding_names


class KeyValueEinsums(nnx.Module):
    """`k_einsum` and `v_einsum` (each BSD,KDH->BSKH) in place of the fused BSD,CKDH->CBSKH einsum."""

    def __init__(self, fused: gemma3_lib.Einsum):
        self.shape = fused.shape  # Tunix reads the KV-head count from shape[1]
        names = sharding_names(fused.w)
        sharding = None if names is None else tuple(names)[1:]
        self.k_einsum, self.v_einsum = (_slice_einsum(fused.w.get_value()[c], sharding) for c in range(2))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.k_einsum(x), self.v_einsum(x)


def _slice_einsum(value: jax.Array, sharding: tuple[str | None, ...] | None) -> gemma3_lib.Einsum:
    """An einsum holding `value` (Tunix's constructor draws a random weight, replaced at once)."""
    einsum = gemma3_lib.Einsum(
        "BSD,KDH->BSKH", value.shape, rngs=nnx.Rngs(0), sharding=sharding, param_dtype=value.dtype
    )
    einsum.w.set_value(value)
    return einsum


def split_kv_einsum(model: gemma3_lib.Gemma3) -> None:
    """Give every layer of `model` separate key and value einsums (in place)."""
    for layer in model.layers:
        layer.attn.kv_einsum = KeyValueEinsums(layer.attn.kv_einsum)
