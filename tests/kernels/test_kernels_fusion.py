"""The fused (torch.compile'd) versions CUDA runs: traceable as one graph and equal to the reference.

Compiled here for CPU (same graph capture, Inductor's C++ backend) so CI, without a GPU, catches
an op that stops being compilable."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels.fusion import aligned, fused_on_cuda, set_fusion
from kimi_kernels.kda import kda_gate
from kimi_kernels.ops import _causal_depthwise, gated_rms_norm, l2norm, masked_logit_max, rms_norm, situ_glu, topk_mask
from policy.layers.attnres import _mix as attn_res_mix
from policy.layers.mla import _weighted_relu_scores


def _cases():
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(2, 5, 4, 8, generator=g), torch.randn(2, 5, 4, 8, generator=g)
    w = torch.randn(8, generator=g)
    return [
        (rms_norm, (x, w, 1e-6)), (l2norm, (x,)), (situ_glu, (x, gate, 4.0, 25.0)),
        (gated_rms_norm, (x, gate, w, 1e-6)),
        (kda_gate, (x, torch.randn(4, generator=g), torch.randn(32, generator=g), -5.0)),
        (kda_gate, (x, torch.randn(4, generator=g), torch.randn(32, generator=g), None)),
        (attn_res_mix, (x.reshape(2, 5, 32), gate.reshape(2, 5, 32)),
         dict(norm_weight=torch.randn(32, generator=g), query=torch.randn(1, 32, generator=g), eps=1e-6)),
        (topk_mask, (torch.randn(2, 5, 40, generator=g).round(), 7)),  # rounded: many ties
        (masked_logit_max, (x, gate, torch.rand(2, 5, 5, generator=g) > 0.5, 0.3)),
        (_causal_depthwise, (x.reshape(2, 5, 32), torch.randn(2, 2, 32, generator=g), torch.randn(32, 3, generator=g),
                            torch.randn(32, generator=g), True)),
        (_weighted_relu_scores, (x, torch.randn(2, 8, 6, generator=g), torch.randn(2, 5, 4, generator=g))),
    ]


@pytest.mark.parametrize("case", range(len(_cases())))
def test_compiled_op_equals_reference(case: int):
    fn, args, *kwargs = _cases()[case]
    kw = kwargs[0] if kwargs else {}
    compiled = torch.compile(fn.__wrapped__, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(*args, **kw), fn(*args, **kw), atol=1e-5, rtol=1e-5)


def test_dispatch_keeps_cpu_on_the_reference_and_can_be_switched_off():
    calls = []

    @fused_on_cuda
    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return 2 * t

    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0)) and calls == [False]
    prev = set_fusion(False)
    try:
        assert set_fusion(False) is False
    finally:
        set_fusion(prev)


def test_a_tensor_off_a_16_byte_boundary_is_passed_as_an_aligned_copy_gradients_flowing_back():
    flat = torch.zeros(33, requires_grad=True)
    on, off = flat[:8], flat[1:9]  # float32: 0 and 4 bytes past the buffer's (aligned) start
    assert aligned(on) is on and aligned(3) == 3
    copy = aligned(off)
    assert copy is not off and copy.data_ptr() % 16 == 0 and torch.equal(copy, off)
    (copy * torch.arange(8.0)).sum().backward()
    assert torch.equal(flat.grad[1:9], torch.arange(8.0)) and flat.grad[0] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled path runs on CUDA only")
def test_a_parameter_in_a_flat_buffer_off_alignment_through_the_compiled_op():
    """A learner under DeepSpeed's bf16 groups: parameters are views into one flat buffer. The op was
    compiled with an aligned parameter; one starting 2 bytes further on failed with a misaligned address."""
    prev = set_fusion(True)
    try:
        x = torch.randn(4, 7, 512, device="cuda", dtype=torch.bfloat16)
        flat = torch.randn(1 + 2 * 512, device="cuda", dtype=torch.bfloat16)
        first, second = torch.nn.Parameter(flat[:512]), torch.nn.Parameter(flat[513:])
        assert second.data_ptr() % 16 == 2
        for weight in (first, second):
            out = rms_norm(x, weight, 1e-6)
            torch.cuda.synchronize()
            torch.testing.assert_close(out, rms_norm.__wrapped__(x, weight, 1e-6))
    finally:
        set_fusion(prev)


def test_a_fused_op_stays_compiled_past_dynamos_default_limit(monkeypatch):
    """AttnRes's mix at 1-10 sources, with and without gradient (K3's learner has about that many): 20
    compiled entries of one function, past dynamo's default of 8, after which it would run eagerly."""
    import kimi_kernels.fusion as fusion
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "_BACKEND", "eager")  # dynamo's caching, no code generation: quick
    mix = fused_on_cuda(attn_res_mix.__wrapped__)  # a copy of the fused op: the module's keeps its backend
    torch._dynamo.reset()
    prev = set_fusion(True)
    try:
        # config.patch, not monkeypatch: undoing a monkeypatch deletes the setting from dynamo's config module
        with torch._dynamo.config.patch(recompile_limit=8):
            g = torch.Generator().manual_seed(0)
            query = torch.randn(1, 16, generator=g, requires_grad=True)
            kw = dict(norm_weight=torch.randn(16, generator=g), query=query, eps=1e-6)
            before = counters["stats"]["unique_graphs"]
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    for n in range(1, 11):
                        sources = [torch.randn(2, 3, 16, generator=g) for _ in range(n)]
                        torch.testing.assert_close(mix(*sources, **kw), attn_res_mix.__wrapped__(*sources, **kw))
            # each variant compiled (a shape may add a recompile); past the limit they would stop at ~10
            assert counters["stats"]["unique_graphs"] - before >= 20
    finally:
        set_fusion(prev)
        torch._dynamo.reset()


def test_a_chain_the_compiler_fails_on_runs_eagerly(monkeypatch):
    """A compiler that raises (a torch or driver version the chain was never tried with): the fused op
    gives the reference's result instead of ending the run."""
    import kimi_kernels.fusion as fusion

    def failing_backend(gm, example_inputs):
        raise RuntimeError("this compiler cannot")

    monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(fusion, "_BACKEND", failing_backend)
    norm = fused_on_cuda(rms_norm.__wrapped__)
    torch._dynamo.reset()
    prev = set_fusion(True)
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 8, generator=g), torch.randn(8, generator=g)
        with pytest.warns(UserWarning, match="compiling it failed, running it unfused"):
            torch.testing.assert_close(norm(x, w, 1e-6), rms_norm.__wrapped__(x, w, 1e-6))
    finally:
        set_fusion(prev)
        torch._dynamo.reset()


def test_a_fused_op_compiles_with_the_backend_set_when_it_is_called(monkeypatch):
    """A test that traces the module's own fused ops with another backend (tests/policy/test_backward_graph.py)
    must not leave them compiled with it for the rest of the process."""
    import kimi_kernels.fusion as fusion

    used: list[str] = []

    def recording(name):
        def backend(gm, example_inputs):
            used.append(name)
            return gm.forward
        return backend

    monkeypatch.setattr(fusion, "_DEVICE_TYPES", ("cuda", "cpu"))
    norm = fused_on_cuda(rms_norm.__wrapped__)
    torch._dynamo.reset()
    prev = set_fusion(True)
    try:
        x, w = torch.randn(3, 8), torch.randn(8)
        for name in ("first", "second"):
            monkeypatch.setattr(fusion, "_BACKEND", recording(name))
            norm(x, w, 1e-6)
        assert used == ["first", "second"]
    finally:
        set_fusion(prev)
        torch._dynamo.reset()
