"""Kimi Delta Attention (KDA): pure-PyTorch chunked and recurrent paths, fla-core on CUDA.

Per value head, with state S in R^{K x V} (see docs/architecture.md, "kernels -> policy"):

    S <- Diag(exp(g_t)) S                         decay the key channels first
    S <- S + beta_t k_t (v_t - S^T k_t)^T         delta rule on the decayed state
    o_t = scale * S^T q_t                         read after the write

Layouts: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log decay <= 0);
beta [B, T, HV]; state [B, HV, K, V]. H divides HV: q/k head h serves value heads
h*HV/H ... (h+1)*HV/H - 1. q and k are used as given (the layer l2-normalises them).

Numerics: everything runs in float32, or float64 when any input is float64 (exactness
tests). The returned state is float32 (float64 in float64 mode, so tests can compare
it to 1e-10). Decay factors are only ever exp(non-positive number): pairwise
differences Gamma_r - Gamma_c are masked to -inf above the diagonal before exp, and
off-diagonal blocks are factored around a pivot between r and c (both factors <= 1).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fusion import fused_on_cuda
from .varlen import check_cu_seqlens, segment_starts

__all__ = ["kda_chunk", "kda_recurrent", "kda", "kda_in_slots", "kda_gate", "fla_available", "set_kda_backend",
           "kda_backend"]

Tensor = torch.Tensor

# Rows of a chunk are grouped in sub-blocks of this size: pairs inside a sub-block use
# the exact pairwise form (C*SUB*K work), pairs across sub-blocks use matmuls.
_SUB = 8  # measured fastest on CPU among 4, 8, 16, 32 (fwd+bwd, K=128)
# forwards without gradient of at most this many tokens run token by token (inference_chunk_size)
_RECURRENT_MAX_T = 8


# --------------------------------------------------------------------------- checks
def _shape_error(name: str, expected: str, t: Tensor) -> ValueError:
    return ValueError(f"kda: {name} must be {expected}, got shape {tuple(t.shape)}")


def _check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
) -> tuple[int, int, int, int, int, int]:
    """Validate the layouts; return (B, T, H, K, HV, V)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kda: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"kda: {name} must be a floating tensor, got dtype {t.dtype}")
    if q.dim() != 4:
        raise _shape_error("q", "[B, T, H, K]", q)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise _shape_error("k", f"[B, T, H, K] = {tuple(q.shape)} like q", k)
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise _shape_error("v", f"[B={B}, T={T}, HV, V]", v)
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"kda: value heads HV={HV} must be a multiple of q/k heads H={H}")
    if g.shape != (B, T, HV, K):
        raise _shape_error("g", f"[B, T, HV, K] = {(B, T, HV, K)}", g)
    if beta.shape != (B, T, HV):
        raise _shape_error("beta", f"[B, T, HV] = {(B, T, HV)}", beta)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise TypeError("kda: initial_state must be a floating torch.Tensor [B, HV, K, V]")
        if initial_state.shape != (B, HV, K, V):
            raise _shape_error("initial_state", f"[B, HV, K, V] = {(B, HV, K, V)}", initial_state)
    return B, T, H, K, HV, V


def _compute_dtype(*ts: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _state_dtype(cd: torch.dtype) -> torch.dtype:
    return torch.float64 if cd == torch.float64 else torch.float32


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, cd: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cast, scale q, repeat q/k over their value-head group, move heads first: [B, HV, T, D]."""
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    scale = K**-0.5 if scale is None else float(scale)
    rep = HV // H
    q = q.to(cd) * scale
    k = k.to(cd)
    if rep > 1:  # grouped value heads: head h serves value heads h*rep ... h*rep+rep-1
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    return (
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.to(cd).transpose(1, 2),
        g.to(cd).transpose(1, 2),
        beta.to(cd).transpose(1, 2),
    )


# ------------------------------------------------------------------------ recurrent
def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA (the oracle; also the 1-token decode step). Same contract as kda_chunk."""
    B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta, initial_state)
    _check_packed(cu_seqlens, B, T, initial_state, output_final_state)
    cd = _compute_dtype(q, k, v, g, beta, initial_state)
    # a packed row: the state starts from zero at every sequence's first token
    keep = None if cu_seqlens is None else (~segment_starts(cu_seqlens, T)).to(cd)
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, scale, cd)
    S = (
        q.new_zeros(B, HV, K, V, dtype=cd)
        if initial_state is None
        else initial_state.to(device=q.device, dtype=cd)
    )
    outs = []
    for t in range(T):
        kt = kh[:, :, t]  # [B, HV, K]
        if keep is not None:
            S = S * keep[t]
        S = S * gh[:, :, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        delta = bh[:, :, t, None] * (vh[:, :, t] - pred)
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", qh[:, :, t], S))
    o = torch.stack(outs, dim=1) if T > 0 else v.new_zeros(B, 0, HV, V, dtype=cd)
    final = S.to(_state_dtype(cd)) if output_final_state else None
    return o.to(v.dtype), final


# -------------------------------------------------------------------------- packed rows
def _check_packed(cu_seqlens: Tensor | None, B: int, T: int, initial_state: Tensor | None,
                  output_final_state: bool) -> None:
    if cu_seqlens is None:
        return
    check_cu_seqlens(cu_seqlens, B, T, "kda")
    if initial_state is not None or output_final_state:
        raise ValueError("kda: a packed row (cu_seqlens) starts every sequence from zero and returns no "
                         "final state (a training forward); initial_state / output_final_state need B rows")


class _ChunkMasks(NamedTuple):
    """Where a packed row's boundaries cut its chunks (each [1, 1, N, C, ...], float 0/1)."""

    same: Tensor  # [.., C, C] pairs (r, c) of one sequence
    carried: Tensor  # [.., C, 1] tokens of the sequence the chunk's entering state belongs to
    in_last: Tensor  # [.., C, 1] tokens of the sequence the chunk's leaving state belongs to
    passes_on: Tensor  # [.., 1, 1] the entering state reaches the leaving one (no boundary inside)


def _chunk_masks(cu_seqlens: Tensor, N: int, C: int, dtype: torch.dtype) -> _ChunkMasks:
    T = int(cu_seqlens[-1])
    starts = F.pad(segment_starts(cu_seqlens, T), (0, N * C - T)).reshape(N, C).long()
    starts[0, 0] = 0  # the row's first sequence starts from the (zero) initial state: nothing to cut
    seq = starts.cumsum(-1)  # which sequence of the chunk each token is in, 0 = the one carried in
    same = seq[:, :, None] == seq[:, None, :]
    carried = seq == 0
    in_last = seq == seq[:, -1:]
    passes_on = carried[:, -1]
    f = lambda x: x.to(dtype)[None, None]  # noqa: E731
    return _ChunkMasks(f(same), f(carried)[..., None], f(in_last)[..., None], f(passes_on)[..., None, None])


# -------------------------------------------------------------------------- chunked
def _intra_chunk_grams(q: Tensor, k: Tensor, gam: Tensor, sub: int) -> tuple[Tensor, Tensor]:
    """Decayed Gram matrices inside each chunk.

    q, k, gam: [..., C, K] (gam = cumulative log decay within the chunk).
    Returns A_qk[r, c] = sum_d q_r k_c exp(gam_r - gam_c) for c <= r (0 above), and
    A_kk, the same with k on the left, strictly lower (0 on and above the diagonal).
    """
    C, K = k.shape[-2], k.shape[-1]
    if C % sub != 0:
        sub = C
    ns = C // sub
    lead = k.shape[:-2]

    # Pairs inside a sub-block: exact pairwise differences, upper triangle masked before exp.
    gb = gam.reshape(*lead, ns, sub, K)
    kb = k.reshape(*lead, ns, sub, K)
    xb = torch.stack((q.reshape(*lead, ns, sub, K), kb), dim=-1)  # [..., ns, sub, K, 2]
    incl = torch.ones(sub, sub, dtype=torch.bool, device=k.device).tril()
    diff = gb.unsqueeze(-2) - gb.unsqueeze(-3)  # [..., ns, r, c, K]
    decay = diff.masked_fill(~incl[:, :, None], float("-inf")).exp()  # (no host tensor: capturable in a CUDA graph)
    diag = torch.matmul(decay * kb.unsqueeze(-3), xb)  # [..., ns, r, c, 2]
    eye_ns = torch.eye(ns, dtype=k.dtype, device=k.device)
    # Place the ns diagonal blocks on the block diagonal of a [C, C] matrix.
    blockdiag = (diag.unsqueeze(-3) * eye_ns[:, None, :, None, None]).reshape(*lead, C, C, 2)

    if ns > 1:
        # Pairs across sub-blocks: row r in block i >= 1, column c < i*sub. Pivot p_i =
        # gam at the last row of block i-1: exp(gam_r - gam_c) = exp(gam_r - p_i) *
        # exp(p_i - gam_c), both exponents <= 0, so neither factor can overflow.
        piv = gam[..., sub - 1 : C - 1 : sub, :]  # [..., ns-1, K]
        rows = gb[..., 1:, :, :]  # [..., ns-1, sub, K]
        row_decay = (rows - piv.unsqueeze(-2)).exp()
        lq = q.reshape(*lead, ns, sub, K)[..., 1:, :, :] * row_decay
        lk = kb[..., 1:, :, :] * row_decay
        cols = gam[..., : C - sub, :]  # [..., C-sub, K]
        col_ok = (
            torch.arange(C - sub, device=k.device)[None, :]
            < (torch.arange(1, ns, device=k.device)[:, None] * sub)
        )  # [ns-1, C-sub]
        expo = (piv.unsqueeze(-2) - cols.unsqueeze(-3)).masked_fill(~col_ok[:, :, None], float("-inf"))
        right = k[..., : C - sub, :].unsqueeze(-3) * expo.exp()  # [..., ns-1, C-sub, K]
        left = torch.cat((lq, lk), dim=-2)  # [..., ns-1, 2*sub, K]
        off = torch.matmul(left, right.transpose(-1, -2))  # [..., ns-1, 2*sub, C-sub]
        off_q = off[..., :sub, :].reshape(*lead, C - sub, C - sub)
        off_k = off[..., sub:, :].reshape(*lead, C - sub, C - sub)
        a_qk = blockdiag[..., 0] + F.pad(off_q, (0, sub, sub, 0))
        a_kk = blockdiag[..., 1] + F.pad(off_k, (0, sub, sub, 0))
    else:
        a_qk, a_kk = blockdiag[..., 0], blockdiag[..., 1]
    a_kk = a_kk.tril(-1)  # the delta-rule system uses strictly earlier keys only
    return a_qk, a_kk


def kda_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA in PyTorch (training path; plain autograd).

    Returns o [B, T, HV, V] in v's dtype and, if output_final_state, the state
    [B, HV, K, V] (float32; float64 when computing in float64), else None.
    Intra-chunk work is batched over all chunks; only the state recursion loops.
    cu_seqlens [N+1]: a packed row (B = 1) of N sequences, each starting from a zero state
    (kimi_kernels/varlen.py); chunks may straddle boundaries, masks keep the sequences apart.
    """
    B, T, H, K, HV, V = _check_inputs(q, k, v, g, beta, initial_state)
    _check_packed(cu_seqlens, B, T, initial_state, output_final_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"kda_chunk: chunk_size must be a positive int, got {chunk_size!r}")
    cd = _compute_dtype(q, k, v, g, beta, initial_state)
    qh, kh, vh, gh, bh = _prepare(q, k, v, g, beta, scale, cd)
    S = (
        q.new_zeros(B, HV, K, V, dtype=cd)
        if initial_state is None
        else initial_state.to(device=q.device, dtype=cd)
    )
    if T == 0:
        return v.new_zeros(B, 0, HV, V), (S.to(_state_dtype(cd)) if output_final_state else None)

    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    if pad:
        # Padded steps are no-ops: no decay (g=0), no write (beta=0, k=0), no read (q=0).
        qh, kh, vh, gh = (F.pad(x, (0, 0, 0, pad)) for x in (qh, kh, vh, gh))
        bh = F.pad(bh, (0, pad))
    qc, kc, vc, gc = (x.reshape(B, HV, N, C, x.shape[-1]) for x in (qh, kh, vh, gh))
    bc = bh.reshape(B, HV, N, C, 1)

    gam = gc.cumsum(dim=-2)  # cumulative log decay inside each chunk, <= 0, decreasing
    a_qk, a_kk = _intra_chunk_grams(qc, kc, gam, _SUB)

    # WY form: (I + diag(beta) A_kk) [W | U] = diag(beta) [exp(gam) * K | V].
    k_decayed = kc * gam.exp()
    g_last = gam[..., -1:, :]  # [B, HV, N, 1, K]
    k_to_end = kc * (g_last - gam).exp()  # key weights for the end-of-chunk state
    chunk_decay = g_last.squeeze(-2).exp().unsqueeze(-1)  # [B, HV, N, K, 1]
    reads_state = None
    if cu_seqlens is not None:
        m = _chunk_masks(cu_seqlens, N, C, cd)
        a_qk, a_kk = a_qk * m.same, a_kk * m.same
        k_decayed, k_to_end = k_decayed * m.carried, k_to_end * m.in_last
        chunk_decay = chunk_decay * m.passes_on
        reads_state = m.carried
    rhs = bc * torch.cat((k_decayed, vc), dim=-1)
    sol = torch.linalg.solve_triangular(bc * a_kk, rhs, upper=False, unitriangular=True)
    w, u = sol[..., :K], sol[..., K:]

    # Only the state recursion is sequential over chunks. unbind (not u[:, :, n]) so the
    # backward is one stack instead of N zero-filled full-size index gradients.
    states, v_new = [], []
    k_to_end_t = k_to_end.transpose(-1, -2)
    for u_n, w_n, d_n, kt_n in zip(u.unbind(2), w.unbind(2), chunk_decay.unbind(2), k_to_end_t.unbind(2)):
        states.append(S)
        vn = u_n - w_n @ S
        v_new.append(vn)
        S = d_n * S + kt_n @ vn
    s_in = torch.stack(states, dim=2)  # state entering each chunk: [B, HV, N, K, V]
    vn_all = torch.stack(v_new, dim=2)  # [B, HV, N, C, V]
    q_decayed = qc * gam.exp() if reads_state is None else qc * gam.exp() * reads_state
    o = q_decayed @ s_in + a_qk @ vn_all

    o = o.reshape(B, HV, N * C, V)[:, :, :T].transpose(1, 2).to(v.dtype)
    final = S.to(_state_dtype(cd)) if output_final_state else None
    return o, final


# ------------------------------------------------------------------------- dispatch
_FLA: tuple | None = None


def _load_fla() -> tuple | None:
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.kda import chunk_kda, fused_recurrent_kda  # type: ignore

            _FLA = (chunk_kda, fused_recurrent_kda)
        except Exception:  # fla-core absent or its Triton stack unusable here
            _FLA = ()
    return _FLA or None


_FLA_IN_PLACE: Callable | bool | None = None  # None: not looked up yet; False: not importable


def _load_fla_in_place() -> Callable | None:
    """fla's recurrent forward that reads and writes states where they lie (`ssm_state_indices`,
    `inplace_final_state`: its continuous-batching mode, not in the public wrapper), or None."""
    global _FLA_IN_PLACE
    if _FLA_IN_PLACE is None:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # type: ignore

            # left out of a torch.compile'd step (the decode graphs'): a Triton launcher with its own
            # heuristics that writes the states in place, which dynamo would trace or break on
            _FLA_IN_PLACE = torch.compiler.disable(fused_recurrent_kda_fwd)
        except Exception:
            _FLA_IN_PLACE = False
    return _FLA_IN_PLACE or None


def fla_available() -> bool:
    """True when fla-core's KDA kernels import (they still need CUDA tensors to run)."""
    return _load_fla() is not None


# "fla_recurrent": fla only for 1-token steps (its recurrent kernel has no autotuning), torch for the
# rest: for short GPU runs where chunk_kda's first-call autotuning per shape (minutes) costs more than it saves
_BACKENDS = ("auto", "fla", "fla_recurrent", "torch")
# Process-wide default for kda(backend=None); benchmarks flip it to time the torch path.
_default_backend = os.environ.get("KIMI_KDA_BACKEND", "auto")


def set_kda_backend(name: str) -> str:
    """Set the default backend of kda(): "auto", "fla", "fla_recurrent" or "torch". Returns the previous one."""
    global _default_backend
    if name not in _BACKENDS:
        raise ValueError(f"kda: backend must be one of {_BACKENDS}, got {name!r}")
    prev, _default_backend = _default_backend, name
    return prev


@contextmanager
def kda_backend(name: str) -> Iterator[None]:
    """Temporarily change kda()'s default backend (e.g. `with kda_backend("torch"): model(x)`)."""
    prev = set_kda_backend(name)
    try:
        yield
    finally:
        set_kda_backend(prev)


def _is_decode_step(q: Tensor) -> bool:
    """One token per row and no gradient: what fla's recurrent kernel serves."""
    return q.shape[1] == 1 and not torch.is_grad_enabled()


def _resolve_backend(backend: str | None, q: Tensor) -> str:
    """The backend a call runs with: the process default for None, checked; "fla_recurrent" becomes
    "auto" for a decode step and "torch" otherwise."""
    backend = _default_backend if backend is None else backend
    if backend not in _BACKENDS:
        raise ValueError(f"kda: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "fla_recurrent":
        return "auto" if _is_decode_step(q) else "torch"
    return backend


def kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    backend: str | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """KDA with backend choice (None = the process default, see set_kda_backend):
    "auto": fla-core on CUDA when importable (chunk_kda; fused_recurrent_kda for a 1-token
    step without grad), else torch; "fla": require fla-core; "fla_recurrent": "auto" for 1-token
    steps without grad, torch otherwise; "torch": kda_chunk for T > 1, kda_recurrent for T == 1
    (without gradient, the chunk of `inference_chunk_size`). float64 inputs always take the torch
    path (fla has no fp64). cu_seqlens: a packed row of several sequences (kda_chunk)."""
    backend = _resolve_backend(backend, q)
    _check_inputs(q, k, v, g, beta, initial_state)
    T = q.shape[1]
    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    fla = _load_fla() if backend != "torch" and q.is_cuda else None
    if backend == "fla" and (fla is None or q.dtype == torch.float64):
        raise RuntimeError("kda: backend='fla' needs fla-core importable, CUDA tensors and no float64")
    if fla is not None and q.dtype != torch.float64:
        chunk_kda, fused_recurrent_kda = fla
        h0 = None if initial_state is None else initial_state.float()
        if _is_decode_step(q):
            return fused_recurrent_kda(
                q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state, **packed
            )
        if cu_seqlens is not None:
            _check_packed(cu_seqlens, q.shape[0], T, initial_state, output_final_state)
        return chunk_kda(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state, **packed
        )
    if T == 1:
        return kda_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, **packed)
    if not _wants_grad(q, k, v, g, beta, initial_state):
        chunk = inference_chunk_size(T)
        if chunk is None:
            return kda_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, **packed)
        return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size=chunk, **packed)
    return kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, **packed)


def inference_chunk_size(T: int) -> int | None:
    """The torch path's chunk for a forward of T tokens without gradient (a rollout engine's
    prefill, a no-grad logprob pass), None for token by token. Short inputs take small chunks: a
    32-token prompt padded to one 64-token chunk took 2.9-4.2x the time of two 16-token chunks;
    up to 8 tokens the recurrence is cheaper still (7.5-37x). Chunks of 64 stay for training, measured
    fastest forward and backward. (benchmarks/kda_prefill_cpu.py)"""
    if T <= _RECURRENT_MAX_T:
        return None
    return 16 if T <= 64 else 32


def _wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kda_in_slots(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state_pool: Tensor,
    slots: Tensor,
    scale: float | None = None,
    backend: str | None = None,
) -> Tensor:
    """KDA whose states live in a pool: row b starts from state_pool[slots[b]] and its final state
    is written back there (float32 pool [N, HV, K, V], slots [B] long). Returns o [B, T, HV, V].
    A decode step (T == 1, no grad) on CUDA with fla reads and writes each state once, in place;
    elsewhere a decode step updates one gathered copy of the states with batched products and puts
    it back; chunks are gathered, run through `kda`, and scattered back. Rows may share
    a slot only when what it holds afterwards does not matter (padding rows on a scratch slot)."""
    backend = _resolve_backend(backend, q)
    on_fla = backend != "torch" and q.is_cuda and q.dtype != torch.float64 and _is_decode_step(q)
    in_place = _load_fla_in_place() if on_fla else None
    if in_place is not None and state_pool.dtype == torch.float32 and state_pool.is_contiguous():
        o, _ = in_place(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                        scale=scale, initial_state=state_pool, inplace_final_state=True,
                        ssm_state_indices=slots.to(torch.int32))
        return o
    if _is_decode_step(q) and backend != "fla" and not (on_fla and _load_fla() is not None):
        return _decode_in_slots_torch(q, k, v, g, beta, state_pool, slots, scale)
    o, final = kda(q, k, v, g, beta, scale=scale, initial_state=state_pool.index_select(0, slots),
                   output_final_state=True, backend=backend)
    state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
    return o


def _decode_in_slots_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                           slots: Tensor, scale: float | None) -> Tensor:
    """One token per row on the torch path (a CPU engine's decode step): the rows' states gathered
    into one copy, decayed, written and read there with batched products, then put back. Equal to
    `kda_recurrent` on the gathered states in a few ops instead of its ~14 passes over them."""
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    cd = _compute_dtype(q, k, v, g, beta, state_pool)
    qh, kh, vh, gh, bh = (t.reshape(B * HV, 1, -1) for t in _prepare(q, k, v, g, beta, scale, cd))
    state = state_pool.index_select(0, slots).to(cd)  # its own copy: updated in place
    flat = state.view(B * HV, K, V)
    flat.mul_(gh.exp().transpose(1, 2))
    delta = (vh - torch.bmm(kh, flat)).mul_(bh)
    flat.baddbmm_(kh.transpose(1, 2), delta)
    o = torch.bmm(qh, flat)
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return o.view(B, 1, HV, V).to(v.dtype)


# ----------------------------------------------------------------------------- gate
@fused_on_cuda
def kda_gate(
    f: Tensor, A_log: Tensor, dt_bias: Tensor | None, lower_bound: float | None = None
) -> Tensor:
    """Per-channel log decay g (float32, <= 0) from the gate projection f.

    f: [..., H, K] or [..., H*K]; A_log: [H] (any shape with H elements); dt_bias: [H, K],
    [H*K] or None. Default form: g = -exp(A_log[h]) * softplus(f + dt_bias).
    Lower-bound ("safe") form, lower_bound=lb < 0: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias)),
    so g lies in (lb, 0). Returns [..., H, K] float32.
    """
    H = A_log.numel()
    if H == 0:
        raise ValueError("kda_gate: A_log is empty")
    # Layout of f: with dt_bias, K = dt_bias.numel() / H fixes it; without, [..., H, K] wins when
    # the second-last dim equals H (pass f already split into heads to leave no doubt).
    if dt_bias is not None:
        if dt_bias.numel() % H:
            raise ValueError(f"kda_gate: dt_bias must have H*K elements (H={H}), got shape {tuple(dt_bias.shape)}")
        K = dt_bias.numel() // H
        heads = f.dim() >= 2 and tuple(f.shape[-2:]) == (H, K)
        if not heads and (f.dim() == 0 or f.shape[-1] != H * K):
            raise ValueError(f"kda_gate: f must be [..., H={H}, K={K}] or [..., {H * K}], got shape {tuple(f.shape)}")
    else:
        heads = f.dim() >= 2 and f.shape[-2] == H
        if not heads and (f.dim() == 0 or f.shape[-1] % H):
            raise ValueError(f"kda_gate: f must be [..., H={H}, K] or [..., H*K], got shape {tuple(f.shape)}")
        K = f.shape[-1] if heads else f.shape[-1] // H
    fh = f.float() if heads else f.float().reshape(*f.shape[:-1], H, K)
    if dt_bias is not None:
        fh = fh + dt_bias.float().reshape(H, K)
    a = A_log.float().reshape(H, 1)
    if lower_bound is None:
        return -a.exp() * F.softplus(fh)
    if not lower_bound < 0:
        raise ValueError(f"kda_gate: lower_bound must be negative, got {lower_bound}")
    return float(lower_bound) * torch.sigmoid(a.exp() * fh)
