"""GRPO numerics: group-relative advantages, the clipped behaviour-anchored loss, and micro-batching
that gives the same gradient however a batch is cut (the loss is normalised by GLOBAL counts)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rl.types import Sample


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 3.0  # bound on the ratio for negative advantages
    kl_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    norm_len: int = 512  # the constant length Dr.GRPO's seq_mean_token_sum divides by


def compute_advantages(
    rewards: Sequence[float], group_keys: Sequence[object], std_norm: Literal["none", "group", "batch"] = "none"
) -> np.ndarray:
    """Reward minus its group's mean; a group is one (prompt, effort) pair.

    std_norm="group" divides by the group's std (biased toward very easy/hard prompts, per Dr.GRPO),
    "batch" by the std of all the centred rewards, "none" leaves the scale alone.
    """
    rewards_arr = np.asarray(rewards, dtype=np.float64)
    if len(rewards_arr) != len(group_keys):
        raise ValueError(f"{len(rewards_arr)} rewards but {len(group_keys)} group keys")
    members: dict[object, list[int]] = defaultdict(list)
    for i, key in enumerate(group_keys):
        members[key].append(i)
    adv = np.zeros_like(rewards_arr)
    for idx in members.values():
        r = rewards_arr[idx]
        centred = r - r.mean()
        if std_norm == "group":
            centred = centred / (r.std() + 1e-6)
        adv[idx] = centred
    if std_norm == "batch" and len(adv) > 1:
        adv = adv / (adv.std() + 1e-6)
    return adv


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    loss_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (targets)
    behavior_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    routing: torch.Tensor | None  # [B, T, n_moe_layers, top_k] long, or None
    ref_logprobs: torch.Tensor | None = None  # [B, T] for the KL term

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, rows: slice) -> "TrainBatch":
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return TrainBatch(
            self.input_ids[rows], self.loss_mask[rows], self.behavior_logprobs[rows], self.advantages[rows],
            pick(self.routing), pick(self.ref_logprobs),
        )


def collate(samples: Sequence[Sample], advantages: np.ndarray, pad_id: int) -> TrainBatch:
    """Right-pad samples into tensors. Padding is never a target, so it never reaches the loss."""
    longest = max(len(s.tokens) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, longest)
    behavior = torch.zeros(b, longest)
    routing = None
    if all(s.routing is not None for s in samples):
        first = samples[0].routing
        layers, top_k = first.shape[1], first.shape[2]
        # Padding rows get experts 0..k-1: any valid distinct choice, never read by the loss.
        routing = torch.arange(top_k).expand(b, longest, layers, top_k).clone()
    for i, s in enumerate(samples):
        n = len(s.tokens)
        input_ids[i, :n] = torch.tensor(s.tokens)
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behavior[i, :n] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
        if routing is not None:
            routing[i, : s.routing.shape[0]] = torch.from_numpy(s.routing.astype(np.int64))
    loss_mask[:, 0] = 0  # the first token has no prediction
    return TrainBatch(input_ids, loss_mask, behavior, torch.as_tensor(advantages, dtype=torch.float32), routing)


def grpo_token_losses(
    logp: torch.Tensor, batch: TrainBatch, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (unmasked) and per-token statistics, anchored on behaviour logprobs."""
    adv = batch.advantages[:, None]
    log_ratio = logp - batch.behavior_logprobs
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clipped": (clipped > unclipped).float()}
    if cfg.dual_clip is not None:
        # With A < 0 and a huge ratio the PPO loss is unbounded; cap it (dual-clip PPO).
        capped = torch.minimum(loss, -adv * cfg.dual_clip)
        loss = torch.where(adv < 0, capped, loss)
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs in the batch")
        delta = batch.ref_logprobs - logp
        k3 = torch.exp(delta) - delta - 1
        # k3 as a loss alone biases the gradient; weighting by the ratio makes it unbiased.
        kl = ratio * k3
        loss = loss + cfg.kl_coef * kl
        stats["kl"] = k3.detach()
    stats["ratio"] = ratio.detach()
    stats["mismatch"] = (batch.behavior_logprobs - logp).detach().abs()
    return loss, stats


def global_sum(value: float) -> float:
    """Sum a scalar over data-parallel ranks (a no-op on one process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())
    return value


def loss_normaliser(batch: TrainBatch, cfg: LossConfig) -> float:
    if cfg.loss_agg == "token_mean":
        return max(global_sum(float(batch.loss_mask.sum())), 1.0)
    return max(global_sum(float(len(batch))) * cfg.norm_len, 1.0)


def split_micro_batches(batch: TrainBatch, micro_batches: int) -> list[TrainBatch]:
    n = len(batch)
    bounds = np.linspace(0, n, min(micro_batches, n) + 1).astype(int)
    return [batch.slice(slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def accumulate_policy_gradient(
    model: torch.nn.Module,
    batch: TrainBatch,
    cfg: LossConfig,
    micro_batches: int,
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward(),
) -> dict[str, float]:
    """Forward/backward every micro-batch; gradients sum to those of the whole batch at once."""
    normaliser = loss_normaliser(batch, cfg)
    totals: dict[str, float] = defaultdict(float)
    for micro in split_micro_batches(batch, micro_batches):
        # token logprobs straight from the hidden states: the [tokens, vocab] logits never exist
        out = model(micro.input_ids, routing=micro.routing, return_token_logprobs=True)
        logp = out.token_logprobs
        losses, stats = grpo_token_losses(logp, micro, cfg)
        mask = micro.loss_mask
        loss = (losses * mask).sum() / normaliser
        backward(loss)
        totals["loss"] += float(loss.detach())
        totals["entropy"] += float((out.token_entropy * mask).sum())
        for name, value in stats.items():
            totals[name] += float((value * mask).sum())
    tokens = float(batch.loss_mask.sum())
    metrics = {"loss": totals.pop("loss")}
    for name, value in totals.items():
        metrics[name] = value / max(tokens, 1.0)
    metrics["tokens"] = tokens
    return metrics
