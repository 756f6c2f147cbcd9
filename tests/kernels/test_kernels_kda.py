"""KDA: chunked == recurrent (float64, 1e-10), gradients, state carry, external oracle, gates."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kimi_kernels.kda as kda_module
from kimi_kernels.kda import (fla_available, inference_chunk_size, kda, kda_chunk, kda_gate, kda_in_slots,
                         kda_recurrent)


def make_inputs(B=2, T=70, H=2, HV=4, K=8, V=6, gate="softplus", dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, HV, V)
    f = r(B, T, HV, K)
    A_log = torch.empty(HV, dtype=torch.float32).uniform_(1, 16, generator=gen).log()
    dt_bias = r(HV * K).float()
    if gate == "softplus":
        g = kda_gate(f, A_log, dt_bias).to(dtype)
    elif gate == "lb":
        g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0).to(dtype)
    elif gate == "at_lb":  # every channel at the lower bound: strongest decay the layer allows
        g = torch.full((B, T, HV, K), -5.0, dtype=dtype)
    elif gate == "none":
        g = torch.zeros(B, T, HV, K, dtype=dtype)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(r(B, T, HV))
    h0 = r(B, HV, K, V)
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("T", [1, 63, 64, 150])
@pytest.mark.parametrize("H,HV", [(2, 2), (1, 3), (2, 4)])
@pytest.mark.parametrize("gate", ["softplus", "lb", "at_lb", "none"])
def test_chunk_equals_recurrent_float64(T, H, HV, gate):
    q, k, v, g, beta, h0 = make_inputs(T=T, H=H, HV=HV, gate=gate, seed=T + 7 * HV)
    for init in (None, h0):
        o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=init, output_final_state=True)
        o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=init, output_final_state=True)
        assert o_c.dtype == torch.float64 and s_c.dtype == torch.float64
        assert o_c.shape == (2, T, HV, 6) and s_c.shape == (2, HV, 8, 6)
        assert (o_c - o_r).abs().max().item() < 1e-10
        assert (s_c - s_r).abs().max().item() < 1e-10


@pytest.mark.parametrize("chunk_size", [1, 8, 24, 32, 128])
def test_chunk_sizes(chunk_size):
    q, k, v, g, beta, h0 = make_inputs(T=100, gate="lb", seed=3)
    o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o_c - o_r).abs().max().item() < 1e-10
    assert (s_c - s_r).abs().max().item() < 1e-10


def test_scale_argument():
    q, k, v, g, beta, _ = make_inputs(T=40, seed=4)
    o_c, _ = kda_chunk(q, k, v, g, beta, scale=0.3)
    o_r, _ = kda_recurrent(q, k, v, g, beta, scale=0.3)
    o_d, _ = kda_recurrent(q, k, v, g, beta)
    assert (o_c - o_r).abs().max().item() < 1e-10
    assert (o_r - o_d).abs().max().item() > 1e-3  # the scale is actually used


def test_recurrent_matches_hand_rolled_delta_rule():
    """The oracle itself, checked against the model.md equations written out per head."""
    q, k, v, g, beta, h0 = make_inputs(B=1, T=5, H=1, HV=2, K=3, V=2, seed=5)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for hv in range(2):
        S = h0[0, hv].clone()
        for t in range(5):
            S = torch.diag(g[0, t, hv].exp()) @ S
            kt, vt = k[0, t, 0], v[0, t, hv]
            S = S + beta[0, t, hv] * torch.outer(kt, vt - S.T @ kt)
            ot = S.T @ (q[0, t, 0] * 3**-0.5)
            assert torch.allclose(o[0, t, hv], ot, atol=1e-12)
        assert torch.allclose(s[0, hv], S, atol=1e-12)


def test_two_calls_with_carried_state_equal_one_call():
    q, k, v, g, beta, h0 = make_inputs(T=130, gate="lb", seed=6)
    o_full, s_full = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    cut = 77
    o1, s1 = kda_chunk(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], initial_state=h0,
                       output_final_state=True)
    o2, s2 = kda_chunk(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], initial_state=s1,
                       output_final_state=True)
    assert (torch.cat([o1, o2], 1) - o_full).abs().max().item() < 1e-10
    assert (s2 - s_full).abs().max().item() < 1e-10


def test_prefill_then_token_decode_equals_full():
    q, k, v, g, beta, _ = make_inputs(T=70, seed=8)
    o_full, s_full = kda_chunk(q, k, v, g, beta, output_final_state=True)
    o, s = kda_chunk(q[:, :65], k[:, :65], v[:, :65], g[:, :65], beta[:, :65], output_final_state=True)
    outs = [o]
    for t in range(65, 70):
        sl = slice(t, t + 1)
        o, s = kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s, output_final_state=True)
        outs.append(o)
    assert (torch.cat(outs, 1) - o_full).abs().max().item() < 1e-10
    assert (s - s_full).abs().max().item() < 1e-10


@pytest.mark.parametrize("T,chunk_size", [(11, 4), (20, 16)])  # chunk 16 = two sub-blocks of 8: cross-block path
def test_gradcheck_chunk(T, chunk_size):
    q, k, v, g, beta, h0 = make_inputs(B=1, T=T, H=1, HV=2, K=3, V=2, gate="lb", seed=9)
    args = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]

    def fn(q, k, v, g, beta, h0):
        o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
        return o, s

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)


def test_chunk_grad_matches_recurrent_grad():
    q, k, v, g, beta, h0 = make_inputs(T=70, gate="lb", seed=10)
    grads = []
    for fn in (kda_chunk, kda_recurrent):
        args = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        o, s = fn(*args[:5], initial_state=args[5], output_final_state=True)
        (o.sin().sum() + s.cos().sum()).backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-10


def test_float32_strong_decay_is_finite_and_accurate():
    """lb = -5 over 64 tokens: a factored exp(-Gamma) would reach e^320 and overflow fp32."""
    q, k, v, g, beta, h0 = make_inputs(T=128, gate="at_lb", seed=11)
    o64, s64 = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o32, s32 = kda_chunk(*(x.float() for x in (q, k, v, g, beta)), initial_state=h0.float(),
                         output_final_state=True)
    assert o32.dtype == torch.float32 and s32.dtype == torch.float32
    assert torch.isfinite(o32).all() and torch.isfinite(s32).all()
    assert (o32.double() - o64).abs().max().item() < 1e-5
    assert (s32.double() - s64).abs().max().item() < 1e-5


def test_bfloat16_inputs_give_bf16_output_fp32_state():
    q, k, v, g, beta, _ = make_inputs(T=20, seed=12)
    o, s = kda_chunk(*(x.bfloat16() for x in (q, k, v, g, beta)), output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    assert (o.double() - o_ref).abs().max().item() < 5e-2


def test_matches_transformers_kimi_linear_fallback():
    """External oracle: transformers' own pure-torch KDA (H == HV, no initial state)."""
    mod = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    ref_fn = getattr(mod.chunk_kimi_delta_attention, "__wrapped__", mod.chunk_kimi_delta_attention)
    q, k, v, g, beta, h0 = make_inputs(T=90, H=2, HV=2, gate="lb", dtype=torch.float32, seed=13)
    o_ref, s_ref = ref_fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert (o - o_ref).abs().max().item() < 1e-4
    assert (s - s_ref).abs().max().item() < 1e-4


def test_dispatch_on_cpu_uses_torch_paths():
    q, k, v, g, beta, h0 = make_inputs(T=33, seed=14)
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_c, s_c = kda_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                         chunk_size=inference_chunk_size(33))
    assert torch.equal(o, o_c) and torch.equal(s, s_c)
    o1, s1 = kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0, output_final_state=True)
    o1r, s1r = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0,
                             output_final_state=True)
    assert torch.equal(o1, o1r) and torch.equal(s1, s1r)
    with pytest.raises(RuntimeError, match="fla"):
        kda(q, k, v, g, beta, backend="fla")
    with pytest.raises(ValueError, match="backend"):
        kda(q, k, v, g, beta, backend="cuda")


@pytest.mark.parametrize("T", [5, 8, 9, 40, 64, 65, 100])
def test_forward_without_grad_takes_the_inference_chunk_and_still_equals_the_recurrence(T, monkeypatch):
    """Without gradient the torch path runs short inputs token by token and others in small chunks
    (a rollout prefill); with gradient it keeps chunks of 64 (training). Same results either way."""
    q, k, v, g, beta, h0 = make_inputs(T=T, gate="lb", seed=T)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    chunks: list[int | None] = []
    real_chunk, real_recurrent = kda_module.kda_chunk, kda_module.kda_recurrent

    def spy_chunk(*args, chunk_size=64, **kwargs):
        chunks.append(chunk_size)
        return real_chunk(*args, chunk_size=chunk_size, **kwargs)

    def spy_recurrent(*args, **kwargs):
        chunks.append(None)
        return real_recurrent(*args, **kwargs)

    monkeypatch.setattr(kda_module, "kda_chunk", spy_chunk)
    monkeypatch.setattr(kda_module, "kda_recurrent", spy_recurrent)
    with torch.no_grad():
        o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert chunks == [None if T <= 8 else 16 if T <= 64 else 32]
    assert (o - o_r).abs().max().item() < 1e-10 and (s - s_r).abs().max().item() < 1e-10

    chunks.clear()
    grad_q = q.clone().requires_grad_(True)
    o_g, _ = kda(grad_q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert chunks == [64]
    assert (o_g.detach() - o_r).abs().max().item() < 1e-10


def test_output_final_state_false_returns_none():
    q, k, v, g, beta, _ = make_inputs(T=10, seed=15)
    assert kda_chunk(q, k, v, g, beta)[1] is None
    assert kda_recurrent(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "q": a["q"][0]}, "q must be"),
        (lambda a: {**a, "k": a["k"][:, :, :1]}, "k must be"),
        (lambda a: {**a, "v": a["v"][:, :3]}, "v must be"),
        (lambda a: {**a, "v": a["v"][:, :, :3], "g": a["g"][:, :, :3], "beta": a["beta"][:, :, :3]}, "multiple"),
        (lambda a: {**a, "g": a["g"][..., :2]}, "g must be"),
        (lambda a: {**a, "beta": a["beta"][..., None]}, "beta must be"),
        (lambda a: {**a, "initial_state": a["initial_state"][:, :1]}, "initial_state must be"),
        (lambda a: {**a, "q": a["q"].long()}, "q must be a floating"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, match):
    q, k, v, g, beta, h0 = make_inputs(T=5, seed=16)
    a = mutate(dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0))
    for fn in (kda_chunk, kda_recurrent, kda):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(**a)


def test_kda_gate_forms():
    gen = torch.Generator().manual_seed(17)
    H, K = 3, 4
    f = torch.randn(2, 5, H * K, generator=gen, dtype=torch.bfloat16)
    A_log = torch.rand(H, generator=gen) * 2
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f, A_log, dt_bias)
    assert g.shape == (2, 5, H, K) and g.dtype == torch.float32
    x = f.float().view(2, 5, H, K) + dt_bias.view(H, K)
    expect = -A_log.exp().view(H, 1) * torch.log1p(torch.exp(x))
    assert torch.allclose(g, expect, atol=1e-6)
    assert (g <= 0).all()
    # same result with f already split into heads, and with dt_bias as [H, K]
    assert torch.equal(kda_gate(f.view(2, 5, H, K), A_log, dt_bias.view(H, K)), g)
    glb = kda_gate(f, A_log, dt_bias, lower_bound=-5.0)
    expect_lb = -5.0 * torch.sigmoid(A_log.exp().view(H, 1) * x)
    assert torch.allclose(glb, expect_lb, atol=1e-6)
    assert (glb > -5).all() and (glb < 0).all()
    # extreme inputs stay inside the bound (saturate to it, never beyond)
    big = kda_gate(torch.full((1, H * K), -1e4), A_log, None, lower_bound=-5.0)
    assert big.min().item() >= -5.0 and torch.isfinite(big).all()
    with pytest.raises(ValueError, match="f must be"):
        kda_gate(torch.randn(2, 7), A_log, None)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, A_log, torch.randn(5))
    with pytest.raises(ValueError, match="f must be"):
        kda_gate(f, A_log, torch.randn(H * (K + 1)))
    # T == H in a flat [B, T, H*K] input: dt_bias settles the layout (no guessing on the T dim)
    f_tie = torch.randn(2, H, H * K, generator=gen)
    assert kda_gate(f_tie, A_log, dt_bias).shape == (2, H, H, K)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, A_log, dt_bias, lower_bound=5.0)
    assert math.isclose(kda_gate(torch.zeros(1, H, K), torch.zeros(H), None, lower_bound=-5.0)[0, 0, 0].item(),
                        -2.5)


def test_backend_default_switch():
    from kimi_kernels.kda import kda_backend, set_kda_backend

    q, k, v, g, beta, _ = make_inputs(T=9, seed=18)
    with kda_backend("torch"):
        o, _ = kda(q, k, v, g, beta)
        with pytest.raises(RuntimeError, match="fla"):
            with kda_backend("fla"):
                kda(q, k, v, g, beta)
        assert torch.equal(o, kda_chunk(q, k, v, g, beta, chunk_size=inference_chunk_size(9))[0])
    with pytest.raises(ValueError, match="backend"):
        set_kda_backend("triton")


def _pool_case(T: int, device: str, dtype: torch.dtype, seed: int):
    """Three rows whose states sit in slots 4, 0 and 2 of a 6-slot float32 pool."""
    q, k, v, g, beta, _ = make_inputs(B=3, T=T, H=2, HV=4, K=16, V=32, dtype=dtype, seed=seed)
    pool = torch.randn(6, 4, 16, 32, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    slots = torch.tensor([4, 0, 2], device=device)
    return [t.to(device) for t in (q, k, v, g, beta)], pool, slots


@pytest.mark.parametrize("T", [1, 5])
def test_kda_in_slots_updates_the_rows_slots_and_nothing_else(T):
    """A batch's states read from and written back into their pool slots equal kda on the gathered
    states; the slots no row uses keep their states."""
    (q, k, v, g, beta), pool, slots = _pool_case(T, "cpu", torch.float32, seed=20)
    before = pool.clone()
    o = kda_in_slots(q, k, v, g, beta, pool, slots)
    o_ref, final = kda(q, k, v, g, beta, initial_state=before[slots], output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(pool[slots], final)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_in_slots_torch_decode_step_equals_the_recurrence(dtype):
    """A decode step without grad on the torch path (a CPU engine's) updates the gathered states in
    place with batched products: the recurrence's outputs and states, grouped value heads included;
    the slots no row uses keep their states."""
    (q, k, v, g, beta), pool, slots = _pool_case(1, "cpu", dtype, seed=23)
    before = pool.clone()
    with torch.no_grad():
        o = kda_in_slots(q, k, v, g, beta, pool, slots)
    o_ref, final = kda_recurrent(q, k, v, g, beta, initial_state=before[slots], output_final_state=True)
    assert o.dtype == o_ref.dtype == dtype
    assert torch.allclose(o.float(), o_ref.float(), atol=1e-5, rtol=1e-5)
    assert torch.allclose(pool[slots], final, atol=1e-5, rtol=1e-5)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
def test_kda_in_slots_fla_decode_step_equals_the_torch_path():
    """On CUDA the decode step runs fla's recurrent kernel on the pool in place (its continuous-
    batching mode): the same outputs and states as the torch path's gather, step and scatter."""
    (q, k, v, g, beta), pool, slots = _pool_case(1, "cuda", torch.float32, seed=21)
    pool_torch = pool.clone()
    q, k, v = (t.bfloat16() for t in (q, k, v))
    with torch.no_grad():
        o = kda_in_slots(q, k, v, g, beta, pool, slots)
        o_ref = kda_in_slots(q, k, v, g, beta, pool_torch, slots, backend="torch")
    assert o.dtype == o_ref.dtype == torch.bfloat16
    assert torch.allclose(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(pool, pool_torch, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core"))])
def test_fla_recurrent_backend_runs_chunks_on_the_torch_path(device):
    """"fla_recurrent" gives fla only the 1-token steps: a chunk is the torch path's, bit for bit."""
    q, k, v, g, beta, h0 = (t.to(device) for t in make_inputs(T=9, dtype=torch.float32, seed=22))
    o, s = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="fla_recurrent")
    o_t, s_t = kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    assert torch.equal(o, o_t) and torch.equal(s, s_t)
    with torch.no_grad():
        o1, _ = kda(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0, backend="fla_recurrent")
    o1_t, _ = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], initial_state=h0)
    assert torch.allclose(o1, o1_t, atol=1e-4)
