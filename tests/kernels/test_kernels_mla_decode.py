"""MLA's absorbed decode kernel (kimi_kernels/mla_decode.py) against the fp32 reference attention.

It runs on CUDA (bf16, what decode uses) or, without a GPU, under Triton's interpreter in float32:
    TRITON_INTERPRET=1 PYTHONPATH=<triton's site> pytest tests/kernels/test_kernels_mla_decode.py
The last test runs this file's kernel tests there in a subprocess (tests/kernels/triton_interpreter.py)."""
from __future__ import annotations

import pytest
import torch

from kimi_kernels import mla_decode as kernel
from kimi_kernels.ops import masked_attention
from tests.kernels.triton_interpreter import DEVICE, ON_CUDA, needs_interpreter_site, run_under_interpreter

DTYPE = torch.bfloat16 if ON_CUDA else torch.float32  # the interpreter's bf16 products are wrong
_probe = torch.empty(1, 1, 16, device=DEVICE, dtype=DTYPE)
usable = pytest.mark.skipif(not kernel.mla_decode_supported(_probe, _probe, _probe),
                            reason="needs Triton with CUDA, or TRITON_INTERPRET=1")


def _inputs(B: int, H: int, S: int, L: int = 64, R: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L + R, generator=gen)
    latent, rope = torch.randn(B, S, L, generator=gen), torch.randn(B, S, R, generator=gen)
    valid = torch.rand(B, S, generator=gen) < 0.8
    return [t.to(DEVICE, DTYPE) for t in (q, latent, rope)] + [valid.to(DEVICE)]


def _reference(q, latent, rope, valid, scale):
    k = torch.cat([latent, rope], -1).unsqueeze(2)
    return masked_attention(q.unsqueeze(1), k, latent.unsqueeze(2), scale, causal=True, key_mask=valid)[:, 0]


def _close(out, ref):
    tol = 2e-2 if out.dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert (out.float() - ref.float()).abs().max().item() <= tol * max(ref.float().abs().max().item(), 1.0)


@usable
@pytest.mark.parametrize("heads", [4, 20])
def test_mla_decode_equals_the_reference(heads):
    """Head counts below and past a head block, key counts not a multiple of the key block, rows
    with invalid keys (padding, gaps) and one with none valid (zeros)."""
    q, latent, rope, valid = _inputs(3, heads, 45)
    valid[1] = False
    assert kernel.splits_for(3, heads, 45) == 1
    out = kernel.mla_decode(q, latent, rope, valid, 0.1)
    ref = _reference(q, latent, rope, valid, 0.1)
    _close(out, ref)
    assert out[1].abs().max().item() == 0


@usable
def test_mla_decode_split_key_ranges_merge_to_the_reference(monkeypatch):
    """Long rows split over programs (flash-decoding), a split left empty by invalid keys, and
    the merge of their partial sums."""
    monkeypatch.setattr(kernel, "_MIN_KEYS_PER_SPLIT", 32)
    q, latent, rope, valid = _inputs(2, 4, 150)
    valid[0, :64] = False  # row 0's first two splits see no valid key
    assert kernel.splits_for(2, 4, 150) == 4
    _close(kernel.mla_decode(q, latent, rope, valid, 0.1), _reference(q, latent, rope, valid, 0.1))


@usable
@pytest.mark.parametrize("min_split", [256, 32])
def test_paged_keys_give_what_gathered_keys_give(monkeypatch, min_split):
    """Keys read through a per-row index of pool positions (scattered, shared between rows, invalid
    ones pointing anywhere) equal the same keys gathered into [B, S] first, in one program per row
    and split over several."""
    monkeypatch.setattr(kernel, "_MIN_KEYS_PER_SPLIT", min_split)
    B, H, S, N, L, R = 3, 20, 150, 400, 64, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, L + R, generator=gen).to(DEVICE, DTYPE)
    pool_latent = torch.randn(N, L, generator=gen).to(DEVICE, DTYPE)
    pool_rope = torch.randn(N, R, generator=gen).to(DEVICE, DTYPE)
    index = torch.randint(0, N, (B, S), generator=gen)
    index[1, :40] = index[0, :40]  # a forked row's shared prefix
    valid = (torch.rand(B, S, generator=gen) < 0.8).to(DEVICE)
    index = index.to(DEVICE)
    paged = kernel.mla_decode_paged(q, pool_latent, pool_rope, index, valid, 0.1)
    gathered = kernel.mla_decode(q, pool_latent[index], pool_rope[index], valid, 0.1)
    assert torch.equal(paged, gathered)
    _close(paged, _reference(q, pool_latent[index], pool_rope[index], valid, 0.1))


def test_paged_mla_decode_refuses_a_batched_pool():
    q = torch.zeros(2, 4, 80)
    with pytest.raises(ValueError, match="latent_pool \\[N, L\\]"):
        kernel.mla_decode_paged(q, torch.zeros(2, 9, 64), torch.zeros(2, 9, 16), torch.zeros(2, 9, dtype=torch.long),
                                torch.ones(2, 9, dtype=torch.bool), 1.0)


def test_mla_decode_refuses_mismatched_shapes():
    q = torch.zeros(2, 4, 80)
    with pytest.raises(ValueError, match="latent \\[B, S, L\\]"):
        kernel.mla_decode(q, torch.zeros(2, 9, 64), torch.zeros(2, 9, 32), torch.ones(2, 9, dtype=torch.bool), 1.0)


@usable
def test_mla_layer_decode_step_uses_the_kernel(monkeypatch):
    """A decode step of the MLA layer in eval mode goes through the kernel and gives what the
    reference path gives (the layer's own switch turned off)."""
    from policy import build_model
    from policy.layers import mla

    model = build_model("toy", device=DEVICE, dtype=DTYPE).eval()
    layer = next(layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "kv_lora"))
    x = torch.randn(2, 7, model.config.hidden_size, device=DEVICE, dtype=DTYPE)
    calls = []
    real = mla.mla_decode
    monkeypatch.setattr(mla, "mla_decode", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.no_grad():
        _, cache, _ = layer(x[:, :6], use_cache=True)
        fast, _, _ = layer(x[:, 6:], cache=cache, use_cache=True)
        before = mla.set_decode_kernel(False)
        try:
            slow, _, _ = layer(x[:, 6:], cache=cache, use_cache=True)
        finally:
            mla.set_decode_kernel(before)
    assert len(calls) == 1
    _close(fast, slow)


@usable
def test_a_decode_step_on_a_paged_cache_reads_the_pools_through_the_paged_op(monkeypatch):
    """The model's decode step on a slot cache's view (as the rollout engine runs it: two rows of
    different lengths, their keys in scattered blocks) calls mla_decode_paged once per MLA layer, never
    the gathering op, and gives exactly the logits of the kernel on the keys gathered first."""
    from policy import build_model
    from policy.layers import mla
    from policy.slot_cache import SlotCache

    model = build_model("toy", device=DEVICE, dtype=DTYPE).eval()
    n_mla = sum(layer.kind != "kda" for layer in model.model.layers)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (37, 20)]

    def decode_logits() -> torch.Tensor:
        cache = SlotCache(model, max_slots=2, num_blocks=16, block_size=4)
        slots = [cache.alloc(), cache.alloc()]
        for slot, prompt in zip(slots, prompts):
            cache.reserve(slot, len(prompt) + 1)
            model(prompt[None].to(DEVICE), cache=cache.view([slot], [len(prompt)], len(prompt)), use_cache=True)
            cache.advance([slot], [len(prompt)])
        step = torch.tensor([[7], [9]], device=DEVICE)
        return model(step, cache=cache.view(slots, [1, 1], 1), use_cache=True, logits_to_keep=1).logits

    calls = {"paged": 0, "gathered": 0}
    real_paged, real_gathered = mla.mla_decode_paged, mla.mla_decode
    monkeypatch.setattr(mla, "mla_decode_paged", lambda *a: calls.__setitem__("paged", calls["paged"] + 1)
                        or real_paged(*a))
    monkeypatch.setattr(mla, "mla_decode", lambda *a: calls.__setitem__("gathered", calls["gathered"] + 1)
                        or real_gathered(*a))
    with torch.no_grad():
        paged = decode_logits()
        assert calls == {"paged": n_mla, "gathered": 0}
        before = mla.set_paged_keys(False)
        try:
            gathered = decode_logits()
        finally:
            mla.set_paged_keys(before)
    assert calls == {"paged": n_mla, "gathered": n_mla}
    assert torch.equal(paged, gathered)


@pytest.mark.skipif(kernel.mla_decode_supported(_probe, _probe, _probe), reason="the kernel tests run in this process")
@needs_interpreter_site
def test_the_kernel_tests_pass_under_triton_s_interpreter():
    run = run_under_interpreter(__file__, "equals_the_reference or merge_to or uses_the_kernel or paged")
    assert run.returncode == 0 and "8 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
