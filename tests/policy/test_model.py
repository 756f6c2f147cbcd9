"""Whole-model tests: the forward / cache / routing contract of docs/architecture.md."""
from __future__ import annotations

import pytest
import torch

from policy import ModelCache, build_model

from _policy_tiny import tiny


@pytest.fixture(scope="module", params=["mla", "dsa"])
def model(request):
    torch.manual_seed(0)
    # 5 layers, AttnRes blocks of 2 (3 blocks), global layers 4 and 5, dense first layer
    m = build_model(tiny(num_hidden_layers=5, global_attn=request.param, index_topk=3)).eval()
    with torch.no_grad():  # non-trivial AttnRes queries and MoE biases
        for n, p in m.named_parameters():
            if n.endswith("_res_proj.weight") or ".indexer." in n:
                p.normal_(0, 0.5)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return m


def test_toy_preset_shape_and_size():
    m = build_model("toy", vocab_size=512)
    cfg = m.config
    assert cfg.layer_types == ["kda", "kda", "kda", "mla"] and cfg.attn_res
    assert not m.model.layers[0].is_moe and all(layer.is_moe for layer in m.model.layers[1:])
    n = m.num_parameters()["total"]
    assert 1_000_000 <= n <= 3_000_000, n
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()  # untied
    x = torch.randint(0, 512, (2, 9))
    out = m(x, return_routing=True)
    assert out.logits.shape == (2, 9, 512) and out.logits.dtype == torch.float32
    assert out.routing.shape == (2, 9, 3, cfg.num_experts_per_token) and out.cache is None
    torch.testing.assert_close(m(x, logits_to_keep=1).logits, out.logits[:, -1:])


def test_prefill_then_decode_equals_full_forward(model):
    x = torch.randint(0, 64, (2, 14))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :6], use_cache=True)
        logits, cache = [out.logits], out.cache
        for s, e in [(6, 7), (7, 10), (10, 11), (11, 14)]:  # single tokens and multi-token steps
            out = model(x[:, s:e], cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=2e-5, rtol=1e-4)
    assert cache.lengths.tolist() == [14, 14]


def test_cache_is_not_mutated_and_clone_is_independent(model):
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        c = model(x, use_cache=True).cache
        snap = c.clone()
        a = model(x[:, :1], cache=c, use_cache=True).logits
        b = model(x[:, :1], cache=c, use_cache=True).logits  # same cache again: same answer
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    for l1, l2 in zip(c.layers, snap.layers):
        for f in ("state", "conv", "latent", "valid"):
            if hasattr(l1, f):
                assert torch.equal(getattr(l1, f), getattr(l2, f))
    assert snap.layers[0].state.data_ptr() != c.layers[0].state.data_ptr()


def test_select_and_concat_equal_separate_runs(model):
    torch.manual_seed(1)
    p1, p2 = torch.randint(0, 64, (1, 9)), torch.randint(0, 64, (1, 5))  # different lengths
    nxt = torch.randint(0, 64, (3, 3))
    with torch.no_grad():
        c1 = model(p1, use_cache=True).cache
        c2 = model(p2, use_cache=True).cache
        # fork prompt 1 into two rows, batch with prompt 2, decode 3 tokens together
        batch = ModelCache.concat([c1.select([0, 0]), c2])
        assert batch.batch_size == 3 and batch.lengths.tolist() == [9, 9, 5]
        got = []
        for t in range(3):
            o = model(nxt[:, t:t + 1], cache=batch, use_cache=True)
            got.append(o.logits)
            batch = o.cache
        got = torch.cat(got, 1)
        ref = [model(torch.cat([p, nxt[i:i + 1]], 1)).logits[:, -3:]
               for i, p in enumerate([p1, p1, p2])]
    torch.testing.assert_close(got, torch.cat(ref), atol=2e-5, rtol=1e-4)
    # select reorders rows too
    with torch.no_grad():
        swapped = batch.select(torch.tensor([2, 0]))
        o = model(nxt[[2, 0], :1], cache=swapped, use_cache=True).logits
        o_ref = model(nxt[:, :1], cache=batch, use_cache=True).logits[[2, 0]]
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-4)


def test_right_padding_does_not_reach_earlier_positions(model):
    x = torch.randint(3, 64, (1, 7))
    padded = torch.cat([torch.cat([x, torch.zeros(1, 3, dtype=torch.long)], 1), torch.randint(3, 64, (1, 10))])
    with torch.no_grad():
        torch.testing.assert_close(model(padded).logits[:1, :7], model(x).logits, atol=1e-5, rtol=1e-4)


def test_routing_replay_reproduces_and_forcing_changes_logits(model):
    x = torch.randint(0, 64, (2, 10))
    model.train()  # dropout-free; replay must also hold in train mode (the learner's case)
    try:
        out = model(x, return_routing=True)
        r = out.routing
        assert r.shape == (2, 10, len(model.config.moe_layers), model.config.num_experts_per_token)
        again = model(x, routing=r)
        assert torch.equal(again.logits, out.logits)
        forced = r.clone()
        forced[:, :, 0] = torch.tensor([0, 1])  # first MoE layer: experts 0 and 1 for every token
        other = model(x, routing=forced)
        assert not torch.allclose(other.logits, out.logits)
        again.logits.sum().backward()  # replay keeps the router differentiable
        router = model.model.layers[1].block_sparse_moe.gate.weight
        assert router.grad is not None and router.grad.abs().sum() > 0
    finally:
        model.zero_grad()
        model.eval()
        model.after_optimizer_step()  # drop statistics gathered in train mode


def test_after_optimizer_step_moves_biases_when_training():
    torch.manual_seed(0)
    m = build_model(tiny()).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 12))
    loss = torch.nn.functional.cross_entropy(m(x).logits[:, :-1].reshape(-1, 64), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    before = m.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.clone()
    stats = m.after_optimizer_step()
    after = m.model.layers[1].block_sparse_moe.gate.e_score_correction_bias
    assert "qk_clip_heads" in stats and not torch.equal(before, after)


def test_bad_inputs_raise_clear_errors(model):
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.randint(0, 64, (5,)))
    with pytest.raises(ValueError, match="routing"):
        model(torch.randint(0, 64, (1, 4)), routing=torch.zeros(1, 4, 1, 1, dtype=torch.long))
    with torch.no_grad():
        c = model(torch.randint(0, 64, (2, 4)), use_cache=True).cache
    with pytest.raises(ValueError, match="batch"):
        model(torch.randint(0, 64, (1, 1)), cache=c)


def test_repeated_scatter_does_not_grow_the_key_axis(model):
    """The rollout engine's pattern: feed one row alone, concat it back; gaps are compacted."""
    torch.manual_seed(2)
    prompt, extra, nxt = torch.randint(0, 64, (1, 6)), torch.randint(0, 64, (3, 4)), torch.randint(0, 64, (3, 1))
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache.select([0, 0, 0])
        for i in range(3):  # each row gets its own 4-token tool result, fed with B = 1
            row = model(extra[i:i + 1], cache=cache.select([i]), use_cache=True).cache
            parts = [cache.select(list(range(i))), row, cache.select(list(range(i + 1, 3)))]
            cache = ModelCache.concat([p for p in parts if p.batch_size])
        mla = [c for c in cache.layers if hasattr(c, "latent")][0]
        assert mla.seq_len == 10 and bool(mla.valid.all()) and cache.lengths.tolist() == [10, 10, 10]
        got = model(nxt, cache=cache, use_cache=True).logits[:, -1]
        ref = torch.cat([model(torch.cat([prompt, extra[i:i + 1], nxt[i:i + 1]], 1)).logits[:, -1]
                         for i in range(3)])
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


def test_fused_attention_path_matches_reference_in_decode_and_training(model):
    """The SDPA path the GPU takes (forced here on CPU) gives the reference's logits and gradients,
    for a prefill-and-decode with a padded batch and a training forward with DSA top-k."""
    from kimi_kernels.attention import attention_backend

    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = model(x).logits
        with attention_backend("sdpa"):
            fused = model(x).logits
            c = model(x[:, :7], use_cache=True).cache
            step = model(x[:, 7:9], cache=c).logits
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(step, ref[:, 7:9], atol=1e-5, rtol=1e-4)
    grads = []
    model.train()
    try:
        for backend in ("torch", "sdpa"):
            model.zero_grad(set_to_none=True)
            with attention_backend(backend):
                model(x).logits.logsumexp(-1).sum().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-4, rtol=1e-3, msg=n)


def test_token_logprobs_from_hidden_states_equal_the_logits_path():
    """return_token_logprobs (blockwise head + log-softmax, no logits) gives the same values,
    entropies and gradients as log_softmax over the full logits, at a sampling temperature."""
    torch.manual_seed(0)
    m = build_model(tiny(), dtype=torch.float64).train()
    ids = torch.randint(3, m.config.vocab_size, (2, 9))
    out = m(ids, return_token_logprobs=True, logit_scale=1 / 0.7)
    assert out.logits is None and out.token_logprobs.shape == out.token_entropy.shape == (2, 9)
    ref = torch.log_softmax(m(ids, logit_scale=1 / 0.7).logits[:, :-1], -1)
    want = torch.nn.functional.pad(ref.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
    torch.testing.assert_close(out.token_logprobs, want, rtol=1e-10, atol=1e-12)
    want_ent = torch.nn.functional.pad(-(ref.exp() * ref).sum(-1), (1, 0))
    torch.testing.assert_close(out.token_entropy, want_ent.detach(), rtol=1e-10, atol=1e-12)
    head = m.lm_head.weight
    got = torch.autograd.grad(out.token_logprobs.sum(), head)[0]
    assert torch.allclose(got, torch.autograd.grad(want.sum(), head)[0], rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="logits_to_keep"):
        m(ids, return_token_logprobs=True, logits_to_keep=1)
