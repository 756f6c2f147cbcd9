"""GRPO numerics: group-relative advantages, the clipped loss anchored on the behaviour policy (or on
a proximal policy, with off-policy corrections), and micro-batching that gives the same gradient
however a batch is cut (the loss is normalised by GLOBAL counts)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rl.types import Sample

IsCorrection = Literal["none", "tis", "mis"]
IsLevel = Literal["token", "sequence", "geometric"]


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = 3.0  # bound on the ratio for negative advantages
    kl_coef: float = 0.0
    loss_agg: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    norm_len: int = 512  # the constant length Dr.GRPO's seq_mean_token_sum divides by
    # Off-policy corrections. proximal="behavior": the PPO ratio is pi_theta / pi_behaviour.
    # proximal="learner" (decoupled PPO): the ratio is pi_theta / pi_prox, pi_prox being the
    # learner's own policy at the start of the step, and each token is weighted by
    # w = pi_prox / pi_behaviour (no gradient), shaped by `is_correction`:
    #   none: w as is; tis: min(w, is_cap); mis: w where it lies in is_band, else 0 (at token level
    #   this is IcePop's band masking). is_level: per token, per sequence (product of the token
    #   weights) or geometric (exp of the mean token log weight), a sequence's weight applied to
    #   all its tokens.
    proximal: Literal["behavior", "learner"] = "behavior"
    is_correction: IsCorrection = "none"
    is_level: IsLevel = "token"
    is_cap: float = 2.0
    is_band: tuple[float, float] = (0.5, 2.0)


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


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    loss_mask: torch.Tensor  # [B, T] float, 1 on generated tokens (targets)
    behavior_logprobs: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    routing: torch.Tensor | None  # [B, T, n_moe_layers, top_k] long (-1: not recorded), or None
    ref_logprobs: torch.Tensor | None = None  # [B, T] for the KL term
    token_mask: torch.Tensor | None = None  # [B, T] bool: real tokens (padding is False)
    prox_logprobs: torch.Tensor | None = None  # [B, T] the proximal policy's (proximal="learner")
    versions: torch.Tensor | None = None  # [B, T] long: weight version per generated token, -1 elsewhere
    row_domains: tuple[str, ...] = ()  # per row, for per-domain statistics

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> "TrainBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return TrainBatch(move(self.input_ids), move(self.loss_mask), move(self.behavior_logprobs),
                          move(self.advantages), move(self.routing), move(self.ref_logprobs), move(self.token_mask),
                          move(self.prox_logprobs), move(self.versions), self.row_domains)

    def slice(self, rows: slice) -> "TrainBatch":
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return TrainBatch(
            self.input_ids[rows], self.loss_mask[rows], self.behavior_logprobs[rows], self.advantages[rows],
            pick(self.routing), pick(self.ref_logprobs), pick(self.token_mask), pick(self.prox_logprobs),
            pick(self.versions), self.row_domains[rows] if self.row_domains else (),
        )


def inert_row(batch: TrainBatch) -> TrainBatch:
    """One row that trains nothing: the first token of `batch`'s first row, real (so every attention
    row has a key) but no target. A data-parallel rank left without rows runs it, so that it still
    takes part in every collective of the forward and backward."""
    first = lambda t: None if t is None else t[:1, :1]  # noqa: E731
    return TrainBatch(first(batch.input_ids), torch.zeros_like(first(batch.loss_mask)),
                      first(batch.behavior_logprobs), torch.zeros_like(batch.advantages[:1]), first(batch.routing),
                      first(batch.ref_logprobs), torch.ones_like(first(batch.input_ids), dtype=torch.bool),
                      first(batch.prox_logprobs), first(batch.versions), batch.row_domains[:1])


def collate(samples: Sequence[Sample], advantages: np.ndarray, pad_id: int) -> TrainBatch:
    """Right-pad samples into tensors. Padding is never a target and never a real token: it reaches
    neither the loss nor the MoE balancing statistics."""
    longest = max(len(s.tokens) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, longest), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(b, longest)
    token_mask = torch.zeros(b, longest, dtype=torch.bool)
    behavior = torch.zeros(b, longest)
    versions = torch.full((b, longest), -1, dtype=torch.long)
    routing = None
    if all(s.routing is not None for s in samples):
        first = samples[0].routing
        layers, top_k = first.shape[1], first.shape[2]
        routing = torch.full((b, longest, layers, top_k), -1, dtype=torch.long)  # -1: route as usual
    for i, s in enumerate(samples):
        n = len(s.tokens)
        input_ids[i, :n] = torch.tensor(s.tokens)
        token_mask[i, :n] = True
        loss_mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behavior[i, :n] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
        versions[i, :n] = torch.tensor(s.token_versions, dtype=torch.long)
        if routing is not None:
            routing[i, : s.routing.shape[0]] = torch.from_numpy(s.routing.astype(np.int64))
    loss_mask[:, 0] = 0  # the first token has no prediction
    return TrainBatch(input_ids, loss_mask, behavior, torch.as_tensor(advantages, dtype=torch.float32), routing,
                      token_mask=token_mask, versions=versions, row_domains=tuple(s.domain for s in samples))


def behaviour_weights(prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                      cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance weights pi_prox / pi_behaviour shaped by the correction, and the
    per-token 0/1 mask of what the correction kept (no gradient flows through either)."""
    log_w = (prox - behaviour).detach() * mask
    if cfg.is_level == "token":
        log_w_used = log_w
    else:
        per_seq = log_w.sum(-1, keepdim=True)
        if cfg.is_level == "geometric":
            per_seq = per_seq / mask.sum(-1, keepdim=True).clamp_min(1.0)
        log_w_used = per_seq.expand_as(log_w)
    w = torch.exp(log_w_used.clamp(max=30.0))
    kept = torch.ones_like(w)
    if cfg.is_correction == "tis":
        w = w.clamp(max=cfg.is_cap)
    elif cfg.is_correction == "mis":
        lo, hi = cfg.is_band
        kept = ((w >= lo) & (w <= hi)).to(w.dtype)
        w = w * kept
    return w, kept


def grpo_token_losses(
    logp: torch.Tensor, batch: TrainBatch, cfg: LossConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss [B, T] (unmasked) and per-token statistics."""
    adv = batch.advantages[:, None]
    if cfg.proximal == "learner":
        # the proximal policy is the learner's at the step's start: recomputed before the first
        # update when a step makes several, else this very forward's values
        prox = (logp if batch.prox_logprobs is None else batch.prox_logprobs).detach()
        anchor = prox
    else:
        anchor = batch.behavior_logprobs
    log_ratio = logp - anchor
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
        loss = loss + cfg.kl_coef * ratio * k3
        stats["kl"] = k3.detach()
    if cfg.proximal == "learner":  # the tokens were drawn from the behaviour policy, not the proximal one
        w, kept = behaviour_weights(anchor, batch.behavior_logprobs, batch.loss_mask, cfg)
        loss = loss * w
        stats["is_weight"] = w
        stats["is_masked"] = 1.0 - kept
    stats["ratio"] = ratio.detach()
    stats["mismatch"] = (batch.behavior_logprobs - logp).detach().abs()
    return loss, stats


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


def loss_normaliser(batch: TrainBatch, cfg: LossConfig) -> float:
    if cfg.loss_agg == "token_mean":
        return max(global_sum(float(batch.loss_mask.sum())), 1.0)
    return max(global_sum(float(len(batch))) * cfg.norm_len, 1.0)


def split_rows(n: int, parts: int) -> list[slice]:
    """`parts` contiguous, near-equal row ranges of n rows (fewer when n < parts)."""
    bounds = np.linspace(0, n, min(parts, n) + 1).astype(int)
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def split_micro_batches(batch: TrainBatch, micro_batches: int) -> list[TrainBatch]:
    return [batch.slice(rows) for rows in split_rows(len(batch), micro_batches)]


def policy_forward(model: torch.nn.Module, micro: TrainBatch):
    """The learner's forward: token logprobs straight from the hidden states (no [tokens, vocab]
    logits), the rollout's experts replayed, padding kept out of every statistic."""
    return model(micro.input_ids, routing=micro.routing, return_token_logprobs=True, token_mask=micro.token_mask)


def accumulate_policy_gradient(
    model: torch.nn.Module,
    batch: TrainBatch,
    cfg: LossConfig,
    micro_batches: int,
    backward: Callable[[torch.Tensor], None] = lambda loss: loss.backward(),
) -> dict[str, float]:
    """Forward/backward every micro-batch; gradients sum to those of the whole batch at once.
    Returns token-mean statistics, including per-domain mismatch (`mismatch/domain/<d>`), over the
    rows of every data-parallel rank (each passes its own share of the batch)."""
    normaliser = loss_normaliser(batch, cfg)
    sums: dict[str, float] = defaultdict(float)
    for rows in split_rows(len(batch), micro_batches):
        micro = batch.slice(rows)
        out = policy_forward(model, micro)
        logp = out.token_logprobs
        losses, stats = grpo_token_losses(logp, micro, cfg)
        mask = micro.loss_mask
        loss = (losses * mask).sum() / normaliser
        backward(loss)
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
        for r, domain in enumerate(micro.row_domains):
            sums[f"mismatch/domain/{domain}"] += float((stats["mismatch"][r] * mask[r]).sum())
            sums[f"domain_tokens/{domain}"] += float(mask[r].sum())
        sums["tokens"] += float(mask.sum())
    return _token_means(global_sums(sums))


def _token_means(sums: dict[str, float]) -> dict[str, float]:
    """The step's statistics from the sums over every rank's micro-batches: token means (per-domain
    mismatch over that domain's tokens), the loss as summed, the importance weights' spread."""
    tokens = sums.pop("tokens")
    n_weights = sums.pop("is_weight_n", 0.0)
    sq, lo, hi = (sums.pop(k, None) for k in ("is_weight_sq", "is_weight_min", "is_weight_max"))
    domain_tokens = {k.split("/", 1)[1]: sums.pop(k) for k in list(sums) if k.startswith("domain_tokens/")}
    metrics = {"loss": sums.pop("loss")}
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
