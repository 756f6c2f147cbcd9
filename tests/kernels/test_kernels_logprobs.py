"""linear_token_logprobs: the blockwise head + log-softmax equals the full-logits computation.

The row kernels (kimi_kernels/logit_rows.py) run on CUDA or, without a GPU, under Triton's interpreter:
    TRITON_INTERPRET=1 PYTHONPATH=<triton's site> pytest tests/kernels/test_kernels_logprobs.py -k row_kernels
The interpreter test runs those in a subprocess (tests/kernels/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels import logit_rows
from kimi_kernels.logprobs import linear_token_logprobs
from tests.kernels.triton_interpreter import DEVICE, needs_interpreter_site, run_under_interpreter

kernels_run_here = logit_rows.available(torch.empty(0, device=DEVICE))
usable = pytest.mark.skipif(not kernels_run_here, reason="needs Triton with CUDA, or TRITON_INTERPRET=1")


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


def _inputs(seed, n=13, d=8, vocab=40, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(device).requires_grad_(True)
    w = torch.randn(vocab, d, generator=g).to(device).requires_grad_(True)
    return h, w, torch.randint(0, vocab, (n,), generator=g).to(device), g


@usable
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("rows", [5, 13, None])
def test_the_row_kernels_equal_the_full_logits_path(monkeypatch, rows, keep):
    """float32 values and gradients of the full-logits path with the Triton row kernels: blocks of 5
    and 13 rows and the defaults (all rows at once where the output is kept; else 5 rows forward and
    10 backward), the head's output kept for the backward or recomputed; a vocabulary past one
    program's columns."""
    import kimi_kernels.logprobs as lp

    monkeypatch.setattr(lp, "_KERNEL_BLOCK_ELEMENTS", 5 * 9000)
    monkeypatch.setattr(lp, "_KERNEL_GRAD_BLOCK_ELEMENTS", 10 * 9000)
    monkeypatch.setattr(lp, "KEEP_LOGITS_BYTES", 1 << 40 if keep else 0)
    h, w, t, g = _inputs(3, vocab=9000, device=DEVICE)
    logp, ent = linear_token_logprobs(h, w, t, scale=1 / 0.7, block_rows=rows)
    ref_logp, ref_ent = _reference(h, w, t, 1 / 0.7)
    torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach().float(), rtol=1e-5, atol=1e-5)
    upstream = torch.randn(13, generator=g).to(DEVICE)
    got, want = torch.autograd.grad(logp, (h, w), upstream), torch.autograd.grad(ref_logp, (h, w), upstream)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.float(), rtol=1e-4, atol=1e-5)


@usable
def test_the_row_kernels_second_backward_recomputes_the_output_they_overwrote():
    """The kernels write the logits' gradient over the kept head output; a second backward through the
    same graph (retain_graph) runs the head's GEMM again instead of reading the overwritten values."""
    h, w, t, _ = _inputs(5, device=DEVICE)
    logp, _ = linear_token_logprobs(h, w, t, scale=0.9)
    first = torch.autograd.grad(logp.sum(), (h, w), retain_graph=True)
    second = torch.autograd.grad(logp.sum(), (h, w))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 under the interpreter is not the GPU's")
def test_the_row_kernels_in_bfloat16_equal_the_torch_ops_on_the_same_logits():
    z = (3 * torch.randn(64, 163_840, device="cuda")).bfloat16()
    t = torch.randint(0, 163_840, (64,), device="cuda")
    import kimi_kernels.logprobs as lp

    want_statistics = lp.block_statistics(z, t, 0.8)
    for got, want in zip(logit_rows.row_statistics(z, t, 0.8), want_statistics):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    lse, g = want_statistics[0], torch.randn(64, device="cuda")
    want = lp.block_logit_grad(z, lse, t, g, 0.8)
    torch.testing.assert_close(logit_rows.logit_grad_(z.clone(), lse, t, g, 0.8), want, rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(kernels_run_here, reason="the kernel tests run in this process")
@needs_interpreter_site
def test_the_row_kernel_tests_pass_under_triton_s_interpreter():
    run = run_under_interpreter(__file__, "row_kernels")
    assert run.returncode == 0 and "7 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_a_block_holds_twice_the_rows_with_the_kernels_and_all_of_them_when_kept():
    """Op by op a block materialises float32 copies of its logits; the kernels hold only its logits in
    h's dtype: twice the rows, more in the backward (fewer passes over dW), the whole call at once
    where the output is kept."""
    import kimi_kernels.logprobs as lp

    h = torch.zeros(2000, 8)
    assert lp._block_rows(h, 163_840, None, kernels=False, keep=True) == (409, 409)
    assert lp._block_rows(h, 163_840, None, kernels=True, keep=False) == (819, 3276)
    assert lp._block_rows(h, 163_840, None, kernels=True, keep=True) == (2000, 2000)
    assert lp._block_rows(h, 163_840, 7, kernels=True, keep=True) == (7, 7)


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


def test_bf16_gradient_gemms_keep_the_float32_logprobs_and_gradient_dtypes():
    """grad_dtype=bfloat16 (a CPU learner's mixed precision): the forward is the float32 one, bit for
    bit; the gradients come back in float32, within bf16's rounding of the float32 ones."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(40, 32, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(300, 32, generator=g)).requires_grad_(True)
    t = torch.randint(0, 300, (40,), generator=g)
    upstream = torch.randn(40, generator=g)
    exact, _ = linear_token_logprobs(h, w, t, 0.8, block_rows=16)
    mixed, _ = linear_token_logprobs(h, w, t, 0.8, block_rows=16, grad_dtype=torch.bfloat16)
    assert torch.equal(exact, mixed)
    want = torch.autograd.grad(exact, (h, w), upstream)
    got = torch.autograd.grad(mixed, (h, w), upstream)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        assert not torch.equal(a, b)  # the GEMMs did run in bf16
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2 * float(b.abs().max()))
