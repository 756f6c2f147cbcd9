"""Which parameters stay float32 when a model is cast to a lower precision (shared by building and
loading, so neither imports the other)."""
from __future__ import annotations

import torch
from torch import nn


def keep_fp32(model: nn.Module) -> None:
    """Router, its bias and the KDA decay parameters stay float32 (K3 keeps them so)."""
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias", "gate.weight", "conv1d.weight")):
            p.data = p.data.float()
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.data = b.data.float()


def device_precision(device: torch.device) -> torch.dtype:
    """Training and serving precision: bf16 weights on a GPU (fp32 master weights stay in the
    learner's optimizer), fp32 on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def params_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters in `dtype`, floating buffers in float32 (MoE load counts, the router's bias and
    QK-Clip maxima need float32's range and resolution). DeepSpeed's bf16 mode casts a learner's
    module so; an engine receiving its weights must hold the same dtypes."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    for b in model.buffers():
        if b.is_floating_point():
            b.data = b.data.float()
    return model
