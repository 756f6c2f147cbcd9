"""Softmax attention for the global (MLA / DSA) layers, with a fused fast path.

`attention()` keeps `kimi_kernels.ops.masked_attention`'s contract (the fp32 reference and oracle)
and, by default on CUDA, runs PyTorch's fused `scaled_dot_product_attention` instead:
- plain causal attention over a full cache (the training forward of a packed batch) takes the
  flash kernel: q/k and v head dims are zero-padded to one size (zeros add nothing to q.k and
  the padded output columns are dropped);
- anything with a mask (padding, DSA top-k, a decode step over a longer cache) passes a boolean
  mask to SDPA's memory-efficient kernel. Rows with no visible key output zeros, as the
  reference does.
Attention sinks and float64 always take the reference.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

from .ops import masked_attention

__all__ = ["attention", "attention_backend", "set_attention_backend"]

Tensor = torch.Tensor

_BACKENDS = ("auto", "sdpa", "torch")
_FUSED_MAX_HEAD_DIM = 256  # the largest head dim SDPA's flash and memory-efficient kernels take
_default_backend = os.environ.get("KIMI_ATTENTION_BACKEND", "auto")


def set_attention_backend(name: str) -> str:
    """Default backend of attention(): "auto" (SDPA on CUDA, reference elsewhere), "sdpa"
    (SDPA on any device: how the CPU tests exercise the fast path) or "torch" (reference).
    Returns the previous one."""
    global _default_backend
    if name not in _BACKENDS:
        raise ValueError(f"attention: backend must be one of {_BACKENDS}, got {name!r}")
    prev, _default_backend = _default_backend, name
    return prev


@contextmanager
def attention_backend(name: str) -> Iterator[None]:
    prev = set_attention_backend(name)
    try:
        yield
    finally:
        set_attention_backend(prev)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, causal: bool = True,
              key_mask: Tensor | None = None, mask: Tensor | None = None,
              sink: Tensor | None = None, backend: str | None = None) -> Tensor:
    """Shapes and masks as in `kimi_kernels.ops.masked_attention`; returns [B, Tq, Hq, Dv] in v's dtype."""
    backend = _default_backend if backend is None else backend
    if backend not in _BACKENDS:
        raise ValueError(f"attention: backend must be one of {_BACKENDS}, got {backend!r}")
    fused = backend == "sdpa" or (backend == "auto" and q.is_cuda)
    if not fused or sink is not None or q.dtype == torch.float64:
        return masked_attention(q, k, v, scale, causal, key_mask, mask, sink)
    return _sdpa(q, k, v, scale, causal, key_mask, mask)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float | None, causal: bool,
          key_mask: Tensor | None, mask: Tensor | None) -> Tensor:
    B, Tq, Hq, Dk = q.shape
    Tk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    bad_mask = mask is not None and (mask.shape != (B, Tq, Tk) or mask.dtype != torch.bool)
    if Hq % Hk or k.shape[3] != Dk or v.shape[:3] != k.shape[:3] or (causal and Tq > Tk) or bad_mask:
        return masked_attention(q, k, v, scale, causal, key_mask, mask)  # its error messages
    if Hk < Hq and max(Dk, Dv) > _FUSED_MAX_HEAD_DIM and not (mask is None and Tq == Tk):
        # no fused kernel takes these head dims (MLA's absorbed decode: 576 / 512), and SDPA's math
        # fallback copies K and V once per query head; the reference shares them across the group
        return masked_attention(q, k, v, scale, causal, key_mask, mask)
    scale = Dk ** -0.5 if scale is None else float(scale)
    dtype = v.dtype
    q, k = q.to(dtype), k.to(dtype)
    plain = mask is None and Tq == Tk and (key_mask is None or bool(key_mask.all()))
    if plain:
        D = max(Dk, Dv)  # the flash kernel wants one head dim for q, k and v
        q, k, v = (F.pad(t, (0, D - t.shape[-1])) if t.shape[-1] < D else t for t in (q, k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=scale, enable_gqa=Hq != Hk)
        return out.transpose(1, 2)[..., :Dv]

    allowed = torch.ones(B, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        qpos = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
        allowed = allowed & (torch.arange(Tk, device=q.device)[None, :] <= qpos)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, :]
    if mask is not None:
        allowed = allowed & mask
    empty = ~allowed.any(-1, keepdim=True)  # [B, Tq, 1]: let such rows see everything, then zero them
    mask = (allowed | empty).unsqueeze(1)  # [B, 1, Tq, Tk]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=Hq != Hk).transpose(1, 2)
    return out.masked_fill(empty.unsqueeze(-1), 0.0)
