"""Activation checkpointing: the same loss, gradients and MoE statistics as storing activations,
with less stored for backward."""
from __future__ import annotations

import copy

import pytest
import torch

from policy import build_model

from _policy_tiny import tiny


def _pair(global_attn: str, balance: str):
    torch.manual_seed(0)
    m = build_model(tiny(num_hidden_layers=5, global_attn=global_attn, balance=balance, index_topk=3)).train()
    with torch.no_grad():  # non-trivial AttnRes queries and router biases
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight"):
                p.normal_(0, 0.5)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    ckpt = copy.deepcopy(m)
    ckpt.set_activation_checkpointing(True)
    return m, ckpt


def _inputs(model):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False  # right padding: never counted in the statistics
    n_moe, k, E = len(model.moe_layer_ids), model.config.num_experts_per_token, model.config.num_experts
    routing = torch.randint(0, E, (3, 11, n_moe, k), generator=g)
    routing = torch.where(torch.rand(3, 11, n_moe, 1, generator=g) < 0.5, -1, routing)  # half not recorded
    routing[..., 1] = torch.where(routing[..., 0] >= 0, (routing[..., 0] + 1) % E, -1)  # k distinct experts
    return ids, mask, routing


def _loss(model, ids, mask, routing):
    out = model(ids, routing=routing, token_mask=mask, return_token_logprobs=True, return_indexer_loss=True)
    loss = -(out.token_logprobs * mask).sum() / mask.sum()
    return loss + out.indexer_loss if out.indexer_loss is not None else loss


def _saved_bytes(model, *inputs) -> int:
    """Bytes kept for backward outside checkpointed regions (a checkpoint's own hooks take its layer's)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, *inputs)
    return total


@pytest.mark.parametrize("global_attn,balance", [("mla", "bias"), ("dsa", "quantile")])
def test_checkpointing_matches_stored_activations(global_attn, balance):
    plain, ckpt = _pair(global_attn, balance)
    inputs = _inputs(plain)
    losses = [_loss(m, *inputs) for m in (plain, ckpt)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
        else:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    # statistics counted once (not again by the recomputation), so the balancing step is the same
    assert ckpt.moe_statistics() == plain.moe_statistics()
    assert plain.moe_statistics()["routing_agreement"] is not None
    buffers = dict(ckpt.named_buffers())
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=0, atol=0, msg=name)
    plain.after_optimizer_step(), ckpt.after_optimizer_step()
    for name, b in plain.named_buffers():
        torch.testing.assert_close(buffers[name], b, rtol=0, atol=0, msg=name)


def test_recomputation_replays_the_first_passes_routes():
    """A router bias that moved between forward and backward must not change the gradient: the
    backward is of the forward that ran, experts included."""
    plain, ckpt = _pair("mla", "bias")
    ids, mask, _ = _inputs(plain)
    losses = [_loss(m, ids, mask, None) for m in (plain, ckpt)]
    with torch.no_grad():
        for n, b in ckpt.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.arange(b.numel(), dtype=b.dtype))  # would route every token to the last experts
    for loss in losses:
        loss.backward()
    grads = dict(ckpt.named_parameters())
    for name, p in plain.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_checkpointing_stores_less_and_only_in_training():
    plain, ckpt = _pair("mla", "bias")
    inputs = _inputs(plain)
    stored, recomputed = _saved_bytes(plain, *inputs), _saved_bytes(ckpt, *inputs)
    assert recomputed < stored / 2, (recomputed, stored)
    ckpt.eval()  # an evaluation forward with grad, and forwards without grad, store as usual
    assert _saved_bytes(ckpt, *inputs) == _saved_bytes(plain.eval(), *inputs)
    with torch.no_grad():
        ckpt.train()
        torch.testing.assert_close(_loss(ckpt, *inputs), _loss(plain.train(), *inputs), rtol=0, atol=0)
