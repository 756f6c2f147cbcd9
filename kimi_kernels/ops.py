"""Reference (pure PyTorch) paths for the non-KDA ops the policy uses.

Each op computes in float32 (float64 if given float64) and returns the input's dtype,
except where noted. They are the CPU path and the oracle for any fused GPU version.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fusion import fused_on_cuda
from .varlen import check_cu_seqlens, positions_in_segment

__all__ = ["rms_norm", "gated_rms_norm", "l2norm", "situ_glu", "short_conv", "masked_attention", "topk_mask",
           "topk_to_mask", "masked_logit_max"]

Tensor = torch.Tensor


def _up(x: Tensor) -> Tensor:
    """Compute dtype: float64 stays float64, everything else goes to float32."""
    return x if x.dtype == torch.float64 else x.float()


@fused_on_cuda
def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, over the last dim."""
    if weight is not None and weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    xf = _up(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * _up(weight)
    return y.to(x.dtype)


@fused_on_cuda
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """rms_norm(x) * weight * sigmoid(gate) over the last dim (the KDA output norm), in fp32."""
    return (rms_norm(_up(x), weight, eps) * torch.sigmoid(_up(gate))).to(x.dtype)


@fused_on_cuda
def l2norm(x: Tensor, dim: int = -1, eps: float = 1e-6) -> Tensor:
    """x * rsqrt(sum(x^2) + eps): eps inside the root (as fla does), not max(norm, eps)."""
    xf = _up(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(dim, keepdim=True) + eps)).to(x.dtype)


@fused_on_cuda
def situ_glu(gate: Tensor, up: Tensor, gate_cap: float = 4.0, up_cap: float = 25.0) -> Tensor:
    """SiTU-GLU: gate_cap*tanh(g/gate_cap)*sigmoid(g) * up_cap*tanh(u/up_cap), in fp32.

    The sigmoid sees the uncapped g. |h| < gate_cap * up_cap (100 by default).
    """
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    g, u = _up(gate), _up(up)
    h = gate_cap * torch.tanh(g / gate_cap) * torch.sigmoid(g) * (up_cap * torch.tanh(u / up_cap))
    return h.to(gate.dtype)


def short_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    window: Tensor | None = None,
    activation: str | None = "silu",
    lengths: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over time with a carried window (prefill and decode alike).

    x: [B, T, D]; weight: [D, W] (or Conv1d's [D, 1, W]); weight[:, W-1] multiplies the
    current token. window: [B, W-1, D], the previous W-1 inputs, oldest first (None = zeros,
    the start of a sequence). Returns (y [B, T, D], new window [B, W-1, D]): the last W-1
    inputs of cat(window, x), so decoding one token at a time equals one full pass.
    lengths: [B] real tokens per row when rows are right-padded; the new window then ends at each
    row's last real token (outputs at real positions never see the padding, which comes later).
    cu_seqlens [N+1]: a packed row (B = 1, no window) of N sequences, each starting from zeros: a
    tap never reaches across a boundary (kimi_kernels/varlen.py).
    """
    if x.dim() != 3:
        raise ValueError(f"short_conv: x must be [B, T, D], got shape {tuple(x.shape)}")
    B, T, D = x.shape
    w = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 else weight
    if w.dim() != 2 or w.shape[0] != D or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"short_conv: weight must be [D={D}, W] or [D, 1, W], got shape {tuple(weight.shape)}")
    W = w.shape[1]
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"short_conv: bias must be [{D}], got shape {tuple(bias.shape)}")
    if window is None:
        window = x.new_zeros(B, W - 1, D)
    elif window.shape != (B, W - 1, D):
        raise ValueError(f"short_conv: window must be [B, W-1, D] = {(B, W - 1, D)}, got {tuple(window.shape)}")
    if activation not in (None, "silu"):
        raise ValueError(f"short_conv: activation must be 'silu' or None, got {activation!r}")
    window = window.to(x.dtype)
    reach = None
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, "short_conv")
        reach = positions_in_segment(cu_seqlens, T)[None, :, None]  # [1, T, 1]: earlier inputs of its own sequence
    y = _causal_depthwise(x, window, w, bias, activation == "silu", reach)
    if lengths is None:
        return y, torch.cat((window, x[:, -(W - 1):]), dim=1)[:, -(W - 1):]  # small: holds no view of x
    # row b's window: positions lengths[b] .. lengths[b] + W-2 of cat(window, x)
    pos = lengths.to(x.device)[:, None] + torch.arange(W - 1, device=x.device)[None]
    padded = torch.cat((window, x), dim=1)
    return y, padded.gather(1, pos[..., None].expand(B, W - 1, D))


@fused_on_cuda
def _causal_depthwise(x: Tensor, window: Tensor, w: Tensor, bias: Tensor | None, silu: bool,
                      reach: Tensor | None = None) -> Tensor:
    """y[:, t] = sum_j xp[:, t + j] * w[:, j] (+ bias, then SiLU) with xp = cat(window, x), in
    fp32, in x's dtype. Written as W shifted products rather than a conv so that on CUDA the
    concatenation, casts, taps and SiLU compile to one kernel each way (W is 4). reach [B, T, 1]:
    how many earlier inputs token t may see (a packed row's position in its sequence); taps
    further back count zero."""
    W = w.shape[1]
    T = x.shape[1]
    xp = torch.cat((window, x), dim=1)  # [B, W-1+T, D]
    wf = _up(w)
    if reach is None:
        y = sum(_up(xp[:, j:j + T]) * wf[:, j] for j in range(W))
    else:  # tap j looks W-1-j inputs back
        y = sum(_up(xp[:, j:j + T]) * (reach >= W - 1 - j) * wf[:, j] for j in range(W))
    if bias is not None:
        y = y + _up(bias)
    if silu:
        y = F.silu(y)
    return y.to(x.dtype)


@fused_on_cuda
def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Boolean mask of the k largest entries along the last dim. Ties at the k-th value go to the
    lowest indices, exactly the set a stable descending sort keeps, without sorting the row:
    one top-k for the threshold, then a count of the ties before each position (on CUDA the
    comparisons, counts and the scan around the top-k run as one compiled chain)."""
    n = scores.shape[-1]
    if k >= n:
        return torch.ones_like(scores, dtype=torch.bool)
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    threshold = scores.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = scores > threshold
    ties = scores == threshold
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)
    return above | (ties & (ties.to(torch.int32).cumsum(-1, dtype=torch.int32) <= room))


@fused_on_cuda
def masked_logit_max(q: Tensor, k: Tensor, visible: Tensor, scale: float) -> Tensor:
    """Per-head max of scale * q.k over the visible (query, key) pairs: q [B, Tq, H, D],
    k [B, S, H, D], visible [B, Tq, S] bool. Returns [H] float32, -inf for a head that sees
    nothing. (The QK-Clip statistic; compiled on CUDA the max reads the logits once, in the
    GEMM's dtype, instead of materialising a masked float32 copy.)"""
    logits = torch.einsum("bthd,bshd->bhts", q, k)
    logits = _up(logits).masked_fill(~visible[:, None], float("-inf")) * scale
    return logits.amax(-1).amax(dim=(0, 2))  # rows first: a reduction to H values in one go parallelises badly


def topk_to_mask(indices: Tensor, num_keys: int) -> Tensor:
    """Boolean mask [..., num_keys] that is True at the given key indices; entries < 0 are ignored."""
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_to_mask: indices must be an integer tensor, got {indices.dtype}")
    mask = torch.zeros(*indices.shape[:-1], num_keys + 1, dtype=torch.bool, device=indices.device)
    idx = torch.where(indices < 0, num_keys, indices).long()  # send padding to a spare column
    return mask.scatter_(-1, idx, True)[..., :num_keys]


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    causal: bool = True,
    key_mask: Tensor | None = None,
    mask: Tensor | None = None,
    sink: Tensor | None = None,
) -> Tensor:
    """Softmax attention with every mask the global layers need, in fp32.

    q: [B, Tq, Hq, Dk]; k: [B, Tk, Hk, Dk]; v: [B, Tk, Hk, Dv]; Hk divides Hq (GQA).
    causal: query i sits at absolute position Tk - Tq + i (a decode step sees the cache).
    key_mask: bool [B, Tk], True = a real key (False = padding or a gap between caches).
    mask: bool [B, Tq, Tk]: keys each query may use (the DSA top-k selection), ANDed with the rest.
    sink: [Hq] logit per head that joins the softmax denominator only.
    Rows with no allowed key (and no sink) output zeros, not NaN. Returns [B, Tq, Hq, Dv].
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"masked_attention: q, k, v must be 4-D, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, Tq, Hq, Dk = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if k.shape != (B, Tk, Hk, Dk):
        raise ValueError(f"masked_attention: k must be [B={B}, Tk, Hk, Dk={Dk}], got {tuple(k.shape)}")
    if v.shape[:3] != (B, Tk, Hk):
        raise ValueError(f"masked_attention: v must be [B, Tk, Hk, Dv] = [{B}, {Tk}, {Hk}, Dv], got {tuple(v.shape)}")
    if Hq % Hk != 0:
        raise ValueError(f"masked_attention: Hk={Hk} must divide Hq={Hq}")
    if causal and Tq > Tk:
        raise ValueError(f"masked_attention: causal needs Tq <= Tk, got Tq={Tq}, Tk={Tk}")
    scale = Dk**-0.5 if scale is None else float(scale)

    # query heads grouped by the key head they share (head h uses key head h // rep): one product
    # per group, never a copy of the keys and values per query head
    rep = Hq // Hk
    kf, vf = _up(k), _up(v)
    qg = _up(q).view(B, Tq, Hk, rep, Dk)
    logits = torch.einsum("bqgrd,bkgd->bgrqk", qg, kf).reshape(B, Hq, Tq, Tk) * scale

    allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        qpos = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        allowed = allowed & (torch.arange(Tk, device=q.device)[None, :] <= qpos)
    if key_mask is not None:
        if key_mask.shape != (B, Tk) or key_mask.dtype != torch.bool:
            raise ValueError(f"masked_attention: key_mask must be bool [B, Tk] = [{B}, {Tk}], got "
                             f"{key_mask.dtype} {tuple(key_mask.shape)}")
        allowed = allowed & key_mask[:, None, None, :]
    if mask is not None:
        if mask.shape != (B, Tq, Tk) or mask.dtype != torch.bool:
            raise ValueError(f"masked_attention: mask must be bool [B, Tq, Tk] = [{B}, {Tq}, {Tk}], got "
                             f"{mask.dtype} {tuple(mask.shape)}")
        allowed = allowed & mask[:, None]
    logits = logits.masked_fill(~allowed, float("-inf"))

    if sink is not None:
        if sink.shape != (Hq,):
            raise ValueError(f"masked_attention: sink must be [Hq={Hq}], got {tuple(sink.shape)}")
        sink_col = _up(sink).view(1, Hq, 1, 1).expand(B, Hq, Tq, 1).to(logits.dtype)
        logits = torch.cat((logits, sink_col), dim=-1)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked rows: avoid inf - inf
    p = (logits - m).exp()
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if sink is not None:
        p = p[..., :Tk]  # the sink takes probability mass but has no value
    out = torch.einsum("bgrqk,bkgd->bqgrd", p.view(B, Hk, rep, Tq, Tk), vf).reshape(B, Tq, Hq, vf.shape[-1])
    return out.to(v.dtype)
