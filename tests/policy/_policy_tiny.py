"""Tiny configurations shared by the policy tests (CPU, one thread, well under a second each)."""
from __future__ import annotations

from policy import ModelConfig

TINY = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=4, linear_num_heads=2, linear_head_dim=8,
    num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    index_n_heads=2, index_head_dim=8, index_topk=4, intermediate_size=32, moe_intermediate_size=16,
    routed_expert_hidden_size=16, num_experts=4, num_experts_per_token=2, attn_res_block_size=2,
)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})
