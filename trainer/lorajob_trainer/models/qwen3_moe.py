"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Tunix 0.1.7's Qwen3 with our routed-experts block.

Tunix's norms and embedding are used as they are, with our attention (models/attention.py). Its
`MoELayer` is replaced by `SparseMoeBlock` because
- it always renormalises the top-k routing weights, while transformers does so only with
  `norm_topk_prob: true` (the config class defaults to false);
- on CPU and without a mesh it runs every expert on every token, and elsewhere it needs TPU
  megablox kernels; `ExpertsLinear` runs only the chosen experts, with `ragged_dot`, anywhere;
- its expert weights are bare parameters that LoRA cannot reach; ours carry per-expert adapters.

Its router logits feed transformers' load-balancing loss (`experts.LoadBalanced`), which
transformers adds to the LM loss, scaled by `router_aux_loss_coef`, when `output_router_logits` is set
(`experts.aux_loss_coef`).

HF layout (the Hub checkpoints): `layers.<i>.mlp.gate.weight` [E, D] (router) and per expert
`layers.<i>.mlp.experts.<e>.{gate,up}_proj.weight` [F, D], `down_proj.weight` [D, F].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from tunix.models.qwen3 import model as qwen3_lib

from lorajob_trainer.models import experts
from lorajob_trainer.models.attention import Qwen3Attention
from lorajob_trainer.models.families import (
    Family,
    ModelConfigError,
    Qwen3,
    TensorMap,
    _decoder_dims,
    _decoder_maps,
    _expand,
    _reject,
    _required,
)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens pick experts, from config.json."""

    num_experts_per_tok: int
    norm_topk_prob: bool


class SparseMoeBlock(experts.LoadBalanced, nnx.Module):
    """Router + routed experts, computed as transformers' Qwen3MoeSparseMoeBlock."""

    def __init__(self, config: qwen3_lib.ModelConfig, routing: Routing, *, rngs: nnx.Rngs):
        self.routing = routing
        self.top_k = routing.num_experts_per_tok
        self.num_experts = config.num_experts
        self.router = nnx.Linear(
            config.embed_dim,
            config.num_experts,
            use_bias=False,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )
        common = dict(
            experts_per_token=routing.num_experts_per_tok, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
        )
        self.experts = nnx.Dict(
            gate_up_proj=experts.ExpertsLinear(
                config.num_experts, config.embed_dim, config.hidden_dim, parts=2, sharding=experts.IN_EXPERT_SHARDING,
                **common,
            ),
            down_proj=experts.ExpertsLinear(
                config.num_experts, config.hidden_dim, config.embed_dim, sharding=experts.OUT_EXPERT_SHARDING, **common
            ),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        tokens = x.reshape(-1, dim)
        k = self.routing.num_experts_per_tok
        logits = self.router(tokens)
        self.record(logits)
        weights, ids = experts.route_top_k(logits, k, normalize=self.routing.norm_topk_prob)
        out, counts = experts.mix_experts(
            tokens, weights, ids, self.experts["gate_up_proj"], self.experts["down_proj"], jax.nn.silu,
            self.forward_capacity_factor,
        )
        self.record_dispatch(counts)
        return out.reshape(batch, length, dim).astype(x.dtype)


def _num_experts(hf: dict[str, Any]) -> int:
    """The routed experts per layer: `num_experts` as the released checkpoints write it, `num_local_experts` as
    current transformers (5.x) saves a Qwen3 MoE config."""
    if hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        return hf["num_local_experts"]
    return _required(hf, "num_experts")


def routing(hf: dict[str, Any]) -> Routing:
    return Routing(int(_required(hf, "num_experts_per_tok")), bool(hf.get("norm_topk_prob", False)))


def _config(hf: dict[str, Any], dtype: Any) -> qwen3_lib.ModelConfig:
    _reject(
        hf,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    num_experts, per_token = _num_experts(hf), routing(hf).num_experts_per_tok
    if not 0 < per_token <= num_experts:
        raise ModelConfigError(
            f"config.json num_experts_per_tok={per_token} is not within 1..num_experts={num_experts}"
        )
    return qwen3_lib.ModelConfig(
        **{**_decoder_dims(hf), "hidden_dim": _required(hf, "moe_intermediate_size")},
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)),
        num_experts=num_experts,
        num_experts_per_tok=per_token,
        dtype=dtype,
        param_dtype=dtype,
    )


def _maps(config: qwen3_lib.ModelConfig) -> list[TensorMap]:
    dense = _decoder_maps(config.num_layers, qk_norm=True, tied=config.use_tied_embedding, head="lm_head.w")
    attention = [m for m in dense if ".mlp." not in m.ours]
    gate_up = tuple(
        f"layers.{{i}}.mlp.experts.{e}.{part}.weight"
        for e in range(config.num_experts)
        for part in ("gate_proj", "up_proj")
    )
    down = tuple(f"layers.{{i}}.mlp.experts.{e}.down_proj.weight" for e in range(config.num_experts))
    per_layer = [
        TensorMap("layers.{i}.mlp.router.kernel", ("layers.{i}.mlp.gate.weight",), "e d", "d e"),
        TensorMap("layers.{i}.mlp.experts.gate_up_proj.w", gate_up, "f d", "s d f"),
        TensorMap("layers.{i}.mlp.experts.down_proj.w", down, "d f", "e f d"),
    ]
    return attention + _expand(per_layer, config.num_layers)


class Qwen3MoeFamily(Family):
    def build(self, config: Any, hf_config: dict[str, Any], rngs: Any) -> Any:
        model = super().build(config, hf_config, rngs)
        for layer in model.layers:
            layer.mlp = SparseMoeBlock(config, routing(hf_config), rngs=rngs)
        return model


QWEN3_MOE = Qwen3MoeFamily(
    name="qwen3-moe",
    hf_model_types=("qwen3_moe",),
    model_class=Qwen3,
    config_from_hf=_config,
    tensor_maps=_maps,
    attention=Qwen3Attention,
)
