"""The hybrid policy on a packed row (several sequences end to end, `cu_seqlens`) equals the same
sequences right-padded: token logprobs, gradients, MoE load and routing agreement, QK-Clip's statistic,
with and without activation checkpointing, MLA and DSA global layers; the DSA indexer loss; and a long
tail of lengths padded only among like lengths."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels.varlen import PAD_ALLOWANCE, PAD_SLACK
from policy import HybridForCausalLM
from _policy_tiny import tiny

LENGTHS = [17, 5, 40, 9, 1, 33]


def batches(vocab: int, n_moe: int, top_k: int):
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]
    routes = [torch.randint(0, 4, (n, n_moe, top_k), generator=gen) for n in LENGTHS]
    for r in routes:  # distinct experts per token; the last token's never recorded (never fed)
        r[..., 1] = (r[..., 0] + 1) % 4
        r[-1] = -1
    B, T = len(LENGTHS), max(LENGTHS)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    routing = torch.full((B, T, n_moe, top_k), -1, dtype=torch.long)
    for i, (s, r) in enumerate(zip(seqs, routes)):
        ids[i, :len(s)], mask[i, :len(s)], routing[i, :len(s)] = s, True, r
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return (ids, mask, routing), (torch.cat(seqs)[None], cu, torch.cat(routes)[None])


def spread_router_scores(model) -> None:
    """At initialisation the router's scores nearly tie, and its own top-k (the routing-agreement
    statistic) flips with the last bit of a float32 product; spread them so that it does not."""
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.is_moe:
                layer.block_sparse_moe.gate.weight.normal_(0.0, 1.0)


def run(model, ids, routing, **kw):
    model.zero_grad()
    out = model(ids, routing=routing, return_token_logprobs=True, logit_scale=1 / 0.7, **kw)
    weight = torch.linspace(-1, 1, out.token_logprobs.numel(), dtype=out.token_logprobs.dtype)
    (out.token_logprobs.flatten() * weight).sum().backward()  # a loss that weighs every token differently
    moe = model.moe_statistics()
    qk = [layer.self_attn.qk_max.clone() for layer in model.model.layers if layer.kind != "kda"]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.after_optimizer_step()  # resets the statistics (nothing else with balance "none", no QK-Clip)
    return out.token_logprobs, moe, qk, grads


@pytest.mark.parametrize("global_attn", ["mla", "dsa"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_packed_row_equals_the_padded_batch(global_attn, checkpointing):
    torch.manual_seed(0)
    cfg = tiny(global_attn=global_attn, index_topk=8, qk_clip_tau=None, balance="none")  # nothing moves between runs
    model = HybridForCausalLM(cfg).double().train()
    spread_router_scores(model)
    model.set_activation_checkpointing(checkpointing)
    (ids, mask, routing), (packed_ids, cu, packed_routing) = batches(cfg.vocab_size, len(cfg.moe_layers),
                                                                     cfg.num_experts_per_token)
    # the padded batch's weight per token, laid out as the packed row's
    padded = run(model, ids, routing, token_mask=mask)
    packed = run(model, packed_ids, packed_routing, cu_seqlens=cu)
    logp_padded = torch.cat([padded[0][i, :n] for i, n in enumerate(LENGTHS)])
    torch.testing.assert_close(packed[0][0], logp_padded, rtol=0, atol=1e-6)
    assert packed[1]["load"].keys() == padded[1]["load"].keys()
    for layer in padded[1]["load"]:
        assert packed[1]["load"][layer] == pytest.approx(padded[1]["load"][layer], abs=1e-12)
    assert packed[1]["routing_agreement"] == pytest.approx(padded[1]["routing_agreement"])
    for a, b in zip(packed[2], padded[2]):
        torch.testing.assert_close(a, b)


def test_packed_gradients_equal_padded_gradients():
    """The loss weights each token by its place in the packed row, the padded batch's by the same
    token's weight: the gradients then agree (float64, up to the router's float32 scores)."""
    torch.manual_seed(0)
    cfg = tiny()
    model = HybridForCausalLM(cfg).double().train()
    (ids, mask, routing), (packed_ids, cu, packed_routing) = batches(cfg.vocab_size, len(cfg.moe_layers),
                                                                     cfg.num_experts_per_token)
    weight = torch.randn(sum(LENGTHS), dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    model.zero_grad()
    out = model(packed_ids, routing=packed_routing, return_token_logprobs=True, cu_seqlens=cu)
    (out.token_logprobs[0] * weight).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = model(ids, routing=routing, return_token_logprobs=True, token_mask=mask)
    per_row = torch.zeros(ids.shape, dtype=torch.float64)
    offset = 0
    for i, n in enumerate(LENGTHS):
        per_row[i, :n] = weight[offset:offset + n]
        offset += n
    (out.token_logprobs * per_row).sum().backward()
    padded = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert packed.keys() == padded.keys()
    scale = max(float(g.abs().max()) for g in padded.values())
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-6, atol=1e-7 * scale, msg=name)


def test_a_sequence_first_token_has_no_logprob_and_a_packed_row_takes_no_cache():
    cfg = tiny()
    model = HybridForCausalLM(cfg).eval()
    ids = torch.randint(3, cfg.vocab_size, (1, 12))
    cu = torch.tensor([0, 5, 12])
    with torch.no_grad():
        out = model(ids, return_token_logprobs=True, cu_seqlens=cu)
    assert out.token_logprobs[0, 0] == 0 and out.token_logprobs[0, 5] == 0 and (out.token_logprobs[0, 6:] != 0).all()
    with pytest.raises(ValueError, match="training forward"):
        model(ids, use_cache=True, cu_seqlens=cu)


def test_the_dsa_indexer_loss_of_a_packed_row_is_the_padded_batch_s():
    """Both the mean over the real queries of every DSA layer (padding teaches the indexer nothing)."""
    torch.manual_seed(0)
    cfg = tiny(global_attn="dsa", index_topk=8)
    model = HybridForCausalLM(cfg).double().train()
    (ids, mask, routing), (packed_ids, cu, packed_routing) = batches(cfg.vocab_size, len(cfg.moe_layers),
                                                                     cfg.num_experts_per_token)
    padded = model(ids, routing=routing, token_mask=mask, return_indexer_loss=True).indexer_loss
    packed = model(packed_ids, routing=packed_routing, cu_seqlens=cu, return_indexer_loss=True).indexer_loss
    torch.testing.assert_close(packed, padded, rtol=1e-6, atol=0)  # the indexer scores in float32
    # the padding is not averaged in: a longer padded batch (the same tokens) gives the same loss
    pad = torch.nn.functional.pad
    wider = model(pad(ids, (0, 7)), routing=pad(routing, (0, 0, 0, 0, 0, 7), value=-1), token_mask=pad(mask, (0, 7)),
                  return_indexer_loss=True).indexer_loss
    torch.testing.assert_close(wider, padded, rtol=1e-6, atol=0)


def test_a_long_tail_row_pads_its_short_sequences_to_their_own_lengths():
    """A global layer runs a packed row as batches of like lengths: one 300-token sequence beside
    thirty short ones costs at most max(PAD_SLACK x, x + PAD_ALLOWANCE) slots per sequence of x tokens
    (all padded to 300: ~9x)."""
    torch.manual_seed(0)
    cfg = tiny()
    model = HybridForCausalLM(cfg).eval()
    lengths = [300] + [4 + (7 * i) % 23 for i in range(30)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.randint(3, cfg.vocab_size, (1, sum(lengths)))
    slots = []
    count = lambda module, inputs, output: slots.append(inputs[0].shape[:2].numel())  # noqa: E731
    hooks = [layer.self_attn.o_proj.register_forward_hook(count) for layer in model.model.layers if layer.kind != "kda"]
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu, return_token_logprobs=True).token_logprobs[0]
        alone = torch.cat([model(ids[:, a:b], return_token_logprobs=True).token_logprobs[0]
                           for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    for h in hooks:
        h.remove()
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    per_layer = sum(slots) / len(hooks) / 2  # each layer ran twice: packed, then alone
    assert per_layer <= sum(max(PAD_SLACK * n, n + PAD_ALLOWANCE) for n in lengths), (per_layer, sum(lengths))
