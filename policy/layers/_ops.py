"""The kernel ops the layers use, plus `glu`, the activation switch (SwiGLU or SiTU-GLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kimi_kernels.ops import l2norm, masked_attention, rms_norm, short_conv, situ_glu

__all__ = ["ONE_GEMM_MIN_ROWS", "glu", "l2norm", "masked_attention", "rms_norm", "short_conv"]

# Projections that read the same input run as one GEMM on their stacked weights from this many rows (B*T)
# on; below it (decoding) one GEMM each, since there copying the weights costs more than the products
ONE_GEMM_MIN_ROWS = 256


def glu(gate: torch.Tensor, up: torch.Tensor, act: str, situ_beta: float = 4.0,
        situ_linear_beta: float = 25.0) -> torch.Tensor:
    if act == "silu":
        return F.silu(gate) * up
    if act == "situ":
        return situ_glu(gate, up, situ_beta, situ_linear_beta)
    raise ValueError(f"glu: act must be 'silu' or 'situ', got {act!r}")
