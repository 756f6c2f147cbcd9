"""Model FLOPs utilisation of the learner step, reported beside the step's time.

FLOPs use the usual 6N estimate: 2N for the forward and 4N for the backward per token, N the
parameters one token touches (routed experts it does not use and the embedding table left out:
policy.params.count_parameters' "active"); attention's own score FLOPs are left out. A no-grad
forward (the reference policy's, the proximal policy's) adds 2N per token. Peak FLOPs: the dense
bf16 rate of a known GPU, or KIMI_PEAK_FLOPS (FLOP/s) for any other device; none on CPU, where
only the achieved rate is reported."""
from __future__ import annotations

import os

import torch
from torch import nn

DENSE_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12}


def active_parameters(model: nn.Module) -> int:
    """Parameters one token's forward touches; every parameter where the model has no MoE config."""
    from policy.params import count_parameters

    if hasattr(getattr(model, "config", None), "moe_layers"):
        return count_parameters(model)["active"]
    return sum(p.numel() for p in model.parameters())


def peak_flops(device: torch.device) -> float | None:
    override = os.environ.get("KIMI_PEAK_FLOPS")
    if override:
        return float(override)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DENSE_BF16_PEAK.items() if key in name), None)


def step_flops(active: int, tokens: int, extra_forwards: int = 0) -> float:
    """Forward + backward over `tokens`, plus `extra_forwards` no-grad forwards over the same tokens."""
    return (6 + 2 * extra_forwards) * float(active) * tokens


def flops_metrics(flops: float, seconds: float, peak: float | None) -> dict[str, float]:
    rate = flops / max(seconds, 1e-9)
    out = {"train/model_tflops_per_s": rate / 1e12}
    if peak:
        out["train/mfu"] = rate / peak
    return out
