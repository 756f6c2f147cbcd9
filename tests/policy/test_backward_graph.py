"""The learner's backward does no work the forward's shape forces by accident: no activation reaches the
backward as several slices. A slice's gradient is a zero-filled tensor the size of what it was cut
from, and the slices' gradients are then summed (at the Kimi-Linear shapes a KDA layer's q|k|v is
[8192, 12288] bf16: 3 fills and 2 adds of 201 MB a layer); one split takes one concatenation instead."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kimi_kernels import fusion
from policy import build_model
from policy.layers import kda as kda_layer

from _policy_tiny import tiny


def slices_taken_twice(loss: torch.Tensor) -> list[str]:
    """The autograd nodes of `loss`'s graph whose one output is read by two or more slices."""
    slices: Counter = Counter()
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for child, output_nr in node.next_functions:
            if child is not None:
                if type(node).__name__ == "SliceBackward0":
                    slices[(child, output_nr)] += 1
                todo.append(child)
    return sorted(f"{type(node).__name__}[{nr}] x{n}" for (node, nr), n in slices.items() if n > 1)


def _recurrence_as_one_op(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    """A stand-in for the KDA recurrence with every input in its gradient (the fla kernel on a GPU is
    one node; the CPU reference's own slicing of its chunks is not the mixer's)."""
    mix = (q * k).sum(-1, keepdim=True) * g.mean(-1, keepdim=True) * beta[..., None]
    return (v * mix).to(v.dtype), None


@pytest.mark.parametrize("packed", [False, True])
def test_no_activation_reaches_the_backward_as_several_slices(packed, monkeypatch):
    monkeypatch.setattr(kda_layer, "kda", _recurrence_as_one_op)
    # the fused elementwise chains as on a GPU: each one node of the backward (AOT autograd, no code generated)
    monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = build_model(tiny(layer_types=["kda", "kda", "kda", "mla"]))
    ids = torch.randint(3, 64, (1, 24))
    cu = torch.tensor([0, 9, 24]) if packed else None
    loss = model(ids, return_token_logprobs=True, cu_seqlens=cu).token_logprobs.sum()
    assert slices_taken_twice(loss) == []
