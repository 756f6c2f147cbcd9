"""GRPO numerics, as pure functions of tensors and the validated train config: group-relative
advantages, the clipped loss anchored on the behaviour policy (or on a proximal policy, with
off-policy corrections), and the normaliser that makes the gradient independent of how a
mini-batch is cut into micro-batches, ranks, packed or padded rows: it is computed once from the
whole mini-batch (every rank holds it), never from one rank's share."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rl.config import TrainConfig
from rl.learner.batches import MicroBatch, Row


def compute_advantages(
    rewards: Sequence[float], group_keys: Sequence[object], std_norm: Literal["none", "group", "batch"] = "none",
    episode_keys: Sequence[object] | None = None,
) -> np.ndarray:
    """Reward minus its group's mean; a group is one (prompt, effort) pair. With `episode_keys`,
    rows of one episode (its segments) share its reward and count once in the statistics.

    std_norm="group" divides by the group's sample standard deviation (ddof 1, as verl and TRL do;
    biased toward very easy/hard prompts, per Dr.GRPO), "batch" by the sample std of all the
    centred rewards, "none" leaves the scale alone.
    """
    rewards_arr = np.asarray(rewards, dtype=np.float64)
    if len(rewards_arr) != len(group_keys):
        raise ValueError(f"{len(rewards_arr)} rewards but {len(group_keys)} group keys")
    if episode_keys is not None:
        first = {key: i for i, key in reversed(list(enumerate(episode_keys)))}  # an episode's first row
        rows = sorted(first.values())
        once = compute_advantages(rewards_arr[rows], [group_keys[i] for i in rows], std_norm)
        by_episode = {episode_keys[i]: a for i, a in zip(rows, once)}
        return np.array([by_episode[key] for key in episode_keys])
    members: dict[object, list[int]] = defaultdict(list)
    for i, key in enumerate(group_keys):
        members[key].append(i)
    adv = np.zeros_like(rewards_arr)
    for idx in members.values():
        r = rewards_arr[idx]
        centred = r - r.mean()
        if std_norm == "group" and len(r) > 1:
            centred = centred / (r.std(ddof=1) + 1e-6)
        adv[idx] = centred
    if std_norm == "batch" and len(adv) > 1:
        adv = adv / (adv.std(ddof=1) + 1e-6)
    return adv


def loss_normaliser(rows: Sequence[Row], cfg: TrainConfig, seq_norm_tokens: int) -> float:
    """What a mini-batch's summed token losses are divided by: its targets (token_mean), or its
    sequences times a constant length (Dr.GRPO's seq_mean_token_sum). From the whole mini-batch,
    so a rank's inert micro-batch or its share of the rows never changes it."""
    if cfg.loss_agg == "token_mean":
        return float(max(sum(r.targets for r in rows), 1))
    return float(max(len(rows), 1) * seq_norm_tokens)


def behaviour_weights(prox: torch.Tensor, mb: MicroBatch, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights pi_prox / pi_behaviour shaped by the correction, and the
    per-token 0/1 mask of what the correction kept (no gradient flows through either). At sequence
    level a sequence's weight is the product of its tokens' (geometric: their geometric mean)."""
    off = cfg.off_policy
    log_w = (prox - mb.behavior_logprobs).detach() * mb.loss_mask
    if off.is_level == "token":
        log_w_used = log_w
    else:
        per_seq = mb.per_sequence_sum(log_w)
        if off.is_level == "geometric":
            per_seq = per_seq / mb.per_sequence_sum(mb.loss_mask).clamp_min(1.0)
        log_w_used = mb.per_token(per_seq)
    w = torch.exp(log_w_used.clamp(max=30.0))
    kept = torch.ones_like(w)
    if off.is_correction == "tis":
        w = w.clamp(max=off.is_cap)
    elif off.is_correction == "mis":
        lo, hi = off.is_band
        kept = ((w >= lo) & (w <= hi)).to(w.dtype)
        w = w * kept
    return w, kept


def grpo_token_losses(logp: torch.Tensor, mb: MicroBatch, cfg: TrainConfig
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (unmasked) and per-token statistics."""
    adv = mb.advantages
    proximal = cfg.off_policy.proximal == "learner"
    if proximal:
        # the proximal policy is the learner's at the step's start: recomputed before the first
        # update when a step makes several, else this very forward's values
        anchor = (logp if mb.prox_logprobs is None else mb.prox_logprobs).detach()
    else:
        anchor = mb.behavior_logprobs
    ratio = torch.exp((logp - anchor).clamp(max=20.0))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clipped": (clipped > unclipped).float()}
    if cfg.dual_clip is not None:
        # With A < 0 and a huge ratio the PPO loss is unbounded; cap it (dual-clip PPO).
        capped = torch.minimum(loss, -adv * cfg.dual_clip)
        loss = torch.where(adv < 0, capped, loss)
    if cfg.kl_coef > 0:
        if mb.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs in the micro-batch")
        delta = mb.ref_logprobs - logp
        k3 = torch.exp(delta) - delta - 1
        # k3 as a loss alone biases the gradient; weighting by the ratio makes it unbiased.
        loss = loss + cfg.kl_coef * ratio * k3
        stats["kl"] = k3.detach()
    if proximal:  # the tokens were drawn from the behaviour policy, not the proximal one
        w, kept = behaviour_weights(anchor, mb, cfg)
        loss = loss * w
        stats["is_weight"] = w
        stats["is_masked"] = 1.0 - kept
    stats["ratio"] = ratio.detach()
    stats["mismatch"] = (mb.behavior_logprobs - logp).detach().abs()
    return loss, stats


def policy_forward(model: torch.nn.Module, mb: MicroBatch):
    """The learner's forward: token logprobs straight from the hidden states (no [tokens, vocab]
    logits) of the trained tokens only, the rollout's experts replayed, padding and other sequences
    kept out of every token."""
    return model(mb.input_ids, routing=mb.routing, return_token_logprobs=True, token_mask=mb.token_mask,
                 cu_seqlens=mb.cu_seqlens, target_mask=mb.loss_mask > 0)


def accumulate_policy_gradient(
    model: torch.nn.Module,
    micro_batches: Sequence[MicroBatch],
    cfg: TrainConfig,
    normaliser: float,
    backward: Callable[[torch.Tensor, bool], None] = lambda loss, last: loss.backward(),
) -> dict[str, float]:
    """Forward/backward every micro-batch of one update: the gradients sum to the whole mini-batch's
    (each micro-batch's summed token losses over the mini-batch's `normaliser`). `backward(loss,
    last)` is told which micro-batch is the update's last (where gradients are reduced). Returns token-mean
    statistics, per-domain mismatch (`mismatch/domain/<d>`) included, over the micro-batches of
    every data-parallel rank (each passes its own)."""
    sums: dict[str, float] = defaultdict(float)
    for i, mb in enumerate(micro_batches):
        out = policy_forward(model, mb)
        losses, stats = grpo_token_losses(out.token_logprobs, mb, cfg)
        mask = mb.loss_mask
        loss = (losses * mask).sum() / normaliser
        backward(loss, i == len(micro_batches) - 1)
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float((out.token_entropy * mask).sum())
        for name, value in stats.items():
            sums[name] += float((value * mask).sum())
        if "is_weight" in stats:
            w = stats["is_weight"][mask > 0].double()
            if w.numel():
                sums["is_weight_n"] += w.numel()
                sums["is_weight_sq"] += float((w * w).sum())
                sums["is_weight_min"] = min(sums.get("is_weight_min", float("inf")), float(w.min()))
                sums["is_weight_max"] = max(sums.get("is_weight_max", float("-inf")), float(w.max()))
        mismatch = mb.per_sequence_sum(stats["mismatch"] * mask).tolist()
        targets = mb.per_sequence_sum(mask).tolist()
        for domain, m, n in zip(mb.domains, mismatch, targets):
            sums[f"mismatch/domain/{domain}"] += m
            sums[f"domain_tokens/{domain}"] += n
        sums["tokens"] += float(mask.sum())
    return _token_means(global_sums(sums))


def _data_parallel() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def global_sum(value: float) -> float:
    """Sum a scalar over data-parallel ranks (a no-op on one process)."""
    if _data_parallel():
        # NCCL reduces only GPU tensors (Ray leaves each learner rank its own GPU as cuda:0)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item())
    return value


def global_sums(values: dict[str, float]) -> dict[str, float]:
    """Combine per-rank statistics over data-parallel ranks: `*_min` by min, `*_max` by max, the rest
    summed. Ranks may hold different keys (domains only some of them trained on)."""
    if not _data_parallel():
        return dict(values)
    every: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, values)
    out: dict[str, float] = {}
    for part in every:
        for name, value in part.items():
            if name not in out:
                out[name] = value
            elif name.endswith("_min"):
                out[name] = min(out[name], value)
            elif name.endswith("_max"):
                out[name] = max(out[name], value)
            else:
                out[name] += value
    return out


def _token_means(sums: dict[str, float]) -> dict[str, float]:
    """The step's statistics from the sums over every rank's micro-batches: token means (per-domain
    mismatch over that domain's tokens), the loss as summed, the importance weights' spread."""
    tokens = sums.pop("tokens", 0.0)
    n_weights = sums.pop("is_weight_n", 0.0)
    sq, lo, hi = (sums.pop(k, None) for k in ("is_weight_sq", "is_weight_min", "is_weight_max"))
    domain_tokens = {k.split("/", 1)[1]: sums.pop(k) for k in list(sums) if k.startswith("domain_tokens/")}
    metrics = {"loss": sums.pop("loss", 0.0)}
    for name, value in sums.items():
        if name.startswith("mismatch/domain/"):
            metrics[name] = value / max(domain_tokens[name.rsplit("/", 1)[1]], 1.0)
        else:
            metrics[name] = value / max(tokens, 1.0)
    if "is_masked" in metrics:
        metrics["is_masked_frac"] = metrics.pop("is_masked")
    if n_weights:
        mean = metrics.pop("is_weight") * tokens / n_weights  # the token sum of the weights over their count
        var = (sq - n_weights * mean * mean) / (n_weights - 1) if n_weights > 1 else 0.0
        metrics.update({"is_weight_mean": mean, "is_weight_std": max(var, 0.0) ** 0.5,
                        "is_weight_min": lo, "is_weight_max": hi})
    metrics["tokens"] = tokens
    return metrics
