"""Block Attention Residuals: a learned depth-wise softmax over earlier block outputs.

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i
The pseudo-query w (`*_res_proj.weight`, [1, d]) is a parameter, not derived from h; keys are the
RMSNorm of the values (`*_res_norm.weight`), no 1/sqrt(d); values are used raw. With w = 0 the
mix is the uniform mean of the sources. Computed in float32.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.fusion import fused_on_cuda

from ._ops import rms_norm


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """sources: N tensors [B, T, d]; norm_weight: [d]; query: [1, d] or [d]. Returns [B, T, d]."""
    if not sources:
        raise ValueError("attn_res_mix: need at least one source")
    return _mix_stacked(torch.stack(sources, dim=0), norm_weight, query, eps)


@fused_on_cuda  # one compiled kernel for any number of sources (N is a dynamic size)
def _mix_stacked(v: torch.Tensor, norm_weight: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    vf = v.float()  # [N, B, T, d]
    keys = rms_norm(vf, norm_weight, eps)
    logits = keys @ query.float().reshape(-1)  # [N, B, T]
    w = torch.softmax(logits, dim=0)
    return (w.unsqueeze(-1) * vf).sum(0).to(v.dtype)


class AttnRes(nn.Module):
    """Standalone form (tests, reuse): holds one pseudo-query and one key norm."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(dim))
        self.proj = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(self.proj.weight)  # start as the uniform mean of the sources
        self.eps = eps

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return attn_res_mix(sources, self.norm, self.proj.weight, self.eps)
