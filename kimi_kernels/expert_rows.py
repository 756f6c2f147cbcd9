"""The routed experts' rows between the grouped GEMMs and the tokens: Triton kernels that gather.

The experts see the N*k token-expert pairs sorted by expert; `pair_rows[t*k + c]` is where token t's
c-th pair lies in that order (the inverse of the sort). With out [M = N*k, d] the experts' output rows
and w [N, k] the routing weights:

    y[t]       = sum_c w[t, c] out[pair_rows[t*k + c]]                 (weighted_token_sums)
    d out[r]   = w[t, c] dy[t]          for r = pair_rows[t*k + c]     (its backward: one pass over
    d w[t, c]  = dy[t] . out[pair_rows[t*k + c]]                        dy and the rows)

The sums (the forward, and token_sums: the experts' input rows' gradient, each token's k rows added)
run a program per token and column block that reads the token's k rows one after another as 1-D
loads; the backward a program per token walking its k rows as [k, BLOCK_D] tiles (k padded to a
power of two), reducing each tile along its columns for the weights' gradient. Either way an index
is read once per row, not once per element, and the gathers need no atomics. Figures:
benchmarks/moe_rows_gpu.py, recorded in benchmarks/RESULTS.md.
Accumulation in float32. They need Triton and CUDA tensors, or Triton's interpreter
(TRITON_INTERPRET=1) on CPU tensors; the torch functions below are the CPU path and the oracle.
"""
from __future__ import annotations

import torch

from .fusion import fusion_enabled
from .triton_support import runs_triton, tl, triton

__all__ = ["row_of_pair", "token_sums", "weighted_token_sums", "weighted_token_sums_backward"]

_BLOCK_D = 256  # columns of the backward's tile; k rows of them (bf16, k = 8: 4 KiB)
# the sums' programs: columns each (bf16: 16-byte loads at 8 a thread) and warps
_SUM_BLOCK_D, _SUM_WARPS = 256, 1


def row_of_pair(order: torch.Tensor) -> torch.Tensor:
    """pair_rows: the inverse of the permutation `order` (pairs sorted by expert), where pair p lies."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=order.device))


def _accumulation(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def weighted_token_sums_reference(out: torch.Tensor, w: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    N, k = w.shape
    acc = _accumulation(out)
    rows = out[pair_rows].view(N, k, out.shape[-1])
    return (rows.to(acc) * w.to(acc)[..., None]).sum(1).to(out.dtype)


def token_sums_reference(rows: torch.Tensor, pair_rows: torch.Tensor, k: int) -> torch.Tensor:
    return rows[pair_rows].view(-1, k, rows.shape[-1]).to(_accumulation(rows)).sum(1).to(rows.dtype)


def weighted_token_sums_backward_reference(grad: torch.Tensor, out: torch.Tensor, w: torch.Tensor,
                                           pair_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, k = w.shape
    acc = _accumulation(out)
    g = grad.to(acc)
    grad_w = (g[:, None, :] * out[pair_rows].view(N, k, out.shape[-1]).to(acc)).sum(-1)
    grad_out = torch.empty_like(out).index_copy_(0, pair_rows, (g[:, None, :] * w.to(acc)[..., None])
                                                 .reshape(N * k, -1).to(out.dtype))
    return grad_out, grad_w.to(w.dtype)


if triton is not None:

    @triton.jit
    def _token_sums_kernel(rows_ptr, w_ptr, pair_ptr, y_ptr, D, K: tl.constexpr, WEIGHTED: tl.constexpr,
                           BLOCK_D: tl.constexpr):
        # program (t, j): token t's columns j*BLOCK_D.., its k rows read one after another as 1-D
        # loads, all issued before the first is needed (c5a19a4's [k, BLOCK_D] tile summed over its rows
        # took 6.8x one pass over the bytes on an H100: the sum crossed warps through shared memory)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in tl.static_range(K):
            row = tl.load(pair_ptr + t * K + c).to(tl.int64)
            x = tl.load(rows_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
            if WEIGHTED:
                x = x * tl.load(w_ptr + t * K + c).to(tl.float32)
            acc += x
        tl.store(y_ptr + t * D + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _weighted_sums_backward_kernel(grad_ptr, out_ptr, w_ptr, pair_ptr, grad_out_ptr, grad_w_ptr, D,
                                       K: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, KP)
        has = c < K
        rows = tl.load(pair_ptr + t * K + c, mask=has, other=0)
        wt = tl.load(w_ptr + t * K + c, mask=has, other=0.0).to(tl.float32)
        dots = tl.zeros([KP], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = has[:, None] & (cols < D)[None, :]
            g = tl.load(grad_ptr + t * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            at = rows[:, None] * D + cols[None, :]
            o = tl.load(out_ptr + at, mask=ok, other=0.0).to(tl.float32)
            dots += tl.sum(o * g[None, :], 1)
            tl.store(grad_out_ptr + at, (wt[:, None] * g[None, :]).to(grad_out_ptr.dtype.element_ty), mask=ok)
        tl.store(grad_w_ptr + t * K + c, dots.to(grad_w_ptr.dtype.element_ty), mask=has)


def _runs_kernels(*tensors: torch.Tensor) -> bool:
    # float64 (reference models) stays on torch, whose sums keep float64; set_fusion(False) turns the
    # kernels off with the other fused paths (benchmarks' "unfused")
    return fusion_enabled() and runs_triton(tensors[0]) and all(t.dtype != torch.float64 for t in tensors)


def _token_sums(rows: torch.Tensor, w: torch.Tensor | None, pair_rows: torch.Tensor, N: int, k: int) -> torch.Tensor:
    y = rows.new_empty(N, rows.shape[1])
    if N:
        D = rows.shape[1]
        _token_sums_kernel[(N, triton.cdiv(D, _SUM_BLOCK_D))](rows, rows if w is None else w, pair_rows, y, D, K=k,
                                                            WEIGHTED=w is not None, BLOCK_D=_SUM_BLOCK_D,
                                                            num_warps=_SUM_WARPS)
    return y


@torch.library.custom_op("kimi::token_sums", mutates_args=())
def token_sums(rows: torch.Tensor, pair_rows: torch.Tensor, k: int) -> torch.Tensor:
    """rows [N*k, d] in expert order -> [N, d]: each token's k rows summed (the gradient of the experts'
    input rows, each a copy of its token's row)."""
    if not _runs_kernels(rows):
        return token_sums_reference(rows, pair_rows, k)
    return _token_sums(rows.contiguous(), None, pair_rows.contiguous(), pair_rows.numel() // k, k)


@token_sums.register_fake
def _(rows, pair_rows, k):
    return rows.new_empty(pair_rows.shape[0] // k, rows.shape[1])


@torch.library.custom_op("kimi::weighted_token_sums", mutates_args=())
def weighted_token_sums(out: torch.Tensor, w: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    """out [M, d] rows in expert order, w [N, k], pair_rows [N*k] -> y [N, d] in out's dtype."""
    if not _runs_kernels(out, w):
        return weighted_token_sums_reference(out, w, pair_rows)
    N, k = w.shape
    return _token_sums(out.contiguous(), w.contiguous(), pair_rows.contiguous(), N, k)


@weighted_token_sums.register_fake
def _(out, w, pair_rows):
    return out.new_empty(w.shape[0], out.shape[1])


@torch.library.custom_op("kimi::weighted_token_sums_backward", mutates_args=())
def weighted_token_sums_backward(grad: torch.Tensor, out: torch.Tensor, w: torch.Tensor,
                                 pair_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of weighted_token_sums for out [M, d] (a pair's row: its weight times its
    token's gradient) and w [N, k] (a pair's row dotted with its token's gradient), given grad [N, d]."""
    if not _runs_kernels(out, w, grad):
        return weighted_token_sums_backward_reference(grad, out, w, pair_rows)
    N, k = w.shape
    grad, out, w, pair_rows = grad.contiguous(), out.contiguous(), w.contiguous(), pair_rows.contiguous()
    grad_out, grad_w = torch.empty_like(out), torch.empty_like(w)
    if N:
        _weighted_sums_backward_kernel[(N,)](grad, out, w, pair_rows, grad_out, grad_w, out.shape[1], K=k,
                                             KP=triton.next_power_of_2(k), BLOCK_D=_BLOCK_D)
    return grad_out, grad_w


@weighted_token_sums_backward.register_fake
def _(grad, out, w, pair_rows):
    return torch.empty_like(out), torch.empty_like(w)
