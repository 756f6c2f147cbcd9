"""Block Attention Residuals: a learned depth-wise softmax over earlier block outputs.

    h = sum_i softmax_i(w . RMSNorm(v_i)) v_i
The pseudo-query w (`*_res_proj.weight`, [1, d]) is a parameter, not derived from h; keys are the
RMSNorm of the values (`*_res_norm.weight`), no 1/sqrt(d); values are used raw. With w = 0 the
mix is the uniform mean of the sources. Computed in float32.
"""
from __future__ import annotations

import torch
from torch import nn

from kimi_kernels.fusion import fused_on_cuda

from ._ops import rms_norm


def attn_res_mix(sources: list[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """sources: N tensors [B, T, d]; norm_weight: [d]; query: [1, d] or [d]. Returns [B, T, d]."""
    if not sources:
        raise ValueError("attn_res_mix: need at least one source")
    return _mix(*sources, norm_weight=norm_weight, query=query, eps=eps)


@fused_on_cuda  # one compiled kernel per number of sources; the sources are never stacked into a copy
def _mix(*sources: torch.Tensor, norm_weight: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    q = query.float().reshape(-1)
    logits = torch.stack([rms_norm(v.float(), norm_weight, eps) @ q for v in sources])  # [N, B, T]
    w = torch.softmax(logits, dim=0)
    return sum(w[i].unsqueeze(-1) * v.float() for i, v in enumerate(sources)).to(sources[0].dtype)


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
