"""KDA mixer layer: projections, short convs, gates and output norm around kimi_kernels.kda.

Parameter names follow the HF `kimi_k3` / `kimi_linear` checkpoints (self_attn.*):
q_proj, k_proj, v_proj, {q,k,v}_conv1d.weight [C, 1, W], f_a_proj, f_b_proj, A_log [HV],
dt_bias [HV*K], b_proj, g_proj (full-rank output gate) or g_a_proj/g_b_proj (low rank),
o_norm, o_proj.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from kimi_kernels.kda import kda, kda_gate, kda_in_slots

from ..cache import KDACache, SlotKDAView
from ..config import ModelConfig
from ._ops import ONE_GEMM_MIN_ROWS, l2norm, short_conv
from .norms import GatedRMSNorm


class ConvWeight(nn.Module):
    """Holds a depthwise conv kernel under the checkpoint name `<x>_conv1d.weight`."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        bound = 1.0 / math.sqrt(width)  # PyTorch's Conv1d default (fan_in = width for depthwise)
        nn.init.uniform_(self.weight, -bound, bound)


class KDAMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.H, self.HV, self.K, self.V = cfg.linear_num_heads, cfg.num_v_heads, cfg.linear_head_dim, cfg.v_dim
        self.W = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.lower_bound = cfg.gate_lower_bound if cfg.kda_gate == "lower_bound" else None
        self.neg_eigval = cfg.kda_allow_neg_eigval
        qk, vd = self.H * self.K, self.HV * self.V
        self.q_proj = nn.Linear(d, qk, bias=False)
        self.k_proj = nn.Linear(d, qk, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        self.q_conv1d = ConvWeight(qk, self.W)
        self.k_conv1d = ConvWeight(qk, self.W)
        self.v_conv1d = ConvWeight(vd, self.W)
        # low-rank channel-wise forget gate: d -> K -> HV*K
        self.f_a_proj = nn.Linear(d, self.K, bias=False)
        self.f_b_proj = nn.Linear(self.K, self.HV * self.K, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.HV, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(self.HV * self.K, dtype=torch.float32))
        self.b_proj = nn.Linear(d, self.HV, bias=False)
        self.full_rank_gate = cfg.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = nn.Linear(d, vd, bias=False)
        else:
            self.g_a_proj = nn.Linear(d, self.K, bias=False)
            self.g_b_proj = nn.Linear(self.K, vd, bias=False)
        self.o_norm = GatedRMSNorm(self.V, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(vd, d, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        # A_log ~ log U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1] (fla's init)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def conv_channels(self) -> int:
        return 2 * self.H * self.K + self.HV * self.V

    def empty_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> KDACache:
        return KDACache(torch.zeros(batch, self.HV, self.K, self.V, device=device, dtype=torch.float32),
                        torch.zeros(batch, self.W - 1, self.conv_channels(), device=device, dtype=dtype))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections that read x: (q|k|v side by side, f_a, b, output gate input). Over many
        rows as one GEMM on the concatenated weights (one pass over x, no concatenation of q, k, v
        for the short conv); over a few rows (decoding) one GEMM each, since there copying the
        weights would cost more than the products."""
        first = [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj,
                 self.g_proj if self.full_rank_gate else self.g_a_proj]
        if x.shape[0] * x.shape[1] < ONE_GEMM_MIN_ROWS:
            outs = [p(x) for p in first]
            return (torch.cat(outs[:3], dim=-1), *outs[3:])
        sizes = [p.out_features for p in first]
        proj = F.linear(x, torch.cat([p.weight for p in first]))
        return tuple(proj.split([sum(sizes[:3])] + sizes[3:], dim=-1))

    def forward(self, x: torch.Tensor, cache: KDACache | SlotKDAView | None = None, use_cache: bool = False,
                token_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, KDACache | SlotKDAView | None]:
        """token_mask [B, T] bool (right padding): padded positions neither decay nor write the
        recurrent state (gate 0, beta 0), so the final state is each row's after its last real token.
        cu_seqlens: a packed row of sequences (kimi_kernels/varlen.py): the short convs and the
        recurrent state start from zero at each sequence's first token."""
        B, T, _ = x.shape
        qkv, f_a, b, g_in = self._project(x)
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)
        window = None if cache is None else cache.conv
        lengths = None if token_mask is None else token_mask.sum(1)
        qkv, new_window = short_conv(qkv, weight, window=window, lengths=lengths, cu_seqlens=cu_seqlens)
        # one split, not three slices: a slice's gradient is a zero-filled copy of all of qkv, and the
        # three would then be summed (3 fills and 2 adds of [T, 2qk + vd] a layer in the backward)
        q, k, v = qkv.split([self.H * self.K, self.H * self.K, self.HV * self.V], dim=-1)
        q, k, v = q.reshape(B, T, self.H, self.K), k.reshape(B, T, self.H, self.K), v.reshape(B, T, self.HV, self.V)
        q, k = l2norm(q), l2norm(k)  # the kernel uses q, k as given
        f = self.f_b_proj(f_a).reshape(B, T, self.HV, self.K)  # explicit heads: no shape guessing
        g = kda_gate(f, self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(b.float())
        if self.neg_eigval:
            beta = 2.0 * beta  # eigenvalues of (I - beta k k^T) in [-1, 1]
        if token_mask is not None:
            g = g * token_mask[:, :, None, None].to(g.dtype)
            beta = beta * token_mask[:, :, None].to(beta.dtype)
        if isinstance(cache, SlotKDAView):  # a serving engine's slots: the states are updated where they lie
            o = kda_in_slots(q, k, v, g, beta, cache.state_pool, cache.slots)
            new_cache = replace(cache, new_conv=new_window)
        else:
            state = None if cache is None else cache.state
            o, final = kda(q, k, v, g, beta, initial_state=state, output_final_state=use_cache, cu_seqlens=cu_seqlens)
            new_cache = KDACache(final, new_window) if use_cache else None
        gate = g_in if self.full_rank_gate else self.g_b_proj(g_in)
        o = self.o_norm(o, gate.reshape(B, T, self.HV, self.V)).reshape(B, T, self.HV * self.V)
        return self.o_proj(o), new_cache
