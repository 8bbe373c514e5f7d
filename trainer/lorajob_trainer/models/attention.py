"""Attention of the Qwen3 / Qwen3 MoE and Llama 3 families, with RoPE as the checkpoint defines it.

Tunix 0.1.7's attention for these families calls its `apply_rope` without the model's `rope_theta`, so every
model would run with theta 1e6 and without Llama 3.1's frequency scaling. These classes keep Tunix's
parameters (`q_proj`, `k_proj`, `v_proj`, `o_proj`, Qwen3's `q_norm` / `k_norm`: the names the tensor maps and
LoRA targets use) and own the computation, `block`: grouped-query attention with the model's RoPE
(`rope.apply_rope`), the KV cache as Tunix lays it out (`k`, `v` [B, S, kv heads, head dim], `end_index`), the
attention mask, softmax in float32; a training step on TPU runs JAX's splash-attention kernel instead
(models/splash.py). Tunix's own splash-attention branch is not used (`use_flash_attention` stays false in our
configs: it ignores the segments of packed and padded sequences and reads the legacy mesh context), nor are its
activation constraints, which read the legacy mesh context and do nothing
under `jax.set_mesh` (the step constrains the residual stream itself: decoder.batch_sharded).

Gemma 3's attention stays Tunix's (its RoPE is right) but for the training forward on TPU, which runs in the
splash kernel too (`Gemma3Attention`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen3 import model as qwen3_lib

from lorajob_trainer.models import splash
from lorajob_trainer.models.rope import RopeSpec, apply_rope
from lorajob_trainer.remat import PROJECTIONS

MASKED = -2.3819763e38
"""The score of a masked position (Tunix's K_MASK: the most negative bfloat16 that softmax still handles)."""


class RopeAttention(nnx.Module):
    """The `block` both families' attention computes; a subclass also derives from the family's Tunix
    attention, whose `__init__` makes the parameters and whose `__call__` calls `block`."""

    qk_norm: bool
    """Qwen3 normalises each head's query and key (RMSNorm over head_dim) before RoPE; Llama 3 does not."""

    def __init__(self, config: Any, rope_spec: RopeSpec, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        self.rope_spec = rope_spec

    def block(
        self,
        x: jax.Array,
        segment_pos: jax.Array,
        cache: dict[str, jax.Array] | None,
        attn_mask: jax.Array | None,
        segment_ids: jax.Array | None = None,
    ) -> tuple[dict[str, jax.Array] | None, jax.Array]:
        """x [B, T, D], positions [B, T], mask [B, T, S] -> (the updated cache or None, [B, T, D])."""
        del segment_ids  # the mask carries the segments (Tunix reads them only in its splash-attention branch)
        query, key, value = (checkpoint_name(project(x), PROJECTIONS) for project in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query = apply_rope(query, segment_pos, self.head_dim, spec=self.rope_spec)
        key = apply_rope(key, segment_pos, self.head_dim, spec=self.rope_spec)
        new_cache = None
        if cache is not None:
            start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
            key = jax.lax.dynamic_update_slice(cache["k"], key, start)
            value = jax.lax.dynamic_update_slice(cache["v"], value, start)
            new_cache = {"k": key, "v": value, "end_index": cache["end_index"] + x.shape[1]}
        batch, length, heads, _ = query.shape
        if splash.applies(batch, length, heads, key.shape[2], cache, attn_mask):
            mixed = splash.causal_attention(query * self.scale, key, value, splash.segment_ids(attn_mask))
        else:
            mixed = dense_attention(query, key, value, attn_mask, self.scale)
        return new_cache, self.o_proj(mixed)


def dense_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None, scale: float
) -> jax.Array:
    """Grouped-query attention with every score computed: query [B, T, N, H], key and value [B, S, K, H] with K
    dividing N, mask [B, T, S] (None: every position) -> [B, T, N, H]; softmax in float32."""
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", grouped, key) * scale
    if mask is not None:
        scores = jnp.where(mask[:, None, None, :, :], scores, MASKED)
    probabilities = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(key.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probabilities, value).reshape(batch, length, heads, head_dim)


class Qwen3Attention(RopeAttention, qwen3_lib.Attention):
    qk_norm = True


class Llama3Attention(RopeAttention, llama3_lib.Attention):
    qk_norm = False


class Gemma3Attention(gemma3_lib.Attention):
    """Tunix's Gemma 3 attention (its parameters, its decoding path) whose training forward on TPU runs in the
    splash kernel, a sliding layer's with its window; Tunix computes every score."""

    def block(
        self, x: jax.Array, segment_pos: jax.Array, cache: dict[str, jax.Array] | None, attn_mask: jax.Array | None
    ) -> tuple[dict[str, jax.Array] | None, jax.Array]:
        batch, length = x.shape[:2]
        if not splash.applies(batch, length, self.num_heads, self.num_kv_heads, cache, attn_mask):
            return super().block(x, segment_pos, cache, attn_mask)
        query = self._query_norm(checkpoint_name(self.q_einsum(x), PROJECTIONS))
        key, value = checkpoint_name(self.kv_einsum(x), PROJECTIONS)
        key = self._key_norm(key)
        rope = {"head_dim": self.head_dim, "base_frequency": self.rope_base_frequency,
                "scale_factor": self.rope_scale_factor}
        query = gemma3_lib.apply_rope(query, segment_pos, **rope) * self.query_pre_attn_scalar
        key = gemma3_lib.apply_rope(key, segment_pos, **rope)
        sliding = self.attn_type == gemma3_lib.AttentionType.LOCAL_SLIDING
        mixed = splash.causal_attention(
            query, key, value, splash.segment_ids(attn_mask), window=self.sliding_window_size if sliding else None
        )
        return None, self.attn_vec_einsum(mixed)

    @classmethod
    def replacing(cls, tunix: gemma3_lib.Attention, config: gemma3_lib.ModelConfig, rngs: nnx.Rngs) -> Gemma3Attention:
        """This class with the layer type and RoPE of `tunix`, one of Tunix's decoder layers' attention."""
        return cls(
            num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, features=config.embed_dim,
            head_dim=config.head_dim, attn_type=tunix.attn_type, sliding_window_size=config.sliding_window_size,
            rope_base_frequency=tunix.rope_base_frequency, rope_scale_factor=tunix.rope_scale_factor,
            query_pre_attn_norm=config.query_pre_attn_norm, rngs=rngs, shd_config=config.shd_config,
            remat_config=config.remat_config, param_dtype=config.param_dtype,
        )
