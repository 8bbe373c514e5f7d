"""MaxText `override_model_config` keys that give a MaxText model the shape of one of our config.json files.

Shared by the side-by-side benchmark (compare.py) and the MaxText checkpoint fixtures
(tests/trainer/fixtures/maxtext/make_fixtures.py); stdlib only, so either interpreter can import it.
"""

from __future__ import annotations


def shape_overrides(maxtext_model: str, hf: dict) -> list[str]:
    """`maxtext_model` (a MaxText model name of the same family) shrunk or grown to the HF config `hf`."""
    keys = [
        f"model_name={maxtext_model}",
        "override_model_config=True",
        f"base_num_decoder_layers={hf['num_hidden_layers']}",
        f"base_emb_dim={hf['hidden_size']}",
        f"base_mlp_dim={hf['intermediate_size']}",
        f"base_num_query_heads={hf['num_attention_heads']}",
        f"base_num_kv_heads={hf['num_key_value_heads']}",
        f"head_dim={hf['head_dim']}",
        f"vocab_size={hf['vocab_size']}",
        f"logits_via_embedding={hf['tie_word_embeddings']}",
    ]
    if "num_experts" in hf:  # routed experts (Qwen3 MoE)
        keys += [
            f"num_experts={hf['num_experts']}",
            f"num_experts_per_tok={hf['num_experts_per_tok']}",
            f"base_moe_mlp_dim={hf['moe_intermediate_size']}",
            f"norm_topk_prob={hf.get('norm_topk_prob', False)}",
        ]
    return keys
