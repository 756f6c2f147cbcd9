"""linear_token_logprobs: the blockwise head + log-softmax equals the full-logits computation."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels.logprobs import linear_token_logprobs


def _reference(h, w, t, scale):
    logp = torch.log_softmax((h @ w.t()).double() * scale, dim=-1)
    return logp.gather(1, t[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("block_rows", [1, 3, 7, None])
def test_values_entropy_and_gradients_equal_full_logits(block_rows):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    logp, ent = linear_token_logprobs(h, w, t, scale=0.7, block_rows=block_rows)
    ref_logp, ref_ent = _reference(h, w, t, 0.7)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-12, atol=1e-12)
    assert not ent.requires_grad
    upstream = torch.randn(7, dtype=torch.float64, generator=g)
    got = torch.autograd.grad(logp, (h, w), upstream)
    want = torch.autograd.grad(ref_logp, (h, w), upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.tensor([0, 5, 2, 2])
    assert torch.autograd.gradcheck(lambda a, b: linear_token_logprobs(a, b, t, 1.3, block_rows=3)[0], (h, w))


def test_bfloat16_matches_the_full_logits_path():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(20, 16, generator=g).bfloat16().requires_grad_(True)
    w = (0.3 * torch.randn(50, 16, generator=g)).bfloat16().requires_grad_(True)
    t = torch.randint(0, 50, (20,), generator=g)
    logp, _ = linear_token_logprobs(h, w, t, block_rows=6)
    full = torch.log_softmax((h @ w.t()).float(), -1).gather(1, t[:, None]).squeeze(1)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, full, rtol=1e-4, atol=1e-4)
    dh, dw = torch.autograd.grad(logp.sum(), (h, w))
    rh, rw = torch.autograd.grad(full.sum(), (h, w))
    assert dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(dh.float(), rh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.float(), rw.float(), rtol=2e-2, atol=2e-2)


def test_bad_shapes_fail_with_one_line_messages():
    h, w = torch.randn(3, 4), torch.randn(9, 4)
    for args, what in [((h, torch.randn(9, 5), torch.zeros(3, dtype=torch.long)), "weight"),
                       ((h, w, torch.zeros(4, dtype=torch.long)), "targets"),
                       ((h, w, torch.zeros(3)), "targets")]:
        with pytest.raises(ValueError, match=what) as e:
            linear_token_logprobs(*args)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_the_compiled_block_chains_equal_the_full_logits_path(monkeypatch, backend):
    """The per-block chains as CUDA runs them (compiled, kimi_kernels/fusion.py), here on the CPU:
    float32 values and gradients of the full-logits path, two block sizes (two compiled shapes) and
    the default blocks, whose backward ones are larger than the forward's."""
    import kimi_kernels.fusion as fusion
    import kimi_kernels.logprobs as lp

    monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "_BACKEND", backend)
    monkeypatch.setattr(lp, "block_statistics", fusion.fused_on_cuda(lp.block_statistics.__wrapped__))
    monkeypatch.setattr(lp, "block_logit_grad", fusion.fused_on_cuda(lp.block_logit_grad.__wrapped__))
    torch._dynamo.reset()
    prev = fusion.set_fusion(True)
    try:
        g = torch.Generator().manual_seed(3)
        h = torch.randn(13, 8, generator=g, requires_grad=True)
        w = torch.randn(40, 8, generator=g, requires_grad=True)
        t = torch.randint(0, 40, (13,), generator=g)
        # None: the default blocks, here 5 rows forward and 10 backward (the backward's are larger)
        monkeypatch.setattr(lp, "_FUSED_BLOCK_ELEMENTS", 5 * 40)
        monkeypatch.setattr(lp, "_FUSED_GRAD_BLOCK_ELEMENTS", 10 * 40)
        for rows in (5, 13, None):
            logp, ent = linear_token_logprobs(h, w, t, scale=1 / 0.7, block_rows=rows)
            ref_logp, ref_ent = _reference(h, w, t, 1 / 0.7)
            torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ent, ref_ent.detach().float(), rtol=1e-5, atol=1e-5)
            upstream = torch.randn(13, generator=g)
            got, want = torch.autograd.grad(logp, (h, w), upstream), torch.autograd.grad(ref_logp, (h, w), upstream)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)
    finally:
        fusion.set_fusion(prev)
        torch._dynamo.reset()


def test_a_fused_block_holds_twice_the_rows_of_an_unfused_one(monkeypatch):
    """Unfused, a block materialises float32 copies of its logits; fused, only its logits and their
    gradient in h's dtype: the default block doubles where the chains run compiled."""
    import kimi_kernels.fusion as fusion
    import kimi_kernels.logprobs as lp

    h = torch.zeros(2, 8)
    prev = fusion.set_fusion(True)
    try:
        assert lp._block_rows(h, 163_840, None) == (409, 409)
        monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
        assert lp._block_rows(h, 163_840, None) == (819, 3276)  # the backward's blocks 4x: fewer passes over dW
        assert lp._block_rows(h, 163_840, 7) == (7, 7)
        fusion.set_fusion(False)
        assert lp._block_rows(h, 163_840, None) == (409, 409)
    finally:
        fusion.set_fusion(prev)


def _backward_flops(h, w, t, rows):
    from torch.utils.flop_counter import FlopCounterMode

    logp, _ = linear_token_logprobs(h, w, t, block_rows=rows)
    with FlopCounterMode(display=False) as counter:
        grads = torch.autograd.grad(logp.sum(), (h, w))
    return counter.get_total_flops(), grads


def test_the_backward_reuses_the_head_output_kept_within_the_budget(monkeypatch):
    """Within KEEP_LOGITS_BYTES the backward does not run the head's forward GEMM again (2 N V d
    FLOPs); past the budget it does; the gradients are the same."""
    import kimi_kernels.logprobs as lp

    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (12,), generator=g)
    kept_flops, kept = _backward_flops(h, w, t, rows=5)
    monkeypatch.setattr(lp, "KEEP_LOGITS_BYTES", 12 * 30 * 8 - 1)  # one byte short of this call's head output
    recomputed_flops, recomputed = _backward_flops(h, w, t, rows=5)
    assert recomputed_flops - kept_flops == 2 * 12 * 30 * 8
    for a, b in zip(kept, recomputed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.no_grad():  # a call without gradient keeps nothing
        monkeypatch.setattr(lp, "KEEP_LOGITS_BYTES", 1 << 40)
        ctx_free, _ = linear_token_logprobs(h, w, t, block_rows=5)
    assert ctx_free.grad_fn is None
