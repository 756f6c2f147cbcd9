"""Transformers models as policies: token logprobs equal a full log_softmax, the GRPO gradient does not
depend on how the batch is cut into micro-batches nor on packing them into one row, a packed row keeps its
sequences apart, and the checkpoint names are transformers' saved ones."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from policy import HFPolicy, build_policy, checkpoint_state_dict  # noqa: E402
from rl.config import TrainConfig  # noqa: E402
from rl.learner.batches import collate, plan_packed, plan_padded, rows_from_samples  # noqa: E402
from rl.learner.loss import accumulate_policy_gradient, compute_advantages, loss_normaliser  # noqa: E402
from kimi_kernels.varlen import PAD_ALLOWANCE, PAD_SLACK  # noqa: E402
from tiny_hf_models import VOCAB, save_tiny, tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_token_logprobs_equal_a_full_log_softmax(kind):
    policy = HFPolicy(tiny_hf_model(kind))
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = policy(ids, return_token_logprobs=True, logit_scale=1 / 0.7)
        logits = policy.hf(ids).logits.float() / 0.7
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(out.token_logprobs[:, 1:], ref, atol=1e-5, rtol=0)
    assert torch.all(out.token_logprobs[:, 0] == 0)
    p = torch.softmax(logits[:, :-1], -1)
    torch.testing.assert_close(out.token_entropy[:, 1:], -(p * p.log()).sum(-1), atol=1e-4, rtol=0)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    with torch.no_grad():
        masked = policy(ids, logit_scale=1 / 0.7, token_mask=mask).token_logprobs
    torch.testing.assert_close(masked[:, 6:], out.token_logprobs[:, 6:], atol=1e-6, rtol=0)
    assert torch.all(masked[:, :6] == 0)
    assert policy.after_optimizer_step() == {}


def _samples(n: int):
    from rl.types import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = int(torch.randint(6, 14, (1,), generator=g))
        prompt = int(torch.randint(2, length - 2, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        logp = [0.0] * prompt + (-torch.rand(length - prompt, generator=g) * 3).tolist()
        out.append(Sample(uid=f"s{i}", group_uid=f"g{i // 4}", env="e", domain="d", task_id="t", effort="low",
                          tokens=tokens, loss_mask=[0] * prompt + [1] * (length - prompt), behavior_logprobs=logp,
                          token_versions=[-1] * prompt + [0] * (length - prompt), reward=float(torch.rand(1, generator=g))))
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_the_gradient_does_not_depend_on_micro_batches_or_packing(kind):
    policy = HFPolicy(tiny_hf_model(kind))  # float32: transformers' grouped-GEMM experts take no float64
    assert policy.packs_rows
    samples = _samples(8)
    rows = rows_from_samples(samples, compute_advantages([s.reward for s in samples], [s.group_uid for s in samples]))
    cfg = TrainConfig()

    def grads(packed: bool, cut: int) -> list[torch.Tensor]:
        plan = plan_packed([len(r.tokens) for r in rows], 1, cut) if packed else plan_padded(len(rows), 1, cut)
        policy.zero_grad()
        accumulate_policy_gradient(policy, [collate([rows[i] for i in p], 0, packed) for p in plan[0]], cfg,
                                   loss_normaliser(rows, cfg, 16))
        return [p.grad.clone() for p in policy.parameters() if p.grad is not None]

    one = grads(False, 1)
    assert any(float(g.abs().max()) > 0 for g in one)
    # float32 sums in another order; a per-micro-batch normalisation bug would differ by tens of percent
    scale = max(float(g.abs().max()) for g in one)
    for packed, cut in ((False, 4), (True, 30), (True, 1000)):
        other = grads(packed, cut)
        assert len(one) == len(other) > 0
        for a, b in zip(one, other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_packed_row_keeps_its_sequences_apart(kind):
    """Positions restart and attention stays within each sequence: each sequence's logprobs equal its
    own forward's; the same tokens read as one sequence differ (so the comparison can fail)."""
    policy = HFPolicy(tiny_hf_model(kind))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 1, 14, 5)]
    cu = torch.tensor([0, 9, 10, 24, 29])
    with torch.no_grad():
        packed = policy(torch.cat(seqs)[None], cu_seqlens=cu).token_logprobs[0]
        alone = torch.cat([policy(s[None]).token_logprobs[0] for s in seqs])
        one = policy(torch.cat(seqs)[None]).token_logprobs[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    assert (one - alone).abs().max() > 1e-2


def test_a_long_tail_row_attends_its_short_sequences_at_their_own_lengths(monkeypatch):
    """Packed attention runs batches of like lengths: one 200-token sequence beside twenty short ones
    costs at most max(PAD_SLACK x, x + PAD_ALLOWANCE) query slots per sequence of x tokens, per layer
    (all padded to 200: ~10x)."""
    policy = HFPolicy(tiny_hf_model("llama"))
    lengths = [200] + [3 + (5 * i) % 17 for i in range(20)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    slots = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *args, **kw):
        slots.append(q.shape[0] * q.shape[2])
        return sdpa(q, *args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        packed = policy(ids, cu_seqlens=cu).token_logprobs[0]
    monkeypatch.undo()
    with torch.no_grad():
        bounds = cu.tolist()
        alone = torch.cat([policy(ids[:, a:b]).token_logprobs[0] for a, b in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
    per_layer = sum(slots) / policy.config.num_hidden_layers
    assert per_layer <= sum(max(PAD_SLACK * n, n + PAD_ALLOWANCE) for n in lengths), (per_layer, sum(lengths))


def test_a_model_with_recurrent_layers_refuses_a_packed_row():
    policy = HFPolicy(tiny_hf_model("qwen3_next"))
    assert not policy.packs_rows
    with pytest.raises(ValueError, match="train it on padded rows"):
        policy(torch.ones(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 2, 4]))


def test_checkpoint_names_are_the_saved_ones(tmp_path):
    from safetensors.torch import load_file

    policy = HFPolicy.from_pretrained(save_tiny("qwen3_moe", tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in policy.state_dict())  # fused at runtime
    named = checkpoint_state_dict(policy.state_dict(), policy.config)
    assert sorted(named) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(named[k], v), k


def test_build_policy_serves_both_kinds(tmp_path):
    hf = build_policy({"hf_path": str(save_tiny("llama", tmp_path))})
    assert isinstance(hf, HFPolicy) and next(hf.parameters()).dtype == torch.float32
    ours = build_policy({"preset": "toy", "overrides": {"vocab_size": 320}})
    ids = torch.randint(0, 256, (1, 5))
    for model in (hf, ours):
        assert model(ids, return_token_logprobs=True, logit_scale=1.0).token_logprobs.shape == (1, 5)
    with pytest.raises(ValueError, match="neither a preset nor an hf_path"):
        build_policy({})
    with pytest.raises(ValueError, match="routing replay"):
        hf(ids, routing=torch.zeros(1, 5, 1, 1, dtype=torch.long))


def test_activation_checkpointing_keeps_the_gradient_and_stores_less():
    policy = HFPolicy(tiny_hf_model("llama")).train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))

    def step() -> tuple[int, list[torch.Tensor]]:
        stored = 0

        def pack(t: torch.Tensor) -> torch.Tensor:  # bytes kept for backward outside checkpointed layers
            nonlocal stored
            stored += t.numel() * t.element_size()
            return t

        policy.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = policy(ids).token_logprobs.sum()
        loss.backward()
        return stored, [p.grad.clone() for p in policy.parameters()]

    stored, grads = step()
    policy.set_activation_checkpointing(True)
    stored_ckpt, grads_ckpt = step()
    assert stored_ckpt < stored
    for a, b in zip(grads, grads_ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
