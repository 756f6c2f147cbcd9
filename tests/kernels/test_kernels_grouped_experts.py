"""The small-M expert kernels (kimi_kernels/grouped_experts.py) against the per-expert products.

They run on CUDA (bf16, what the policy's decode uses) or, without a GPU, under Triton's
interpreter in float32 (its bf16 products are wrong):
    TRITON_INTERPRET=1 PYTHONPATH=<triton's site> pytest tests/kernels/test_kernels_grouped_experts.py
The last test runs this file's kernel tests there in a subprocess (tests/kernels/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimi_kernels.grouped_experts import ROW_BLOCKS, experts_small_m, small_m_block
from kimi_kernels.ops import situ_glu
from kimi_kernels.triton_support import runs_triton
from tests.kernels.triton_interpreter import DEVICE, ON_CUDA, needs_interpreter_site, run_under_interpreter

usable = pytest.mark.skipif(not runs_triton(torch.empty(0, device=DEVICE)),
                            reason="needs Triton with CUDA, or TRITON_INTERPRET=1")


def _reference(zs, counts, w1, w3, w2, act):
    parts, start = [], 0
    for e, c in enumerate(counts.tolist()):
        z = zs[start:start + c].float()
        g, u = z @ w1[e].float().t(), z @ w3[e].float().t()
        h = F.silu(g) * u if act == "silu" else situ_glu(g, u, 4.0, 25.0)
        parts.append(h.to(zs.dtype).float() @ w2[e].float().t())
        start += c
    return torch.cat(parts)


@usable
@pytest.mark.parametrize("block_m", ROW_BLOCKS)
@pytest.mark.parametrize("act", ["silu", "situ"])
def test_small_m_experts_equal_the_per_expert_products(act, block_m):
    """Experts with no rows, with more rows than a block (walked a block at a time), and widths that
    are not multiples of the kernels' column and reduction blocks; each row block with the launch
    configurations its table gives."""
    dtype = torch.bfloat16 if ON_CUDA else torch.float32
    gen = torch.Generator().manual_seed(0)
    E, hidden, dim = 5, 80, 144
    counts = torch.tensor([3, 0, 137, 16, 1])
    zs = torch.randn(int(counts.sum()), dim, generator=gen)
    w1, w3 = (torch.randn(E, hidden, dim, generator=gen) / dim**0.5 for _ in range(2))
    w2 = torch.randn(E, dim, hidden, generator=gen) / hidden**0.5
    zs, w1, w3, w2 = (t.to(DEVICE, dtype) for t in (zs, w1, w3, w2))
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(DEVICE, torch.int32)
    out = experts_small_m(zs, offs, w1, w3, w2, block_m, act, 4.0, 25.0)
    ref = _reference(zs, counts, w1, w3, w2, act)
    assert out.dtype == dtype and out.shape == ref.shape
    # bf16: the kernels keep the gate and up products fp32 (the reference rounds them), and round the output
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_small_m_block_holds_the_busiest_expert_under_random_routing():
    assert small_m_block(1, 64) == 16
    assert small_m_block(256, 64) == 16  # 32 sequences, top-8 of 64 experts: mean 4, busiest ~10
    assert small_m_block(512, 64) == 32  # 64 sequences: mean 8, busiest ~16.5
    assert small_m_block(2048, 64) == 64  # 256 sequences: mean 32, busiest ~49
    assert small_m_block(4096, 64) is None  # 512 sequences, or a prefill: CUTLASS's grouped GEMM


@pytest.mark.skipif(not (ON_CUDA and runs_triton(torch.empty(0, device=DEVICE))),
                    reason="needs Triton and CUDA (sm90 for the grouped GEMM)")
def test_moe_layer_decode_batch_uses_the_small_m_kernels(monkeypatch):
    """A decode-sized batch through the MoE layer without gradient: the small-M kernels, close to
    the grouped GEMM's output; with a gradient wanted, the grouped GEMM (they have no backward)."""
    from policy import build_model
    from policy.layers import moe

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the grouped GEMM needs sm90")
    model = build_model("toy", num_experts=16, num_experts_per_token=4, hidden_size=128, moe_intermediate_size=64,
                        routed_expert_hidden_size=None, device="cuda", dtype=torch.bfloat16)
    layer = next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)
    x = torch.randn(1, 48, 128, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = moe.experts_small_m
    monkeypatch.setattr(moe, "experts_small_m", lambda *a: calls.append(a[5]) or real(*a))
    with torch.no_grad():
        small, _ = layer(x)
        before = moe.set_small_m(False)
        try:
            grouped, _ = layer(x)
        finally:
            moe.set_small_m(before)
    assert calls == [32]
    assert (small.float() - grouped.float()).abs().max() <= 3e-2 * grouped.float().abs().max()
    layer(x.requires_grad_())
    assert calls == [32]


@pytest.mark.skipif(runs_triton(torch.empty(0, device=DEVICE)),
                    reason="the kernel tests run in this process")
@needs_interpreter_site
def test_the_kernel_tests_pass_under_triton_s_interpreter():
    run = run_under_interpreter(__file__, "equal_the_per_expert")
    assert run.returncode == 0 and "6 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
