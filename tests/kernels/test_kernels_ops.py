"""Reference ops: norms, SiTU-GLU bound, short conv windows, masked attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimi_kernels.ops import (l2norm, masked_attention, masked_logit_max, rms_norm, short_conv, situ_glu, topk_mask,
                         topk_to_mask)


def test_rms_norm_and_l2norm():
    x = torch.randn(3, 8, dtype=torch.float64)
    w = torch.rand(8, dtype=torch.float64)
    expect = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(rms_norm(x, w), expect, atol=1e-12)
    assert torch.allclose(l2norm(x), x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6), atol=1e-12)
    xb = x.bfloat16()
    assert rms_norm(xb, w.bfloat16()).dtype == torch.bfloat16 and l2norm(xb).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7))


def test_situ_glu_formula_and_bound():
    g = torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64)
    u = torch.linspace(1e4, -1e4, 2001, dtype=torch.float64)
    h = situ_glu(g, u)
    expect = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(h, expect, atol=1e-12)
    assert h.abs().max().item() <= 100.0
    big = situ_glu(torch.full((4,), 1e30), torch.full((4,), -1e30))
    assert torch.isfinite(big).all() and big.abs().max().item() <= 100.0
    assert big.abs().max().item() > 99.0  # the bound is approached, not a smaller cap
    # the sigmoid sees the uncapped gate: g = 8 -> 4 tanh(2) sigmoid(8)
    one = situ_glu(torch.tensor([8.0], dtype=torch.float64), torch.tensor([25.0], dtype=torch.float64))
    t = torch.tensor
    assert torch.allclose(one, 4 * torch.tanh(t(2.0)) * torch.sigmoid(t(8.0)) * 25 * torch.tanh(t(1.0)).double())
    assert situ_glu(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_short_conv_matches_conv1d_and_window_decode():
    torch.manual_seed(0)
    B, T, D, W = 2, 9, 5, 4
    x = torch.randn(B, T, D, dtype=torch.float64)
    w = torch.randn(D, W, dtype=torch.float64)
    b = torch.randn(D, dtype=torch.float64)
    y, win = short_conv(x, w, b)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w.unsqueeze(1), b, groups=D)).transpose(1, 2)
    assert torch.allclose(y, ref, atol=1e-12)
    assert torch.equal(win, x[:, -(W - 1):])
    # prefill 4 tokens, then one token at a time with the carried window == full pass
    y0, win = short_conv(x[:, :4], w, b)
    outs = [y0]
    for t in range(4, T):
        yt, win = short_conv(x[:, t:t + 1], w, b, window=win)
        outs.append(yt)
    assert torch.allclose(torch.cat(outs, 1), y, atol=1e-12)
    # Conv1d's [D, 1, W] weight layout and no activation
    y2, _ = short_conv(x, w.unsqueeze(1), None, activation=None)
    assert torch.allclose(y2, F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w.unsqueeze(1), groups=D).transpose(1, 2))
    with pytest.raises(ValueError, match="window"):
        short_conv(x, w, b, window=torch.zeros(B, W, D))
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(D + 1, W))


def _dense(q, k, v, mask, sink=None):
    logits = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    logits = logits.masked_fill(~mask, float("-inf"))
    if sink is not None:
        logits = torch.cat([logits, sink.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)], -1)
    p = logits.softmax(-1)[..., : k.shape[1]]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def test_masked_attention_causal_matches_sdpa_with_gqa():
    torch.manual_seed(1)
    q = torch.randn(2, 6, 4, 8, dtype=torch.float64)
    k = torch.randn(2, 6, 2, 8, dtype=torch.float64)
    v = torch.randn(2, 6, 2, 3, dtype=torch.float64)
    out = masked_attention(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12)
    # decode: the last query alone against all keys == the last row of the full pass
    assert torch.allclose(masked_attention(q[:, -1:], k, v), out[:, -1:], atol=1e-12)


def test_masked_attention_key_mask_topk_and_sink():
    torch.manual_seed(2)
    B, T, H, D = 1, 5, 2, 4
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.float64) for _ in range(3))
    key_mask = torch.tensor([[True, False, True, True, True]])
    idx = torch.tensor([[[0, -1], [0, 1], [2, 0], [3, 1], [4, 2]]])
    sink = torch.tensor([0.5, -1.0], dtype=torch.float64)
    out = masked_attention(q, k, v, key_mask=key_mask, mask=topk_to_mask(idx, T), sink=sink)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal & key_mask[:, None, None, :] & topk_to_mask(idx, T)[:, None]
    assert torch.allclose(out, _dense(q, k, v, mask, sink), atol=1e-12)
    # top-k covering every key == dense causal attention
    all_idx = torch.arange(T).expand(B, T, T)
    assert torch.allclose(masked_attention(q, k, v, mask=topk_to_mask(all_idx, T)), masked_attention(q, k, v),
                          atol=1e-12)
    # a row whose only key is masked gives zeros (no sink) rather than NaN
    o2 = masked_attention(q, k, v, key_mask=torch.tensor([[False, True, True, True, True]]))
    assert torch.equal(o2[:, 0], torch.zeros_like(o2[:, 0])) and torch.isfinite(o2).all()


def test_masked_attention_gradients_finite_with_masked_rows():
    q, k, v = (torch.randn(1, 3, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = masked_attention(q, k, v, key_mask=torch.tensor([[False, True, True]]))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_masked_attention_bad_shapes():
    q = torch.randn(1, 3, 3, 4)
    with pytest.raises(ValueError, match="must divide"):
        masked_attention(q, torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4))
    with pytest.raises(ValueError, match="key_mask"):
        masked_attention(q, torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4), key_mask=torch.ones(1, 2, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_mask_keeps_what_a_stable_sort_keeps(dtype: torch.dtype):
    g = torch.Generator().manual_seed(5)
    # coarse values: many ties, also across the k-th place; -inf (masked keys) and -0.0 included
    scores = torch.randint(-3, 4, (3, 7, 40), generator=g).to(dtype)
    scores[0, :, 30:] = float("-inf")
    scores[1, 2] = float("-inf")
    scores[2, 0, ::3] = -0.0
    for k in (1, 5, 17, 35, 39):
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        assert torch.equal(topk_mask(scores, k), topk_to_mask(order, 40)), k
    assert topk_mask(scores, 40).all() and topk_mask(scores, 80).all() and not topk_mask(scores, 0).any()


def test_masked_logit_max_is_the_largest_visible_scaled_logit_per_head():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 3, 4, generator=g), torch.randn(2, 9, 3, 4, generator=g)
    visible = torch.rand(2, 6, 9, generator=g) > 0.6
    visible[:, :, :] &= torch.tensor([True, True, False])[None, None, :].repeat(1, 1, 3)  # ragged rows
    out = masked_logit_max(q, k, visible, 0.5)
    for h in range(3):
        want = max((0.5 * q[b, t, h] @ k[b, s, h]).item() for b in range(2) for t in range(6) for s in range(9)
                   if visible[b, t, s])
        assert abs(out[h].item() - want) < 1e-6
    assert torch.isneginf(masked_logit_max(q, k, torch.zeros_like(visible), 0.5)).all()
