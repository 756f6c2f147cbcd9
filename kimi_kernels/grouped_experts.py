"""Routed experts for decode batches: a Triton grouped GEMM for a few rows per expert.

A decode step of 64 sequences routes each token to 8 of 64 experts: ~8 rows per expert, and the
step reads every expert's weights once for them. torch._grouped_mm (CUTLASS) ran the Kimi-Linear
shape's three projections at ~65% of the weights' bytes' rate on an H200, and the gate and up
projections as two GEMMs with the activation a third kernel between them. Here one kernel reads
each expert's gate and up weights side by side and applies the GLU on its fp32 accumulators, and a
second the down projection; a program holds one expert's block of output columns and walks that
expert's rows `block_m` at a time, so the weights are read once per step when an expert has at
most `block_m` rows (an expert with none reads nothing).

    h   = act(z_e @ w1_e.T) * (z_e @ w3_e.T)     w1, w3: [E, I, d] (gate, up), z sorted by expert
    out = h_e @ w2_e.T                           w2: [E, d, I]

The gate and up products stay fp32 into the activation (the reference path rounds them to the
weights' dtype first). `experts_small_m` is a torch custom op: torch.compile and CUDA graphs take
it as one opaque call. It needs Triton and CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1,
on CPU tensors: how it is tested without a GPU)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .triton_support import runs_triton, tl, triton

__all__ = ["LaunchConfig", "experts_small_m", "project", "small_m_block"]


# The row blocks a program can take at a time (16: tl.dot's least). A block is chosen to hold the
# busiest expert's rows in one pass (each further pass reads that expert's weights again): under
# random routing the busiest of E experts gets about mean + 3 sqrt(mean) rows. On the H200 at the
# Kimi-Linear shape (benchmarks/grouped_experts_gpu.py) that took 0.241 ms a layer at 64 sequences
# (mean 8, busiest 18; 32-row blocks) where CUTLASS's grouped GEMM took 0.352, and 0.265 ms at 256
# (mean 32, busiest 48; 64-row blocks) where CUTLASS took 0.347, with 32-row blocks there 0.355
ROW_BLOCKS = (16, 32, 64)
_ACTS = {"silu": 0, "situ": 1}


def small_m_block(rows: int, experts: int) -> int | None:
    """The row block for `rows` token-expert pairs over `experts` experts: the least of ROW_BLOCKS
    that holds the busiest expert's rows as random routing would spread them, else None (past
    that, CUTLASS's grouped GEMM)."""
    mean = rows / experts
    busiest = mean + 3 * mean**0.5
    return next((block for block in ROW_BLOCKS if block >= busiest), None)


if triton is not None:

    @triton.jit
    def _tanh(x):
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _grouped_kernel(z_ptr, w_ptr, w_up_ptr, out_ptr, offs_ptr, N, K, stride_z, stride_we, stride_wn,
                        stride_out, gate_cap, up_cap, GLU: tl.constexpr, ACT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (e, j): rows offs[e]:offs[e+1] of z times w[e]'s output columns j*BLOCK_N..; with GLU
        act(z w[e].T) * (z w_up[e].T). w, w_up: [E, N, K], K contiguous."""
        e = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        start = tl.load(offs_ptr + e)
        end = tl.load(offs_ptr + e + 1)
        w_rows = w_ptr + e * stride_we + cols[:, None] * stride_wn
        up_rows = w_up_ptr + e * stride_we + cols[:, None] * stride_wn
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                z = tl.load(z_ptr + rows[:, None] * stride_z + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc = tl.dot(z, tl.trans(w), acc)
                if GLU:
                    w_up = tl.load(up_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                    acc_up = tl.dot(z, tl.trans(w_up), acc_up)
            if GLU:
                if ACT == 0:  # SwiGLU
                    acc = acc * tl.sigmoid(acc) * acc_up
                else:  # SiTU-GLU: the sigmoid sees the uncapped gate
                    acc = gate_cap * _tanh(acc / gate_cap) * tl.sigmoid(acc) * (up_cap * _tanh(acc_up / up_cap))
            out = out_ptr + rows[:, None] * stride_out + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class LaunchConfig(NamedTuple):
    """A kernel launch's tile and pipeline: output columns and reduction width per step of a
    program, warps, and software-pipelining stages."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Per projection (gate and up with the GLU; down) and row block, the fastest benchmarks/grouped_experts_gpu.py
# found on the H200 at the Kimi-Linear shape (d 2304, I 1024, 64 experts): 16- and 32-row blocks at
# 64 sequences, 64-row blocks at 256
GLU_CONFIGS = {16: LaunchConfig(32, 128, 4, 5), 32: LaunchConfig(64, 128, 4, 3), 64: LaunchConfig(32, 64, 4, 3)}
DOWN_CONFIGS = {16: LaunchConfig(32, 256, 4, 3), 32: LaunchConfig(64, 128, 4, 3), 64: LaunchConfig(128, 128, 4, 4)}
_FALLBACK_CONFIG = LaunchConfig(64, 128, 4, 4)


def project(z: torch.Tensor, w: torch.Tensor, w_up: torch.Tensor | None, offs: torch.Tensor, block_m: int,
            act: str = "silu", gate_cap: float = 0.0, up_cap: float = 0.0,
            config: LaunchConfig | None = None) -> torch.Tensor:
    """One grouped projection: z [M, K] sorted by expert (offs [E+1] int32) times w [E, N, K] -> [M, N];
    with w_up, the GLU act(z w.T) * (z w_up.T). `config` defaults to the table's for `block_m`."""
    E, N, K = w.shape
    if config is None:
        config = (GLU_CONFIGS if w_up is not None else DOWN_CONFIGS).get(block_m, _FALLBACK_CONFIG)
    out = z.new_empty(z.shape[0], N)
    if z.shape[0] == 0:
        return out
    grid = (E, triton.cdiv(N, config.block_n))
    _grouped_kernel[grid](z, w, w if w_up is None else w_up, out, offs, N, K, z.stride(0), w.stride(0), w.stride(1),
                          out.stride(0), gate_cap, up_cap, GLU=w_up is not None, ACT=_ACTS[act],
                          BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                          num_warps=config.num_warps, num_stages=config.num_stages)
    return out


@torch.library.custom_op("kimi::experts_small_m", mutates_args=())
def experts_small_m(zs: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                    block_m: int, act: str, gate_cap: float, up_cap: float) -> torch.Tensor:
    """zs: [M, d] rows sorted by expert; offs: [E+1] int32, expert e's rows offs[e]:offs[e+1];
    w1, w3: [E, I, d]; w2: [E, d, I] -> [M, d] in zs's dtype: Expert_e(row) for every row."""
    if act not in _ACTS:
        raise ValueError(f"experts_small_m: act must be one of {sorted(_ACTS)}, got {act!r}")
    zs, w1, w3, w2 = (t.contiguous() for t in (zs, w1, w3, w2))
    h = project(zs, w1, w3, offs, block_m, act, gate_cap, up_cap)
    return project(h, w2, None, offs, block_m)


@experts_small_m.register_fake
def _(zs, offs, w1, w3, w2, block_m, act, gate_cap, up_cap):
    return zs.new_empty(zs.shape[0], w2.shape[1])
