"""The MoE's row gathers (kimi_kernels/expert_rows.py) against their torch references.

They run on CUDA (bf16, what the learner uses) or, without a GPU, under Triton's interpreter in
float32 (its bf16 arithmetic is not the card's):
    TRITON_INTERPRET=1 PYTHONPATH=<triton's site> pytest tests/kernels/test_kernels_expert_rows.py
The last test runs this file's kernel tests there in a subprocess (tests/kernels/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels import expert_rows
from kimi_kernels.triton_support import runs_triton
from tests.kernels.triton_interpreter import DEVICE, ON_CUDA, needs_interpreter_site, run_under_interpreter

usable = pytest.mark.skipif(not runs_triton(torch.empty(0, device=DEVICE)),
                            reason="needs Triton with CUDA, or TRITON_INTERPRET=1")


def _pairs(n: int, k: int, d: int, dtype: torch.dtype, seed: int):
    """n tokens routed to k of 11 experts: the experts' rows [n*k, d] in expert order, the weights
    [n, k], pair_rows (where each token-expert pair lies in that order) and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(11, generator=g)[:k] for _ in range(n)]).reshape(-1)
    order = torch.argsort(ids, stable=True)
    pair_rows = expert_rows.row_of_pair(order)
    out = torch.randn(n * k, d, generator=g)
    w = torch.rand(n, k, generator=g)
    grad = torch.randn(n, d, generator=g)
    return (out.to(DEVICE, dtype), w.to(DEVICE), pair_rows.to(DEVICE), grad.to(DEVICE, dtype))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    # bf16: one rounding of a float32 sum either way, the order of the k terms may differ
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# k = 1, a power of two, and k = 6 (padded to 8 in the tile); widths not a multiple of the column block
CASES = [(37, 1, 300), (64, 8, 512), (29, 6, 2304 + 40)]


@usable
@pytest.mark.parametrize("n,k,d", CASES)
def test_token_sums_and_gradients_equal_the_references(n, k, d):
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    out, w, pair_rows, grad = _pairs(n, k, d, dtype, seed=n)
    _close(expert_rows.weighted_token_sums(out, w, pair_rows),
           expert_rows.weighted_token_sums_reference(out, w, pair_rows), dtype)
    got = expert_rows.weighted_token_sums_backward(grad, out, w, pair_rows)
    want = expert_rows.weighted_token_sums_backward_reference(grad, out, w, pair_rows)
    for a, b in zip(got, want):
        _close(a, b, dtype)
    _close(expert_rows.token_sums(out, pair_rows, k), expert_rows.token_sums_reference(out, pair_rows, k), dtype)


def test_the_references_are_the_gather_they_describe():
    """The CPU path, on one token by hand: its k rows found through pair_rows."""
    out, w, pair_rows, grad = _pairs(5, 3, 4, torch.float64, seed=3)
    out, w, pair_rows, grad = out.cpu(), w.cpu().double(), pair_rows.cpu(), grad.cpu()
    rows = out[pair_rows[6:9]]  # token 2's three rows
    y = expert_rows.weighted_token_sums_reference(out, w, pair_rows)
    torch.testing.assert_close(y[2], (w[2, :, None] * rows).sum(0))
    torch.testing.assert_close(expert_rows.token_sums_reference(out, pair_rows, 3)[2], rows.sum(0))
    grad_out, grad_w = expert_rows.weighted_token_sums_backward_reference(grad, out, w, pair_rows)
    torch.testing.assert_close(grad_out[pair_rows[7]], w[2, 1] * grad[2])
    torch.testing.assert_close(grad_w[2], rows @ grad[2])


@pytest.mark.skipif(runs_triton(torch.empty(0, device=DEVICE)), reason="the kernel tests run in this process")
@needs_interpreter_site
def test_the_kernel_tests_pass_under_triton_s_interpreter():
    run = run_under_interpreter(__file__, "equal_the_references")
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
