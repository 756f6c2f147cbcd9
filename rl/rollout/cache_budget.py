"""How many tokens of latent keys the native engine's cache holds: `rollout.cache_tokens`, or as
many whole blocks as fit a memory budget beside every slot's fixed KDA state. The budget is
`rollout.cache_gib`, or on a GPU, when neither is given, `rollout.gpu_memory_fraction` of the memory
free once the engine's model is loaded (times this worker's share of the GPU), but no more than
`max_slots` sequences of `max_context` tokens.

Checked twice with the same arithmetic: when the run config is validated (`check_cache_gib`: the
preset's shapes, the precision its placement implies) and when the engine is built (the model it
holds, the free memory). This module reads the rollout settings it is handed and imports nothing of
rl.config, which imports it."""
from __future__ import annotations

from typing import Protocol

import torch

from policy.config import ModelConfig
from policy.dtypes import device_precision
from policy.slot_cache import BLOCK_SIZE, SlotCache


class CacheSettings(Protocol):
    """What the budget reads of rl.config.RolloutConfig."""

    max_slots: int
    max_context: int
    cache_tokens: int | None
    cache_gib: float | None
    gpu_memory_fraction: float | None

DEFAULT_CACHE_TOKENS = 131072  # on a CPU, neither cache_tokens nor cache_gib given
# on a GPU, neither given: the share of the free memory the engines of a whole GPU may fill (vLLM's
# gpu_memory_utilization is 0.9 of all memory; weights are already loaded here, so of what is free)
DEFAULT_GPU_MEMORY_FRACTION = 0.9
GIB = 1 << 30


def budget_tokens(budget: int, max_slots: int, max_context: int, slot_bytes: int, token_bytes: int,
                  block_size: int = BLOCK_SIZE, named: str = "the cache budget", knob: str = "it") -> int:
    """Tokens (whole blocks) that fit `budget` bytes after `max_slots` slots of `slot_bytes` each and
    the cache's scratch slot and block; a ValueError naming the numbers (`named`: where the budget came
    from, `knob`: what to raise) when that is less than one `max_context`-token sequence."""
    block_bytes = block_size * token_bytes
    fixed = (max_slots + 1) * slot_bytes + block_bytes  # + the scratch slot and block (policy.slot_cache)
    one_sequence = -(-max_context // block_size)  # blocks
    if budget < fixed + one_sequence * block_bytes:
        raise ValueError(
            f"{named} ({budget:,} bytes) cannot hold rollout.max_slots={max_slots} slots "
            f"({slot_bytes:,} bytes each) plus one rollout.max_context={max_context}-token sequence "
            f"({one_sequence * block_bytes:,} bytes): raise {knob} or lower max_slots or max_context")
    blocks = (budget - fixed) // block_bytes if block_bytes else one_sequence  # no MLA layer: blocks are free
    return blocks * block_size


def gpu_cache_bytes(free_bytes: int, fraction: float, gpu_share: float) -> int:
    """The default budget on a GPU: `fraction` of its free memory, times the share of the GPU Ray gave
    this worker (workers packed on one GPU split it; colocated ones share half with the learner)."""
    return int(free_bytes * fraction * min(gpu_share, 1.0))


def check_cache_gib(cfg: CacheSettings, model: ModelConfig, on_gpu: bool) -> None:
    """The run config's check of rollout.cache_gib (a ValueError naming the numbers): it holds the slots and one
    max_context sequence for `model`, in the precision the engine runs in on a GPU or a CPU."""
    engine_cache_tokens(cfg, model, device_precision(torch.device("cuda" if on_gpu else "cpu")))


def engine_cache_tokens(cfg: CacheSettings, model: ModelConfig, dtype: torch.dtype, block_size: int = BLOCK_SIZE,
                        gpu: tuple[int, float] | None = None) -> int:
    """`gpu`: (free bytes, this worker's GPU share) for an engine on a GPU, None on a CPU."""
    slot, token = SlotCache.bytes_per_slot(model, dtype), SlotCache.bytes_per_token(model, dtype)
    if cfg.cache_gib is not None:
        return budget_tokens(int(cfg.cache_gib * GIB), cfg.max_slots, cfg.max_context, slot, token, block_size,
                             named=f"rollout.cache_gib={cfg.cache_gib:g}", knob="cache_gib")
    if cfg.cache_tokens is not None or gpu is None:
        return cfg.cache_tokens or DEFAULT_CACHE_TOKENS
    free, share = gpu
    fraction = cfg.gpu_memory_fraction or DEFAULT_GPU_MEMORY_FRACTION
    fits = budget_tokens(gpu_cache_bytes(free, fraction, share), cfg.max_slots, cfg.max_context, slot, token,
                         block_size, knob="rollout.gpu_memory_fraction, or give cache_tokens,",
                         named=f"rollout.gpu_memory_fraction={fraction:g} of {free / GIB:.2f} GiB free x "
                               f"GPU share {min(share, 1.0):g}")
    # every slot holding a whole max_context sequence is the most the engine can ever use
    return min(fits, cfg.max_slots * -(-cfg.max_context // block_size) * block_size)
