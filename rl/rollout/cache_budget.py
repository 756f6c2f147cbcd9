"""How many tokens of latent keys the native engine's cache holds: `rollout.cache_tokens`, or as
many whole blocks as fit a memory budget (`rollout.cache_gib`) beside every slot's fixed KDA state.

Checked twice with the same arithmetic: when the run config is validated (the preset's shapes, the
precision its placement implies) and when the engine is built (the model it holds)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from policy.config import ModelConfig
from policy.slot_cache import BLOCK_SIZE, SlotCache

if TYPE_CHECKING:  # rl.config checks a budget with this module
    from rl.config import RolloutConfig

DEFAULT_CACHE_TOKENS = 131072  # neither cache_tokens nor cache_gib given
GIB = 1 << 30


def budget_tokens(cache_gib: float, max_slots: int, max_context: int, slot_bytes: int, token_bytes: int,
                  block_size: int = BLOCK_SIZE) -> int:
    """Tokens (whole blocks) that fit `cache_gib` after `max_slots` slots of `slot_bytes` each; a
    ValueError naming the numbers when that is less than one `max_context`-token sequence."""
    budget, fixed = int(cache_gib * GIB), max_slots * slot_bytes
    block_bytes = block_size * token_bytes
    one_sequence = -(-max_context // block_size)  # blocks
    if budget < fixed + one_sequence * block_bytes:
        raise ValueError(
            f"rollout.cache_gib={cache_gib:g} ({budget:,} bytes) cannot hold rollout.max_slots={max_slots} slots "
            f"({slot_bytes:,} bytes each) plus one rollout.max_context={max_context}-token sequence "
            f"({one_sequence * block_bytes:,} bytes): raise cache_gib or lower max_slots or max_context")
    blocks = (budget - fixed) // block_bytes if block_bytes else one_sequence  # no MLA layer: blocks are free
    return blocks * block_size


def engine_cache_tokens(cfg: RolloutConfig, model: ModelConfig, dtype: torch.dtype,
                        block_size: int = BLOCK_SIZE) -> int:
    if cfg.cache_gib is None:
        return cfg.cache_tokens or DEFAULT_CACHE_TOKENS
    return budget_tokens(cfg.cache_gib, cfg.max_slots, cfg.max_context, SlotCache.bytes_per_slot(model, dtype),
                         SlotCache.bytes_per_token(model, dtype), block_size)
