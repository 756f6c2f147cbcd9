"""One pass over each row of the LM head's output: Triton kernels for what `linear_token_logprobs`
does between the head's GEMMs.

For a row z of the head's output (h's dtype), its target t, the logit scale s and the upstream
gradient g of log p(t):

    lse = logsumexp(s z),  logp = s z_t - lse,  entropy = lse - sum_j softmax(s z)_j s z_j
    dz  = s g (onehot(t) - exp(s z - lse))

`row_statistics` reads each row once, keeping a running maximum, the sum of exponentials and their
z-weighted sum in fp32 (rescaled when the maximum grows); `logit_grad_` writes dz over z in place.
Compiled by inductor as elementwise chains they took 4.6 + 4.5 ms of a 132.8 ms learner step of the
Kimi-Linear shape at 8K tokens on an H100, where one read (and one write) of the 2.7 GB of bf16 logits
is ~0.8 ms each at the card's bandwidth; these kernels took 1.23 + 1.41 ms on an H200 (2026-12-06). They
need Triton and CUDA tensors, or Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, how the tests
run them without a GPU; `linear_token_logprobs` keeps torch's ops as the CPU path and the oracle.
"""
from __future__ import annotations

import torch

from .triton_support import runs_triton, tl, triton

__all__ = ["available", "logit_grad_", "row_statistics"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# columns a program reads at a time (bf16: 16 KiB), and warps over them
_BLOCK_V = 8192
_WARPS = 16


def available(z: torch.Tensor) -> bool:
    """Triton importable, z where its kernels run (CUDA, or any tensor under the interpreter) and of a
    dtype they take."""
    return runs_triton(z) and z.dtype in _DTYPES


if triton is not None:

    @triton.jit
    def _statistics_kernel(z_ptr, t_ptr, lse_ptr, logp_ptr, ent_ptr, V, stride_z, scale, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_z
        m = -float("inf")  # running maximum of s z
        total = 0.0  # sum of exp(s z - m)
        weighted = 0.0  # sum of exp(s z - m) s z
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32) * scale
            m_new = tl.maximum(m, tl.max(x, 0))
            rescale = tl.exp(m - m_new)
            p = tl.exp(x - m_new)
            total = total * rescale + tl.sum(p, 0)
            weighted = weighted * rescale + tl.sum(tl.where(ok, p * x, 0.0), 0)
            m = m_new
        lse = m + tl.log(total)
        target = tl.load(t_ptr + row)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, tl.load(z_row + target).to(tl.float32) * scale - lse)
        tl.store(ent_ptr + row, lse - weighted / total)

    @triton.jit
    def _logit_grad_kernel(z_ptr, lse_ptr, t_ptr, g_ptr, V, stride_z, scale, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = cols < V
        ptrs = z_ptr + row * stride_z + cols
        x = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        p = tl.exp(x * scale - tl.load(lse_ptr + row))
        hit = tl.where(cols == tl.load(t_ptr + row), 1.0, 0.0)
        g = tl.load(g_ptr + row).to(tl.float32) * scale
        tl.store(ptrs, ((hit - p) * g).to(z_ptr.dtype.element_ty), mask=ok)


def _rows(z: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logit rows: need z [N, V] with unit column stride, got {tuple(z.shape)} "
                         f"strides {z.stride()}")


def row_statistics(z: torch.Tensor, targets: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """z [N, V] (bf16, fp16 or fp32), targets [N] int64: (logsumexp, log p(target), entropy) of
    softmax(scale * z) per row, each [N] float32."""
    _rows(z)
    n, vocab = z.shape
    targets = targets.contiguous()
    lse, logp, entropy = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        _statistics_kernel[(n,)](z, targets, lse, logp, entropy, vocab, z.stride(0), float(scale),
                                 BLOCK_V=_BLOCK_V, num_warps=_WARPS)
    return lse, logp, entropy


def logit_grad_(z: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Overwrites z [N, V] with the gradient of sum_i grad_logp_i log p_i(target_i) with respect to
    it, scale * grad_logp_i * (onehot(target_i) - softmax(scale * z_i)); returns z."""
    _rows(z)
    n, vocab = z.shape
    # a gradient from a sum arrives expanded (stride 0): the kernel reads one value per row
    lse, targets, grad_logp = lse.contiguous(), targets.contiguous(), grad_logp.contiguous()
    if n:
        _logit_grad_kernel[(n, triton.cdiv(vocab, _BLOCK_V))](z, lse, targets, grad_logp, vocab, z.stride(0),
                                                             float(scale), BLOCK_V=_BLOCK_V, num_warps=_WARPS)
    return z
