"""Parameter counts: total, and active per token (what one token's forward touches).

Active = everything except the embedding table (one row is read per token) and the routed
experts a token does not use (top_k of num_experts per MoE layer). The LM head counts.
Works on the meta device, so the 2.8T preset can be counted without memory.
"""
from __future__ import annotations

from torch import nn


def count_parameters(model: nn.Module) -> dict[str, int]:
    cfg = model.config
    total = embed = routed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name.endswith("embed_tokens.weight"):
            embed += n
        elif ".experts.w" in name:
            routed += n
    n_moe = len(cfg.moe_layers)
    routed_active = routed * cfg.num_experts_per_token // cfg.num_experts if n_moe else 0
    active = total - embed - routed + routed_active
    return {"total": total, "active": active, "embedding": embed, "routed_experts": routed,
            "routed_active": routed_active}
