"""The fused attention path (PyTorch SDPA) against the fp32 reference, run on CPU via backend="sdpa"."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels.attention import attention, attention_backend
from kimi_kernels.ops import masked_attention, topk_to_mask


def _qkv(B: int, Tq: int, Tk: int, Hq: int, Hk: int, Dk: int, Dv: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, Dk, generator=g)
    k = torch.randn(B, Tk, Hk, Dk, generator=g)
    v = torch.randn(B, Tk, Hk, Dv, generator=g)
    return q, k, v


@pytest.mark.parametrize("Dk,Dv", [(12, 16), (16, 8), (8, 8)])
def test_plain_causal_pads_head_dims_and_matches_reference(Dk: int, Dv: int):
    q, k, v = _qkv(2, 7, 7, 4, 2, Dk, Dv)
    ref = masked_attention(q, k, v, scale=0.3)
    out = attention(q, k, v, scale=0.3, key_mask=torch.ones(2, 7, dtype=torch.bool), backend="sdpa")
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)


def test_masks_topk_decode_and_empty_rows_match_reference():
    q, k, v = _qkv(2, 3, 9, 2, 1, 8, 6, seed=1)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    key_mask[0, :8] = False  # batch 0: its first query (position 6) sees no real key
    top = torch.randint(0, 9, (2, 3, 4), generator=torch.Generator().manual_seed(3))
    top[1, 0, 0] = -1
    sel = topk_to_mask(top, 9)
    ref = masked_attention(q, k, v, key_mask=key_mask, mask=sel)
    out = attention(q, k, v, key_mask=key_mask, mask=sel, backend="sdpa")
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0]))


def test_gradients_match_reference():
    q, k, v = _qkv(1, 6, 6, 2, 2, 8, 8, seed=2)
    key_mask = torch.tensor([[False, True, True, True, True, True]])
    grads = []
    for backend in ("torch", "sdpa"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        attention(*leaves, key_mask=key_mask, backend=backend).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.isfinite(b).all() and torch.allclose(a, b, atol=1e-4)


def test_backend_switch_and_reference_only_cases():
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, 8)
    sink = torch.tensor([0.5, -1.0])
    with attention_backend("sdpa"):  # a sink has no fused path: the reference answers
        assert torch.equal(attention(q, k, v, sink=sink), masked_attention(q, k, v, sink=sink))
    # on CPU "auto" is the reference itself
    assert torch.equal(attention(q, k, v), masked_attention(q, k, v))
    with pytest.raises(ValueError, match="backend"):
        attention(q, k, v, backend="flash3")


def test_grouped_query_heads_equal_keys_copied_per_head():
    """The reference shares each key head across its query heads (no copy): the same result as
    copying K and V once per query head, with every mask and a sink."""
    q, k, v = _qkv(2, 3, 9, 6, 2, 8, 5, seed=4)
    key_mask = torch.rand(2, 9, generator=torch.Generator().manual_seed(5)) > 0.3
    sel = topk_to_mask(torch.randint(0, 9, (2, 3, 4), generator=torch.Generator().manual_seed(6)), 9)
    sink = torch.linspace(-1, 1, 6)
    grouped = masked_attention(q, k, v, key_mask=key_mask, mask=sel, sink=sink)
    copied = masked_attention(q, k.repeat_interleave(3, dim=2), v.repeat_interleave(3, dim=2),
                              key_mask=key_mask, mask=sel, sink=sink)
    assert torch.allclose(grouped, copied, atol=1e-6)


def test_head_dims_past_the_fused_kernels_take_the_grouped_reference():
    """MLA's absorbed decode (one shared latent key head of dim > 256, a key mask): no fused kernel
    takes it, so the fused backend answers with the reference instead of SDPA's per-head copies."""
    q, k, v = _qkv(3, 1, 11, 8, 1, 288, 272, seed=7)
    key_mask = torch.ones(3, 11, dtype=torch.bool)
    key_mask[1, :4] = False
    out = attention(q, k, v, scale=0.05, key_mask=key_mask, backend="sdpa")
    assert torch.equal(out, masked_attention(q, k, v, scale=0.05, key_mask=key_mask))
