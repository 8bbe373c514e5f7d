"""Model families: Hugging Face config.json -> Tunix ModelConfig, and the HF <-> Tunix tensor layout.

Each family names the Tunix model class, turns an HF config dict into a Tunix config (rejecting
what Tunix cannot represent), and lists its parameters as `TensorMap`s. A `TensorMap` says how
one Tunix parameter is laid out relative to one HF tensor (or a stack of several) with
einops-style axis patterns; weights.py reads it in one direction, export.py writes it in the other.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen3 import model as qwen3_lib

from lorajob_trainer.models.attention import Gemma3Attention, Llama3Attention, Qwen3Attention
from lorajob_trainer.models.decoder import Decoder
from lorajob_trainer.models.kv_split import split_kv_einsum
from lorajob_trainer.models.rope import RopeSpec


class ModelConfigError(ValueError):
    """config.json describes a model this trainer cannot run faithfully."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One Tunix parameter and where its values live in an HF checkpoint.

    `ours` is the dotted NNX path with `{i}` for the layer index. `hf` holds the HF tensor names
    (relative to the decoder prefix such as `model.`, `{i}` likewise); with two names the tensors
    are stacked along the first axis of `ours_axes`. `hf_axes` / `ours_axes` are einops-style
    patterns over the same axis names, e.g. `(n h) d` -> `d n h`.
    """

    ours: str
    hf: tuple[str, ...]
    hf_axes: str | None = None
    ours_axes: str | None = None
    """None: the tensor is copied unchanged."""
    prefixed: bool = True
    """False for tensors outside the decoder (`lm_head.weight`), which take no `model.` prefix."""


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    model_class: type
    config_from_hf: Callable[[dict[str, Any], Any], Any]
    tensor_maps: Callable[[Any], list[TensorMap]]
    """The TensorMaps of a model with this Tunix config (one entry per parameter, layers expanded)."""
    attention: type | None = None
    """The attention class (models/attention.py) each layer gets in place of Tunix's, which ignores this
    family's rope_theta and RoPE scaling (0.1.7); None: Tunix's attention is used as it is."""
    split_kv: bool = False
    """Tunix fuses key and value in one einsum: split it (`kv_split`) so each has its own LoRA, as in PEFT."""
    layer_period: Callable[[Any], int | None] = lambda config: 1
    """The number of layers after which the layer structure repeats (the step scans over the repeats:
    models/decoder.py); None: the model's layers are not scanned."""

    def build(self, config: Any, hf_config: dict[str, Any], rngs: Any) -> Any:
        """The Tunix model for `config` (made from `hf_config`), with our attention where the family has one."""
        model = self.model_class(config, rngs=rngs)
        self.replace_attention(model, config, hf_config, rngs)
        if self.split_kv:
            split_kv_einsum(model)
        return model

    def replace_attention(self, model: Any, config: Any, hf_config: dict[str, Any], rngs: Any) -> None:
        """Gives each layer `attention` in place of Tunix's."""
        if self.attention is not None:
            spec = rope_spec(hf_config)
            for layer in model.layers:
                layer.attn = self.attention(config, spec, rngs=rngs)


def _required(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise ModelConfigError(f"config.json lacks {key!r}")
    return hf[key]


def _head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or _required(hf, "hidden_size") // _required(hf, "num_attention_heads")


def rope_spec(hf: dict[str, Any], layer_type: str | None = None) -> RopeSpec:
    """The RoPE of an HF config, in the transformers 5 (`rope_parameters`) or 4.x layout."""
    parameters = hf.get("rope_parameters")
    if parameters is not None:
        if layer_type is not None and isinstance(parameters.get(layer_type), dict):
            parameters = parameters[layer_type]
        return RopeSpec.from_hf(parameters)
    legacy = {"rope_theta": hf.get("rope_theta"), **(hf.get("rope_scaling") or {})}
    if layer_type == "sliding_attention":
        legacy = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    return RopeSpec.from_hf(legacy)


def _reject(hf: dict[str, Any], **unsupported: Any) -> None:
    for key, supported in unsupported.items():
        if hf.get(key, supported) != supported:
            raise ModelConfigError(f"config.json sets {key}={hf[key]!r}; only {supported!r} is supported")


# --- Qwen3 / Llama 3 ---------------------------------------------------------------------------


class Qwen3(Decoder, qwen3_lib.Qwen3):
    """Tunix's Qwen3 with our forward (models/decoder.py)."""


class Llama3(Decoder, llama3_lib.Llama3):
    """Tunix's Llama 3 with our forward (models/decoder.py)."""


def _decoder_maps(num_layers: int, *, qk_norm: bool, tied: bool, head: str) -> list[TensorMap]:
    per_layer = [
        TensorMap("layers.{i}.attn.q_proj.w", ("layers.{i}.self_attn.q_proj.weight",), "(n h) d", "d n h"),
        TensorMap("layers.{i}.attn.k_proj.w", ("layers.{i}.self_attn.k_proj.weight",), "(n h) d", "d n h"),
        TensorMap("layers.{i}.attn.v_proj.w", ("layers.{i}.self_attn.v_proj.weight",), "(n h) d", "d n h"),
        TensorMap("layers.{i}.attn.o_proj.w", ("layers.{i}.self_attn.o_proj.weight",), "d (n h)", "n h d"),
        TensorMap("layers.{i}.mlp.gate_proj.kernel", ("layers.{i}.mlp.gate_proj.weight",), "f d", "d f"),
        TensorMap("layers.{i}.mlp.up_proj.kernel", ("layers.{i}.mlp.up_proj.weight",), "f d", "d f"),
        TensorMap("layers.{i}.mlp.down_proj.kernel", ("layers.{i}.mlp.down_proj.weight",), "d f", "f d"),
        TensorMap("layers.{i}.input_layernorm.w", ("layers.{i}.input_layernorm.weight",)),
        TensorMap("layers.{i}.post_attention_layernorm.w", ("layers.{i}.post_attention_layernorm.weight",)),
    ]
    if qk_norm:
        per_layer += [
            TensorMap("layers.{i}.attn.q_norm.w", ("layers.{i}.self_attn.q_norm.weight",)),
            TensorMap("layers.{i}.attn.k_norm.w", ("layers.{i}.self_attn.k_norm.weight",)),
        ]
    maps = [
        TensorMap("embedder.input_embedding", ("embed_tokens.weight",)),
        TensorMap("final_norm.w", ("norm.weight",)),
    ]
    if not tied:
        maps.append(TensorMap(head, ("lm_head.weight",), "v d", "d v", prefixed=False))
    return maps + _expand(per_layer, num_layers)


def _expand(per_layer: list[TensorMap], num_layers: int) -> list[TensorMap]:
    return [
        dataclasses.replace(m, ours=m.ours.format(i=i), hf=tuple(name.format(i=i) for name in m.hf))
        for i, m in itertools.product(range(num_layers), per_layer)
    ]


def _decoder_dims(hf: dict[str, Any]) -> dict[str, Any]:
    """The dimensions Tunix's Qwen3 and Llama3 configs share, from an HF config.json."""
    return dict(
        num_layers=_required(hf, "num_hidden_layers"),
        vocab_size=_required(hf, "vocab_size"),
        embed_dim=_required(hf, "hidden_size"),
        hidden_dim=_required(hf, "intermediate_size"),
        num_heads=_required(hf, "num_attention_heads"),
        head_dim=_head_dim(hf),
        num_kv_heads=_required(hf, "num_key_value_heads"),
        rope_theta=rope_spec(hf).theta,
    )


def _qwen3_config(hf: dict[str, Any], dtype: Any) -> qwen3_lib.ModelConfig:
    _reject(hf, hidden_act="silu", attention_bias=False, use_sliding_window=False, num_experts=None)
    return qwen3_lib.ModelConfig(
        **_decoder_dims(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        param_dtype=dtype,
    )


def _llama3_config(hf: dict[str, Any], dtype: Any) -> llama3_lib.ModelConfig:
    _reject(hf, hidden_act="silu", attention_bias=False, mlp_bias=False)
    return llama3_lib.ModelConfig(
        **_decoder_dims(hf),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        weight_tying=bool(hf.get("tie_word_embeddings", False)),
    )


QWEN3 = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    model_class=Qwen3,
    config_from_hf=_qwen3_config,
    tensor_maps=lambda c: _decoder_maps(c.num_layers, qk_norm=True, tied=c.use_tied_embedding, head="lm_head.w"),
    attention=Qwen3Attention,
)
LLAMA3 = Family(
    name="llama3",
    hf_model_types=("llama",),
    model_class=Llama3,
    config_from_hf=_llama3_config,
    tensor_maps=lambda c: _decoder_maps(c.num_layers, qk_norm=False, tied=c.weight_tying, head="lm_head.w"),
    attention=Llama3Attention,
)


# --- Gemma 3 -----------------------------------------------------------------------------------

_GEMMA3_LAYER_TYPES = {
    gemma3_lib.AttentionType.LOCAL_SLIDING: "sliding_attention",
    gemma3_lib.AttentionType.GLOBAL: "full_attention",
}


class Gemma3(Decoder, gemma3_lib.Gemma3):
    """Tunix's Gemma 3 with our forward (models/decoder.py); its text embedding is `embedder.encode`."""


def _gemma3_config(hf: dict[str, Any], dtype: Any) -> gemma3_lib.ModelConfig:
    hf = hf.get("text_config") or hf
    _reject(
        hf,
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        rms_norm_eps=1e-6,
        use_bidirectional_attention=False,
    )
    num_layers = _required(hf, "num_hidden_layers")
    tunix_types = [
        _GEMMA3_LAYER_TYPES[t] for _, t in zip(range(num_layers), itertools.cycle(gemma3_lib.GEMMA3_ATTENTION_PATTERN))
    ]
    if hf.get("layer_types", tunix_types) != tunix_types:
        raise ModelConfigError(
            f"Gemma 3 layer_types {hf['layer_types']} differ from Tunix's fixed pattern {tunix_types}"
        )
    head_dim, embed_dim, num_heads = _head_dim(hf), _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
    num_kv_heads = _required(hf, "num_key_value_heads")
    if num_kv_heads == num_heads:
        raise ModelConfigError("Gemma 3 with num_key_value_heads == num_attention_heads (fused qkv) is not supported")
    query_scalars = {
        head_dim: gemma3_lib.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
        embed_dim // num_heads: gemma3_lib.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS,
    }
    scalar = hf.get("query_pre_attn_scalar", head_dim)
    if scalar not in query_scalars:
        raise ModelConfigError(f"Gemma 3 query_pre_attn_scalar={scalar} is neither head_dim nor hidden/heads")
    local, glob = rope_spec(hf, "sliding_attention"), rope_spec(hf, "full_attention")
    for spec in (local, glob):
        if spec.rope_type == "llama3":
            raise ModelConfigError("Gemma 3 with llama3 rope scaling is not supported")
    return gemma3_lib.ModelConfig(
        num_layers=num_layers,
        num_embed=_required(hf, "vocab_size"),
        embed_dim=embed_dim,
        hidden_dim=_required(hf, "intermediate_size"),
        num_heads=num_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        sliding_window_size=hf.get("sliding_window"),
        local_base_frequency=local.theta,
        global_base_frequency=glob.theta,
        local_scale_factor=local.factor,
        global_scale_factor=glob.factor,
        query_pre_attn_norm=query_scalars[scalar],
        param_dtype=dtype,
    )


GEMMA_MLP_AND_NORMS = [
    TensorMap("layers.{i}.mlp.gate_proj.kernel", ("layers.{i}.mlp.gate_proj.weight",), "f d", "d f"),
    TensorMap("layers.{i}.mlp.up_proj.kernel", ("layers.{i}.mlp.up_proj.weight",), "f d", "d f"),
    TensorMap("layers.{i}.mlp.down_proj.kernel", ("layers.{i}.mlp.down_proj.weight",), "d f", "f d"),
    TensorMap("layers.{i}.pre_attention_norm.scale", ("layers.{i}.input_layernorm.weight",)),
    TensorMap("layers.{i}.post_attention_norm.scale", ("layers.{i}.post_attention_layernorm.weight",)),
    TensorMap("layers.{i}.pre_ffw_norm.scale", ("layers.{i}.pre_feedforward_layernorm.weight",)),
    TensorMap("layers.{i}.post_ffw_norm.scale", ("layers.{i}.post_feedforward_layernorm.weight",)),
]
"""The gated MLP and the four sandwich norms of a Gemma decoder layer (Gemma 3 and Gemma 4 name them alike)."""


def _gemma3_maps(config: gemma3_lib.ModelConfig) -> list[TensorMap]:
    per_layer = [
        TensorMap("layers.{i}.attn.q_einsum.w", ("layers.{i}.self_attn.q_proj.weight",), "(n h) d", "n d h"),
        TensorMap("layers.{i}.attn.kv_einsum.k_einsum.w", ("layers.{i}.self_attn.k_proj.weight",), "(n h) d", "n d h"),
        TensorMap("layers.{i}.attn.kv_einsum.v_einsum.w", ("layers.{i}.self_attn.v_proj.weight",), "(n h) d", "n d h"),
        TensorMap("layers.{i}.attn.attn_vec_einsum.w", ("layers.{i}.self_attn.o_proj.weight",), "d (n h)", "n h d"),
        TensorMap("layers.{i}.attn._query_norm.scale", ("layers.{i}.self_attn.q_norm.weight",)),
        TensorMap("layers.{i}.attn._key_norm.scale", ("layers.{i}.self_attn.k_norm.weight",)),
    ] + GEMMA_MLP_AND_NORMS
    return [
        TensorMap("embedder.input_embedding", ("embed_tokens.weight",)),
        TensorMap("final_norm.scale", ("norm.weight",)),
    ] + _expand(per_layer, config.num_layers)


class Gemma3Family(Family):
    def replace_attention(self, model: Any, config: Any, hf_config: dict[str, Any], rngs: Any) -> None:
        """Tunix's Gemma 3 attention (its RoPE is right) with the splash kernel for training on TPU."""
        for layer in model.layers:
            layer.attn = Gemma3Attention.replacing(layer.attn, config, rngs)


GEMMA3 = Gemma3Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    model_class=Gemma3,
    config_from_hf=_gemma3_config,
    tensor_maps=_gemma3_maps,
    split_kv=True,
    layer_period=lambda config: len(gemma3_lib.GEMMA3_ATTENTION_PATTERN),
)
