"""The learner's FLOPs accounting: 6N per token trained, 2N per extra no-grad forward, MFU where
the device's peak is known."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from policy import build_policy
from policy.params import count_parameters
from rl.learner.flops import active_parameters, flops_metrics, peak_flops, step_flops


def test_step_flops_count_forward_backward_and_extra_forwards():
    assert step_flops(10, 100) == 6 * 10 * 100
    assert step_flops(10, 100, extra_forwards=2) == 10 * 10 * 100  # + a reference and a proximal forward


def test_mfu_only_where_a_peak_is_known(monkeypatch):
    monkeypatch.delenv("KIMI_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu")) is None
    assert flops_metrics(4e12, 2.0, None) == {"train/model_tflops_per_s": 2.0}
    monkeypatch.setenv("KIMI_PEAK_FLOPS", "8e12")
    peak = peak_flops(torch.device("cpu"))
    assert peak == 8e12
    assert flops_metrics(4e12, 2.0, peak) == {"train/model_tflops_per_s": 2.0, "train/mfu": 0.25}


def test_active_parameters_leave_out_unused_experts_and_the_embedding():
    model = build_policy({"preset": "toy", "vocab_size": 320})
    counts = count_parameters(model)
    assert active_parameters(model) == counts["active"] < counts["total"]
    dense = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # no MoE config: every parameter counts
    assert active_parameters(dense) == 4 * 3 + 3 + 3 * 2 + 2
