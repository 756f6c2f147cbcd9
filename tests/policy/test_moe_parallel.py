"""Expert parallelism (policy/layers/moe_parallel.py) on 2 gloo ranks against one rank.

Each rank trains on half of a batch (data parallel) with half of the routed experts (EP=2); the
summed loss, the gradients (non-expert ones all-reduced, expert ones on their owner), the MoE
statistics and the weights and router biases after one AdamW step must be one rank's on the whole
batch with all the experts; also with the sharded model's layers checkpointed (their recomputation
exchanges tokens again in backward, and counts no statistics twice).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policy import build_model, save_pretrained

from _policy_tiny import tiny

WORLD = 2
B, T = 4, 10
ADAMW_LR, ADAMW_EPS = 1e-2, 1e-4


def _batch(cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T], real-token mask [B, T], recorded routing [B, T, n_moe, k] with unrecorded tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 7:] = real[2, 4:] = False  # right padding
    n_moe = len(cfg.moe_layers)
    routing = torch.rand(B, T, n_moe, cfg.num_experts, generator=g).argsort(-1)[..., :cfg.num_experts_per_token]
    routing[0, 5:] = routing[3, :2, 1] = -1  # not recorded: the learner routes these itself
    return ids, real, routing


def _train_step(model, micro_batches, n_targets: float, reduce_grads) -> dict[str, object]:
    """One AdamW step on the token log-likelihood divided by the global target count, accumulated
    over micro-batches of (ids, real, routing). AdamW's first step is lr * g / (|g| + eps): with the
    usual eps 1e-8 a gradient that is rounding noise around 0 moves its weight by about +-lr, so eps
    is large enough here for the step to follow g smoothly."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, eps=ADAMW_EPS, weight_decay=0.1)
    loss = torch.zeros(())
    for ids, real, routing in micro_batches:
        logp = model(ids, routing=routing, token_mask=real, return_token_logprobs=True).token_logprobs
        part = -(logp[:, 1:] * real[:, 1:]).sum() / n_targets
        part.backward()
        loss += part.detach()
    reduce_grads(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    stats = model.moe_statistics()
    optimizer.step()
    model.after_optimizer_step()
    return {"loss": loss, "grads": grads, "stats": stats, "state": model.state_dict()}


def _model(cfg):
    """The tiny model with MoE weights large enough that the routed experts move the loss (at the
    usual init their output is a rounding error in the logits)."""
    torch.manual_seed(0)
    model = build_model(cfg).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".block_sparse_moe." in name and p.dim() > 1:
                p.normal_(0, 0.5)
    return model


def _is_expert(name: str) -> bool:
    return ".experts.w" in name


def _all_reduce_dense_grads(model) -> None:
    """Data parallelism: the non-expert gradients summed over ranks (the loss is already divided by
    the global count). Expert gradients are complete on their owner: the exchange brought every
    rank's tokens to it."""
    for name, p in model.named_parameters():
        if not _is_expert(name):
            dist.all_reduce(p.grad)


def _grad_atol(expected: torch.Tensor) -> float:
    """Two ranks sum in another order than one: a float32 sum of many terms then differs by a few
    ulps of its largest terms, so entries near zero need an absolute bound at the tensor's scale
    (an AMD EPYC gave 1.3e-6 on an embedding gradient of scale 1.0). A missing reduction or a wrong
    share is off by the gradient itself."""
    return max(1e-6, 32 * torch.finfo(torch.float32).eps * expected.abs().max().item())


def _close(actual, expected, name: str, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def _check_balance_mode(rank: int, balance: str, tmp_dir: Path, checkpointing: bool = False) -> None:
    cfg = tiny(balance=balance, bias_update_rate=0.01)
    batch = _batch(cfg)
    n_targets = float(batch[1][:, 1:].sum())
    halves = [tuple(t[r * B // WORLD:(r + 1) * B // WORLD] for t in batch) for r in range(WORLD)]
    # One rank, all experts. "bias" sums loads: the whole batch in one forward. "quantile" averages
    # a per-forward quantile: the same halves as micro-batches, as each rank's forward sees them.
    one = _train_step(_model(cfg), [batch] if balance == "bias" else halves, n_targets, lambda m: None)

    model = _model(cfg)
    model.shard_experts(dist.group.WORLD)
    model.set_activation_checkpointing(checkpointing)
    ep = _train_step(model, [halves[rank]], n_targets, _all_reduce_dense_grads)
    dist.all_reduce(ep["loss"])

    n_local = cfg.num_experts // WORLD
    mine = slice(rank * n_local, (rank + 1) * n_local)
    _close(ep["loss"], one["loss"], "loss")
    assert ep["stats"] == one["stats"], (ep["stats"], one["stats"])  # loads, replay agreement: all tokens
    grad_atol = {name: _grad_atol(grad) for name, grad in one["grads"].items()}
    for name, grad in one["grads"].items():
        _close(ep["grads"][name], grad[mine] if _is_expert(name) else grad, f"grad {name}", grad_atol[name])
    for name, value in one["state"].items():  # weights and router biases after the step
        # AdamW's first step moves a weight by lr * g / (|g| + eps): near g = 0 by lr / eps per unit
        # of gradient, so a weight carries its gradient's rounding times that slope
        atol = max(1e-6, ADAMW_LR / ADAMW_EPS * grad_atol[name]) if name in grad_atol else 1e-6
        _close(ep["state"][name], value[mine] if _is_expert(name) else value, name, atol)
    with pytest.raises(ValueError, match="already sharded"):
        model.shard_experts(dist.group.WORLD)
    with pytest.raises(ValueError, match="holds 2 of its 4 routed experts per layer"):
        save_pretrained(model, tmp_dir / f"rank{rank}")
    assert not (tmp_dir / f"rank{rank}").exists()


def _rank(rank: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for balance, checkpointing in (("bias", False), ("quantile", False), ("quantile", True)):
            _check_balance_mode(rank, balance, Path(init_file).parent, checkpointing)
        with pytest.raises(ValueError, match="num_experts 3 is not divisible by the group size 2"):
            build_model(tiny(num_experts=3)).shard_experts(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_ranks_equal_one_rank(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD)
