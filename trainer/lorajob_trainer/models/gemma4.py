"""Gemma 4 (31B; E2B/E4B with per-layer inputs and KV-shared layers; 26B-A4B MoE) on Tunix 0.1.7's model code.

What differs from the other families:
- Sliding and global layers differ in shape: a global layer has its own head size
  (`global_head_dim`), its own KV-head count (`num_global_key_value_heads`) and partial
  ("proportional") RoPE; with `attention_k_eq_v` it has no value projection (value = raw key).
- E2B/E4B: every layer adds a per-layer input (PLE), and the last `num_kv_shared_layers`
  layers reuse the keys and values of the last earlier layer of their type, so they hold no
  k/v weights (HF checkpoints omit them).
- Tunix fuses key and value in one einsum: it is split (kv_split) so k and v get independent
  LoRA adapters as in PEFT; a k_eq_v layer's key einsum moves under the same path
  (`attn.kv_einsum.k_einsum`), so one LoRA target path serves every layer.
- Training on TPU runs the attention in the splash kernel (`Gemma4Attention`): a sliding layer's within its
  window, a global layer's causally at its own head size, a KV-shared layer on its origin's keys and values.
- 26B-A4B: a dense MLP beside routed experts. Tunix's `MoERagged` is replaced by `MoE`: Tunix
  routes on the experts' already normalised input, transformers on the residual stream (its own
  RMS norm, no scale), and Tunix's expert weights are bare parameters that LoRA cannot reach;
  ours are `experts.ExpertsLinear` with one adapter per expert.
Multimodal checkpoints (model_type gemma4, weights under `model.language_model.`) load their
language model; the other towers are ignored.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from tunix.models.gemma4 import model as gemma4_lib

from lorajob_trainer.models import experts, splash
from lorajob_trainer.models.decoder import Decoder, StackedLayers, batch_sharded, call_layer
from lorajob_trainer.models.families import GEMMA_MLP_AND_NORMS, Family, ModelConfigError, TensorMap, _expand, _head_dim, _reject, _required
from lorajob_trainer.models.kv_split import KeyValueEinsums
from lorajob_trainer.remat import PROJECTIONS

LAYER_TYPES = {
    "sliding_attention": gemma4_lib.AttentionType.LOCAL_SLIDING,
    "full_attention": gemma4_lib.AttentionType.GLOBAL,
}


VALUE_NORM_EPS = 1e-6
"""Gemma 4 scales each head's value to unit root mean square (no learned scale) with this epsilon, as Tunix does."""


class Gemma4Attention(gemma4_lib.Attention):
    """Tunix's Gemma 4 attention (its parameters, its decoding and dense paths) whose training forward on TPU runs in
    the splash kernel (`splash.applies`); Tunix computes every score. Gemma 4 attends without 1/sqrt(head_dim): its
    query and key norms set the scale."""

    def block(self, x, segment_pos, cache, attn_mask, kv_shared_cache=None):
        batch, length = x.shape[:2]
        if not splash.applies(batch, length, self.config.num_heads, self.num_kv_heads, cache, attn_mask):
            return super().block(x, segment_pos, cache, attn_mask, kv_shared_cache)
        x = x.astype(self.config.dtype)
        rope = {"base_frequency": self.rope_base_frequency, "scale_factor": self.rope_scale_factor,
                "rope_proportion": self.rope_proportion}
        query = self._query_norm(checkpoint_name(self.q_einsum(x), PROJECTIONS))
        query = gemma4_lib.apply_rope(query, segment_pos, **rope)
        if kv_shared_cache is not None:
            key, value = kv_shared_cache["k"], kv_shared_cache["v"]
        else:
            key, value = checkpoint_name(self.kv_einsum(x), PROJECTIONS)
            value = value * jax.lax.rsqrt(jnp.mean(jnp.square(value), axis=-1, keepdims=True) + VALUE_NORM_EPS)
            key = gemma4_lib.apply_rope(self._key_norm(key), segment_pos, **rope)
        sliding = self.attn_type == gemma4_lib.AttentionType.LOCAL_SLIDING
        mixed = splash.causal_attention(
            query, key, value, splash.segment_ids(attn_mask), window=self.config.sliding_window_size if sliding else None
        )
        return {"v": value, "k": key}, self.attn_vec_einsum(mixed), (key, value)


class KeyAsValue(nnx.Module):
    """A k_eq_v global layer's key einsum, called the way Tunix calls `kv_einsum`: value = key."""

    def __init__(self, k_einsum: gemma4_lib.Einsum):
        self.k_einsum = k_einsum

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        key = self.k_einsum(x)
        return key, key


class Identity(nnx.Module):
    """In place of Tunix's `moe_pre_ffw_norm`: `MoE` needs the un-normalised residual and norms it itself."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class MoE(experts.RoutedBlock, nnx.Module):
    """Router and routed experts of a 26B-A4B layer, computed as transformers' Gemma4TextRouter and
    Gemma4TextExperts; called on the residual stream (it holds the experts' pre-norm itself)."""

    def __init__(self, config: gemma4_lib.ModelConfig, *, rngs: nnx.Rngs):
        dim, num_experts = config.embed_dim, config.num_experts
        self.top_k, self.num_experts = config.num_experts_per_tok, num_experts
        dtypes = dict(dtype=config.dtype, param_dtype=config.param_dtype)
        self.pre_norm = gemma4_lib.RMSNorm(dim, rngs=rngs, sharding=config.shd_config, **dtypes)
        self.router = nnx.Linear(dim, num_experts, use_bias=False, rngs=rngs, **dtypes)
        self.router_scale = nnx.Param(jnp.ones((dim,), config.param_dtype))
        self.per_expert_scale = nnx.Param(jnp.ones((num_experts,), config.param_dtype))
        common = dict(experts_per_token=self.top_k, rngs=rngs, **dtypes)
        self.experts = nnx.Dict(
            # gate and up fused as transformers stores them: outputs [gate | up]
            gate_up_proj=experts.ExpertsLinear(
                num_experts, dim, 2 * config.expert_dim, sharding=experts.IN_EXPERT_SHARDING, **common
            ),
            down_proj=experts.ExpertsLinear(
                num_experts, config.expert_dim, dim, sharding=experts.OUT_EXPERT_SHARDING, **common
            ),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        tokens = x.reshape(-1, dim)
        wide = tokens.astype(jnp.float32)  # as transformers' RMSNorm, in float32
        normed = (wide * jax.lax.rsqrt(jnp.mean(jnp.square(wide), axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
        logits = self.router(normed * self.router_scale.get_value() * dim**-0.5)
        weights, ids = experts.route_top_k(logits, self.top_k, normalize=True)
        weights = weights * self.per_expert_scale.get_value()[ids]
        experts_in = self.pre_norm(tokens)
        out, counts = experts.mix_experts(
            experts_in, weights, ids, self.experts["gate_up_proj"], self.experts["down_proj"], jax.nn.gelu,
            self.forward_capacity_factor,
        )
        self.record_dispatch(counts)
        return out.reshape(batch, length, dim).astype(x.dtype)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` of a multimodal config.json, else the config itself."""
    if hf.get("model_type") == "gemma4":
        if not isinstance(hf.get("text_config"), dict):
            raise ModelConfigError("Gemma 4 multimodal config.json has no text_config")
        return hf["text_config"]
    return hf


def _rope(hf: dict[str, Any], layer_type: str) -> tuple[float, float, float]:
    """(theta, factor, rotated fraction of the head) of `layer_type`, as HF's default/proportional RoPE."""
    parameters = (hf.get("rope_parameters") or {}).get(layer_type)
    if not isinstance(parameters, dict) or parameters.get("rope_theta") is None:
        raise ModelConfigError(f"config.json lacks rope_parameters.{layer_type}.rope_theta")
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        return float(parameters["rope_theta"]), 1.0, 1.0
    if rope_type == "proportional":
        factor, fraction = parameters.get("factor", 1.0), parameters.get("partial_rotary_factor", 1.0)
        return float(parameters["rope_theta"]), float(factor), float(fraction)
    raise ModelConfigError(f"Gemma 4 {layer_type} rope_type {rope_type!r} is not supported (default, proportional)")


def kv_sources(hf: dict[str, Any]) -> list[int]:
    """For each layer, the layer whose keys and values it attends with (itself unless KV-shared), as HF picks
    it: the last non-shared layer of the same type."""
    types = hf["layer_types"]
    first_shared = len(types) - (hf.get("num_kv_shared_layers") or 0)
    unshared = types[:first_shared]
    sources = []
    for i, layer_type in enumerate(types):
        if i < first_shared:
            sources.append(i)
        elif layer_type not in unshared:
            raise ModelConfigError(f"KV-shared layer {i} ({layer_type}) has no earlier {layer_type} layer to share")
        else:
            sources.append(len(unshared) - 1 - unshared[::-1].index(layer_type))
    return sources


def gemma4_config(hf: dict[str, Any], dtype: Any) -> gemma4_lib.ModelConfig:
    hf = text_config(hf)
    _reject(
        hf,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        use_bidirectional_attention=None,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    num_layers, vocab_size = _required(hf, "num_hidden_layers"), _required(hf, "vocab_size")
    layer_types = list(_required(hf, "layer_types"))
    if len(layer_types) != num_layers or set(layer_types) - set(LAYER_TYPES):
        raise ModelConfigError(f"Gemma 4 layer_types {layer_types} are not {num_layers} of {sorted(LAYER_TYPES)}")
    per_layer_dim = hf.get("hidden_size_per_layer_input") or 0
    if per_layer_dim and hf.get("vocab_size_per_layer_input", vocab_size) != vocab_size:
        raise ModelConfigError("Gemma 4 with vocab_size_per_layer_input != vocab_size is not supported")
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    num_shared = hf.get("num_kv_shared_layers") or 0
    local_theta, local_factor, local_fraction = _rope(hf, "sliding_attention")
    global_theta, global_factor, global_fraction = _rope(hf, "full_attention")
    intermediate = _required(hf, "intermediate_size")
    moe = bool(hf.get("enable_moe_block", False))
    if moe and not 0 < _required(hf, "top_k_experts") <= _required(hf, "num_experts"):
        raise ModelConfigError(f"config.json top_k_experts={hf['top_k_experts']} is not within 1..num_experts")
    config = gemma4_lib.ModelConfig(
        num_layers=num_layers,
        num_embed=vocab_size,
        embed_dim=_required(hf, "hidden_size"),
        hidden_dim=intermediate,
        num_heads=_required(hf, "num_attention_heads"),
        head_dim=_head_dim(hf),
        num_kv_heads=_required(hf, "num_key_value_heads"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window_size=hf.get("sliding_window"),
        per_layer_input_dim=per_layer_dim,
        num_global_kv_heads=_required(hf, "num_global_key_value_heads") if k_eq_v else None,
        global_key_size=hf.get("global_head_dim") or _head_dim(hf),
        attention_pattern=tuple(LAYER_TYPES[t] for t in layer_types),
        # Tunix shares the last int(L - frac * L) layers; half a layer of slack keeps float error out.
        frac_shared_layers=(num_shared - 0.5) / num_layers if num_shared else 0.0,
        local_rope_proportion=local_fraction,
        global_rope_proportion=global_fraction,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=local_factor,
        global_scale_factor=global_factor,
        k_eq_v_global=k_eq_v,
        override_kv_shared_ffw_hidden=2 * intermediate if hf.get("use_double_wide_mlp") else None,
        use_sliding_window_kv_cache=False,  # training runs without a KV cache
        enable_moe=moe,
        num_experts=hf.get("num_experts") if moe else None,
        num_experts_per_tok=hf.get("top_k_experts") if moe else None,
        expert_dim=_required(hf, "moe_intermediate_size") if moe else None,
        param_dtype=dtype,
        dtype=dtype,
    )
    if _tunix_kv_sources(config) != kv_sources(hf):
        raise ModelConfigError(
            f"Gemma 4 KV sharing {kv_sources(hf)} (layer -> layer whose keys/values it uses) differs from what "
            f"Tunix computes, {_tunix_kv_sources(config)}"
        )
    return config


def _is_global(config: gemma4_lib.ModelConfig, layer: int) -> bool:
    return config.attention_pattern[layer] == gemma4_lib.AttentionType.GLOBAL


def _tunix_kv_sources(config: gemma4_lib.ModelConfig) -> list[int]:
    return gemma4_lib.create_kv_cache_sharing_patterns(
        config.num_layers, config.frac_shared_layers, True, True, config.attention_pattern
    )


def _shares_kv(config: gemma4_lib.ModelConfig) -> list[bool]:
    return [source != i for i, source in enumerate(_tunix_kv_sources(config))]


def adapt(model: gemma4_lib.Gemma4, config: gemma4_lib.ModelConfig, rngs: nnx.Rngs) -> None:
    """Our attention, key/value split, and our MoE (module docstring); drop the k/v weights KV-shared layers never
    use."""
    for layer, shared in zip(model.layers, _shares_kv(config)):
        if config.enable_moe:
            layer.moe, layer.moe_pre_ffw_norm = MoE(config, rngs=rngs), Identity()
        layer.attn = attn = Gemma4Attention(config, layer.attn.attn_type, rngs)
        if shared:
            for name in ("kv_einsum", "k_einsum", "_key_norm"):
                if hasattr(attn, name):
                    delattr(attn, name)
        elif hasattr(attn, "k_einsum"):
            attn.kv_einsum = KeyAsValue(attn.k_einsum)
            del attn.k_einsum
        else:
            attn.kv_einsum = KeyValueEinsums(attn.kv_einsum)


def _layer_maps(config: gemma4_lib.ModelConfig, layer: int, shared: bool) -> list[TensorMap]:
    attn, hf_attn = f"layers.{layer}.attn", f"layers.{layer}.self_attn"
    maps = [
        TensorMap(f"{attn}.q_einsum.w", (f"{hf_attn}.q_proj.weight",), "(n h) d", "n d h"),
        TensorMap(f"{attn}.attn_vec_einsum.w", (f"{hf_attn}.o_proj.weight",), "d (n h)", "n h d"),
        TensorMap(f"{attn}._query_norm.scale", (f"{hf_attn}.q_norm.weight",)),
    ]
    if not shared:
        maps += [
            TensorMap(f"{attn}.kv_einsum.k_einsum.w", (f"{hf_attn}.k_proj.weight",), "(n h) d", "n d h"),
            TensorMap(f"{attn}._key_norm.scale", (f"{hf_attn}.k_norm.weight",)),
        ]
        if not (config.k_eq_v_global and _is_global(config, layer)):
            maps.append(TensorMap(f"{attn}.kv_einsum.v_einsum.w", (f"{hf_attn}.v_proj.weight",), "(n h) d", "n d h"))
    return maps


_DECODER_LAYER = GEMMA_MLP_AND_NORMS + [
    TensorMap("layers.{i}.skip_scale", ("layers.{i}.layer_scalar",)),
]
_MOE = [
    TensorMap("layers.{i}.moe.pre_norm.scale", ("layers.{i}.pre_feedforward_layernorm_2.weight",)),
    TensorMap("layers.{i}.moe.router.kernel", ("layers.{i}.router.proj.weight",), "e d", "d e"),
    TensorMap("layers.{i}.moe.router_scale", ("layers.{i}.router.scale",)),
    TensorMap("layers.{i}.moe.per_expert_scale", ("layers.{i}.router.per_expert_scale",)),
    TensorMap("layers.{i}.moe.experts.gate_up_proj.w", ("layers.{i}.experts.gate_up_proj",), "e f d", "e d f"),
    TensorMap("layers.{i}.moe.experts.down_proj.w", ("layers.{i}.experts.down_proj",), "e d f", "e f d"),
    TensorMap("layers.{i}.dense_post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm_1.weight",)),
    TensorMap("layers.{i}.moe_post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm_2.weight",)),
]
_PER_LAYER_INPUT = [
    TensorMap("layers.{i}.per_layer_input_gate.w", ("layers.{i}.per_layer_input_gate.weight",), "p d", "d p"),
    TensorMap("layers.{i}.per_layer_projection.w", ("layers.{i}.per_layer_projection.weight",), "d p", "p d"),
    TensorMap("layers.{i}.post_per_layer_input_norm.scale", ("layers.{i}.post_per_layer_input_norm.weight",)),
]


def gemma4_maps(config: gemma4_lib.ModelConfig) -> list[TensorMap]:
    per_layer = (
        _DECODER_LAYER + (_PER_LAYER_INPUT if config.per_layer_input_dim else []) + (_MOE if config.enable_moe else [])
    )
    maps = [
        TensorMap("embedder.input_embedding", ("embed_tokens.weight",)),
        TensorMap("final_norm.scale", ("norm.weight",)),
    ]
    if config.per_layer_input_dim:
        maps += [
            TensorMap("embedder.per_layer_input_embedding", ("embed_tokens_per_layer.weight",), "v (l p)", "v l p"),
            TensorMap(
                "embedder.per_layer_model_projection.w", ("per_layer_model_projection.weight",), "(l p) d", "d l p"
            ),
            TensorMap("embedder.per_layer_projection_norm.scale", ("per_layer_projection_norm.weight",)),
        ]
    attention = [m for i, shared in enumerate(_shares_kv(config)) for m in _layer_maps(config, i, shared)]
    return maps + attention + _expand(per_layer, config.num_layers)


class Gemma4(Decoder, gemma4_lib.Gemma4):
    """Tunix's Gemma 4 with our forward (models/decoder.py): capped logits; with per-layer inputs or KV-shared
    layers (E2B/E4B) the layers run unrolled, each given its per-layer input and the keys and values of the
    layer it shares them with, as Tunix's forward does."""

    @property
    def final_logit_softcap(self) -> float | None:
        return self.config.final_logit_softcap

    def init_caches(self, batch: int, size: int, dtype: jnp.dtype) -> dict:
        """Empty KV caches, each of its layer's shape (sliding and global layers differ); none for a layer that
        uses an earlier layer's keys and values."""
        def empty(layer: nnx.Module, *leading: int) -> dict[str, jax.Array] | None:
            shape = (*leading, batch, size, layer.attn.num_kv_heads, layer.attn.head_dim)
            return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                    "end_index": jnp.zeros((*leading, batch), jnp.int32)}

        if isinstance(self.layers, StackedLayers):
            return {"blocks": [empty(block, self.layers.repeats) for block in self.layers.blocks],
                    "rest": [empty(layer) for layer in self.layers.rest]}
        sources = self.kv_cache_sharing_patterns
        return {"blocks": [], "rest": [empty(layer) if sources[i] == i else None for i, layer in enumerate(self.layers)]}

    def _cached_last_logits(self, tokens, positions, caches, mask):
        if not _needs_cross_layer_inputs(self.config):
            return super()._cached_last_logits(tokens, positions, caches, mask)
        # Per-layer inputs and KV-shared layers, as Tunix's forward does with a cache: in the prefill a sharing layer
        # takes its origin's keys and values of the prompt, in a decoding step its origin's updated cache.
        x = batch_sharded(self.embedder.encode(tokens))
        per_layer = self.embedder.encode_per_layer_input(x, tokens) if self.config.per_layer_input_dim else None
        sources, prefill = self.kv_cache_sharing_patterns, tokens.shape[1] > 1
        prompt_kvs: dict[int, tuple[jax.Array, jax.Array]] = {}
        updated: list[dict[str, jax.Array] | None] = []
        for i, layer in enumerate(self.layers):
            own, shared = caches["rest"][i], None
            if sources[i] != i:
                shared = dict(zip("kv", prompt_kvs[sources[i]])) if prefill else updated[sources[i]]
            cache, x, kvs = layer(x, positions, own, mask, kv_shared_cache=shared,
                                  per_layer_input=None if per_layer is None else per_layer[:, :, i, :])
            x = batch_sharded(x)
            if prefill and i in self.shared_layer_origins:
                prompt_kvs[i] = kvs
            updated.append(cache if sources[i] == i else None)  # a sharing layer returns its keys, not a cache
        return self.logits(self.final_norm(x[:, -1:]))[:, 0], {"blocks": [], "rest": updated}

    def run_decoder_layers(self, x, tokens, positions, mask, remat):
        if not _needs_cross_layer_inputs(self.config):
            return super().run_decoder_layers(x, tokens, positions, mask, remat)
        per_layer = self.embedder.encode_per_layer_input(x, tokens) if self.config.per_layer_input_dim else None
        sources = self.kv_cache_sharing_patterns
        shared_kvs: dict[int, dict[str, jax.Array]] = {}
        for i, layer in enumerate(self.layers):
            inputs = dict(
                per_layer_input=None if per_layer is None else per_layer[:, :, i, :],
                kv_shared_cache=shared_kvs[sources[i]] if sources[i] != i else None,
            )

            def layer_fn(module, x, inputs=inputs):
                _, out, kvs = module(x, positions, None, mask, **inputs)
                return batch_sharded(out), kvs

            x, kvs = call_layer(layer, x, remat, layer_fn)
            if i in self.shared_layer_origins:
                shared_kvs[i] = {"k": kvs[0], "v": kvs[1]}
        return x


def _needs_cross_layer_inputs(config: gemma4_lib.ModelConfig) -> bool:
    """Per-layer inputs or KV-shared layers: a layer needs more than the previous layer's output."""
    return bool(config.per_layer_input_dim) or any(_shares_kv(config))


def layer_period(config: gemma4_lib.ModelConfig) -> int | None:
    """The period of the attention pattern (layers of one period differ in shape: sliding vs global); None
    for a model whose layers take inputs from other layers than the previous one."""
    if _needs_cross_layer_inputs(config):
        return None
    pattern = config.attention_pattern
    return next(p for p in range(1, len(pattern) + 1) if all(pattern[i] == pattern[i + p] for i in range(len(pattern) - p)))


class Gemma4Family(Family):
    def build(self, config: Any, hf_config: dict[str, Any], rngs: Any) -> Any:
        model = super().build(config, hf_config, rngs)
        adapt(model, config, rngs)
        return model


GEMMA4 = Gemma4Family(
    name="gemma4",
    hf_model_types=("gemma4_text", "gemma4"),
    model_class=Gemma4,
    config_from_hf=gemma4_config,
    tensor_maps=gemma4_maps,
    layer_period=layer_period,
)

