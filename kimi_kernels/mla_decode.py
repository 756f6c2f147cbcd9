"""MLA's absorbed decode attention in one Triton kernel: a query token per row over its latent keys.

In a decode step the MLA layer folds W_UK into the query and attends in the latent space: every
query head against one shared key head [latent, k_rope] (512 + 64 wide at the Kimi-Linear shape),
the latent also being the value. No fused SDPA kernel takes those head dims, and the fp32 reference
(kimi_kernels.ops.masked_attention) upcasts the keys, concatenates them, runs SIMT fp32 products and a
dozen softmax and mask kernels: ~0.28 ms of a 2.8 ms step at 64 sequences on an H100. Here a
program holds a block of one row's query heads and walks that row's keys once with an online
softmax (flash-decoding), splitting long key ranges over programs whose partial results are merged
after. Scores are products of the bf16 inputs summed in fp32 (what the reference computes from the
upcast inputs, up to the order of the sums); the probabilities are rounded to the inputs' dtype for
the value product, summed in fp32 (as flash attention does: the fp32 product on SIMT lanes made the
kernel 3-4x slower, at 5-6% of the bandwidth bound on the H200).

    out[b, h] = sum_s softmax_s(scale * q[b, h] . [latent[b, s], rope[b, s]]  over valid s) latent[b, s]

Rows with no valid key give zeros, as the reference does. Needs Triton and CUDA tensors (or
Triton's interpreter, TRITON_INTERPRET=1, on CPU tensors: how it is tested without a GPU).

`mla_decode_paged` reads the keys where a paged cache keeps them (policy/slot_cache.py: one pool of
latents for all rows, a row's keys anywhere in it) through a per-row index of pool positions, so a
decode step never gathers every row's keys into a [B, S, L] copy first: at long contexts that copy
(read, written, read again by the kernel) costs several times the attention itself."""
from __future__ import annotations

import torch

from .triton_support import runs_triton, tl, triton

__all__ = ["mla_decode", "mla_decode_paged", "mla_decode_supported"]

# query heads per program (Kimi-Linear's 32: each key read once per row), keys per step, warps and
# pipeline stages per program; these and _TARGET_PROGRAMS measured best on the H200 over 256-128K keys
# (benchmarks/mla_paged_decode.py, whose --launch tries others)
BLOCK_H, BLOCK_T, NUM_WARPS, NUM_STAGES = 32, 64, 8, 2
_MIN_KEYS_PER_SPLIT = 256  # a split shorter than this costs more in merging than it saves
_TARGET_PROGRAMS = 528  # about four programs per multiprocessor of an H100 / H200 (132)


def mla_decode_supported(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> bool:
    """Triton importable, the tensors where its kernels run (CUDA, or any under the interpreter), one
    dtype, and latent and rope widths that are powers of two (the kernel's tiles span them whole)."""
    widths = (latent.shape[-1], rope.shape[-1])
    return (runs_triton(q) and q.dtype == latent.dtype == rope.dtype
            and all(w >= 16 and not w & (w - 1) for w in widths))


def splits_for(batch: int, heads: int, keys: int) -> int:
    """Key-range splits per row: enough programs to fill the GPU, none shorter than
    _MIN_KEYS_PER_SPLIT keys. Shapes only, so a CUDA graph can hold the choice."""
    programs = batch * -(-heads // BLOCK_H)
    wanted = -(-_TARGET_PROGRAMS // programs)
    return max(1, min(wanted, keys // _MIN_KEYS_PER_SPLIT))


if triton is not None:

    @triton.jit
    def _mla_decode_kernel(q_ptr, lat_ptr, rope_ptr, idx_ptr, valid_ptr, out_ptr, m_ptr, l_ptr, H, S,
                           keys_per_split, scale, stride_qb, stride_qh, stride_lb, stride_ls, stride_rb, stride_rs,
                           stride_ib, stride_vb, stride_ob, stride_os, stride_oh,
                           DV: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                           SPLIT: tl.constexpr, PAGED: tl.constexpr):
        """Program (b, head block, split): row b's query heads over keys [split * keys_per_split, ..).
        SPLIT: write the unnormalised accumulator and its running max and sum (merged after);
        else the normalised output. PAGED: key t of row b is row idx[b, t] of the pools (whose
        row strides are stride_ls / stride_rs; stride_lb / stride_rb unused); else row t of batch b."""
        # int64 row: b * stride_lb passes 2**31 elements at 64 rows of 128K keys
        b, hb, sp = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < H
        dv, dr = tl.arange(0, DV), tl.arange(0, DR)
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_row + dv[None, :], mask=h_ok[:, None], other=0.0)
        q_pe = tl.load(q_row + DV + dr[None, :], mask=h_ok[:, None], other=0.0)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, DV), tl.float32)
        start = sp * keys_per_split
        end = tl.minimum(start + keys_per_split, S)
        for t0 in range(start, end, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            t_ok = ts < end
            ok = tl.load(valid_ptr + b * stride_vb + ts, mask=t_ok, other=0) != 0
            if PAGED:
                rows = tl.load(idx_ptr + b * stride_ib + ts, mask=t_ok, other=0).to(tl.int64)
                lat_rows = lat_ptr + rows[:, None] * stride_ls
                pe_rows = rope_ptr + rows[:, None] * stride_rs
            else:
                lat_rows = lat_ptr + b * stride_lb + ts[:, None] * stride_ls
                pe_rows = rope_ptr + b * stride_rb + ts[:, None] * stride_rs
            lat = tl.load(lat_rows + dv[None, :], mask=t_ok[:, None], other=0.0)
            pe = tl.load(pe_rows + dr[None, :], mask=t_ok[:, None], other=0.0)
            s = tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_pe, tl.trans(pe))
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: nothing to rescale
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat)  # on tensor cores, p rounded to bf16
            m = m_new
        if SPLIT:
            part = b * stride_ob + sp * stride_os + heads
            tl.store(m_ptr + part, m, mask=h_ok)
            tl.store(l_ptr + part, l, mask=h_ok)
            out = out_ptr + b * stride_ob * DV + sp * stride_os * DV + heads[:, None] * DV + dv[None, :]
            tl.store(out, acc, mask=h_ok[:, None])
        else:
            acc = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # no valid key: acc and so the output are 0
            out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def _check(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
    if not q.dtype == latent.dtype == rope.dtype:
        raise ValueError(f"mla_decode: q, latent and rope must share a dtype, got {q.dtype}, {latent.dtype}, "
                         f"{rope.dtype}")
    DV, DR = latent.shape[-1], rope.shape[-1]
    if DV & (DV - 1) or DR & (DR - 1):
        raise ValueError(f"mla_decode: latent and rope widths must be powers of two, got {DV} and {DR}")


def _attend(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, index: torch.Tensor | None,
            valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Both ops' launch: keys of row b at latent[b] / rope[b] (index None) or at latent[index[b]]."""
    B, H, _ = q.shape
    S, DV, DR = valid.shape[1], latent.shape[-1], rope.shape[-1]
    q, latent, rope = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, latent, rope))
    valid = valid.contiguous().view(torch.uint8)  # the same bytes: no copy
    paged = index is not None
    if paged:
        index = index.contiguous()
    splits = splits_for(B, H, S)
    per_split = -(-S // splits)
    grid = (B, triton.cdiv(H, BLOCK_H), splits)
    common = dict(DV=DV, DR=DR, BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T, PAGED=paged, num_warps=NUM_WARPS,
                  num_stages=NUM_STAGES)
    batch_strides = (0, latent.stride(0), 0, rope.stride(0)) if paged else latent.stride()[:2] + rope.stride()[:2]
    strides = (q.stride(0), q.stride(1), *batch_strides, index.stride(0) if paged else 0, valid.stride(0))
    idx = index if paged else valid  # any pointer where there is no index: the kernel never reads it
    if splits == 1:
        out = latent.new_empty(B, H, DV)
        _mla_decode_kernel[grid](q, latent, rope, idx, valid, out, out, out, H, S, per_split, scale, *strides,
                                 out.stride(0), 0, out.stride(1), SPLIT=False, **common)
        return out
    acc = torch.empty(B, splits, H, DV, device=q.device, dtype=torch.float32)
    m = torch.empty(B, splits, H, device=q.device, dtype=torch.float32)
    lse = torch.empty_like(m)
    # acc's row (b, split, head) starts at ((b * splits + split) * H + head) * DV: m's index times DV
    _mla_decode_kernel[grid](q, latent, rope, idx, valid, acc, m, lse, H, S, per_split, scale, *strides,
                             splits * H, H, 0, SPLIT=True, **common)
    top = m.amax(1, keepdim=True)
    weight = torch.exp(m - torch.where(torch.isinf(top), 0.0, top))  # [B, splits, H]; 0 for empty splits
    denom = (weight * lse).sum(1)
    merged = (weight.unsqueeze(-1) * acc).sum(1) / torch.where(denom == 0, 1.0, denom).unsqueeze(-1)
    return merged.to(latent.dtype)


@torch.library.custom_op("kimi::mla_decode", mutates_args=())
def mla_decode(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, valid: torch.Tensor,
               scale: float) -> torch.Tensor:
    """q: [B, H, L + R] (the absorbed query); latent: [B, S, L]; rope: [B, S, R]; valid: bool [B, S]
    -> [B, H, L] in latent's dtype. L and R powers of two (the kernel's tiles span them whole).
    A torch custom op: torch.compile and CUDA graphs take it as one opaque call."""
    B, H, _ = q.shape
    S = latent.shape[1]
    if (latent.dim() != 3 or latent.shape[0] != B or rope.shape[:2] != (B, S) or valid.shape != (B, S)
            or q.shape[-1] != latent.shape[-1] + rope.shape[-1]):
        raise ValueError(f"mla_decode: q [B, H, L+R], latent [B, S, L], rope [B, S, R], valid [B, S]; got "
                         f"{tuple(q.shape)}, {tuple(latent.shape)}, {tuple(rope.shape)}, {tuple(valid.shape)}")
    _check(q, latent, rope)
    return _attend(q, latent, rope, None, valid, scale)


@mla_decode.register_fake
def _(q, latent, rope, valid, scale):
    return latent.new_empty(q.shape[0], q.shape[1], latent.shape[2])


@torch.library.custom_op("kimi::mla_decode_paged", mutates_args=())
def mla_decode_paged(q: torch.Tensor, latent_pool: torch.Tensor, rope_pool: torch.Tensor, index: torch.Tensor,
                     valid: torch.Tensor, scale: float) -> torch.Tensor:
    """mla_decode with row b's key t at latent_pool[index[b, t]] / rope_pool[index[b, t]]: q [B, H, L + R];
    latent_pool [N, L]; rope_pool [N, R]; index [B, S] integer positions in [0, N) (invalid keys' too:
    they are read, then masked); valid bool [B, S] -> [B, H, L] in the pools' dtype."""
    B = q.shape[0]
    if (latent_pool.dim() != 2 or rope_pool.dim() != 2 or latent_pool.shape[0] != rope_pool.shape[0]
            or index.dim() != 2 or index.shape[0] != B or valid.shape != index.shape
            or index.dtype not in (torch.int32, torch.int64)
            or q.shape[-1] != latent_pool.shape[-1] + rope_pool.shape[-1]):
        raise ValueError(f"mla_decode_paged: q [B, H, L+R], latent_pool [N, L], rope_pool [N, R], integer index "
                         f"[B, S], valid [B, S]; got {tuple(q.shape)}, {tuple(latent_pool.shape)}, "
                         f"{tuple(rope_pool.shape)}, {tuple(index.shape)} {index.dtype}, {tuple(valid.shape)}")
    _check(q, latent_pool, rope_pool)
    return _attend(q, latent_pool, rope_pool, index, valid, scale)


@mla_decode_paged.register_fake
def _(q, latent_pool, rope_pool, index, valid, scale):
    return latent_pool.new_empty(q.shape[0], q.shape[1], latent_pool.shape[1])
