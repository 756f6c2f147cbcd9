"""Which parameters stay float32 when a model is cast to a lower precision (shared by building and
loading, so neither imports the other)."""
from __future__ import annotations

from torch import nn


def keep_fp32(model: nn.Module) -> None:
    """Router, its bias and the KDA decay parameters stay float32 (K3 keeps them so)."""
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias", "gate.weight", "conv1d.weight")):
            p.data = p.data.float()
    for name, b in model.named_buffers():
        if b.is_floating_point():
            b.data = b.data.float()
