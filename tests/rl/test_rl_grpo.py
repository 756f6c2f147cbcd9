"""GRPO numerics: advantages by (prompt, effort) group, the gradient independent of how a mini-batch is
cut (micro-batches, packed or padded rows), behaviour anchoring, off-policy corrections."""
import numpy as np
import pytest
import torch

from rl.config import TrainConfig
from rl.learner.batches import MicroBatch, collate, plan_packed, plan_padded, rows_from_samples
from rl.learner.loss import accumulate_policy_gradient, compute_advantages, grpo_token_losses, loss_normaliser
from rl.types import Sample

OFF_POLICY = {"proximal", "is_correction", "is_level", "is_cap", "is_band"}


def train_cfg(**kw) -> TrainConfig:
    """A validated train config; off-policy keys go to its off_policy section."""
    off = {k: kw.pop(k) for k in list(kw) if k in OFF_POLICY}
    return TrainConfig(**kw, off_policy=off)


def hand_batch(behaviour, prox=None, adv=1.0, logp_shape=None) -> MicroBatch:
    """Right-padded rows with every token real and a target (hand-built tensors)."""
    b, t = behaviour.shape
    segments = torch.arange(b)[:, None].expand(b, t).clone()
    return MicroBatch(torch.zeros(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.bool), segments,
                      torch.ones(b, t), torch.as_tensor(adv, dtype=torch.float32).expand(b, t).clone(), behaviour,
                      None, ("d",) * b, prox_logprobs=prox)


def test_advantages_are_relative_to_the_prompt_effort_group():
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # Same prompt at two effort levels: two groups, each normalised on its own.
    keys = [("p1", "low"), ("p1", "low"), ("p1", "high"), ("p1", "high"), ("p1", "high"), ("p1", "high")]
    adv = compute_advantages(rewards, keys, "none")
    np.testing.assert_allclose(adv, [0.5, -0.5, 0.5, 0.5, -0.5, -0.5])
    grouped = compute_advantages(rewards, keys, "group")
    np.testing.assert_allclose(grouped[:2], [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)], atol=1e-5)  # ddof 1
    assert compute_advantages([1.0, 1.0], ["a", "a"], "group").tolist() == [0.0, 0.0]
    batch = compute_advantages(rewards, keys, "batch")
    assert batch.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def _samples(vocab: int, n: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(6, 14))
        prompt = int(rng.integers(2, length - 2))
        tokens = rng.integers(0, vocab, length).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        logp = [0.0] * prompt + (-rng.random(length - prompt) * 3).tolist()
        out.append(Sample(uid=f"s{i}", group_uid=f"g{i // 4}", env="e", domain="d", task_id="t", effort="low",
                          tokens=tokens, loss_mask=mask, behavior_logprobs=logp,
                          token_versions=[-1] * prompt + [0] * (length - prompt),
                          reward=float(rng.random())))
    return out


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_sum"])
def test_the_gradient_does_not_depend_on_how_the_mini_batch_is_cut(loss_agg):
    """One padded micro-batch, four padded ones, packed rows at several token budgets: one gradient."""
    from policy import build_model

    torch.manual_seed(0)
    model = build_model("toy", vocab_size=320).double()
    samples = _samples(320, 8)
    adv = compute_advantages([s.reward for s in samples], [s.group_uid for s in samples])
    rows = rows_from_samples(samples, adv)
    cfg = train_cfg(loss_agg=loss_agg)
    normaliser = loss_normaliser(rows, cfg, 16)

    def grads(packed: bool, cut: int) -> list[torch.Tensor]:
        plan = plan_packed([len(r.tokens) for r in rows], 1, cut) if packed else plan_padded(len(rows), 1, cut)
        micro = [collate([rows[i] for i in part], 0, packed) for part in plan[0]]
        for mb in micro:
            mb.behavior_logprobs, mb.advantages, mb.loss_mask = (t.double() for t in (
                mb.behavior_logprobs, mb.advantages, mb.loss_mask))
        model.zero_grad()
        accumulate_policy_gradient(model, micro, cfg, normaliser)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    one = grads(False, 1)
    scale = max(float(g.abs().max()) for g in one)
    for packed, cut in ((False, 4), (True, 16), (True, 40), (True, 1000)):
        other = grads(packed, cut)
        assert len(one) == len(other) > 0
        # the router scores in float32 even in a float64 model; a normalisation bug differs by tens of
        # percent, a sequence leaking into another by far more than 1e-5
        for a, b in zip(one, other):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * scale)


def test_the_normaliser_is_the_whole_mini_batch_s():
    """Dr.GRPO's divisor counts the mini-batch's sequences, never a rank's share or its inert
    placeholder (2 rows over 4 ranks used to give 4 sequences of which 2 were placeholders)."""
    samples = _samples(320, 2)
    rows = rows_from_samples(samples, [1.0, -1.0])
    assert loss_normaliser(rows, train_cfg(loss_agg="seq_mean_token_sum"), 16) == 2 * 16
    assert loss_normaliser(rows, train_cfg(), 16) == sum(sum(s.loss_mask[1:]) for s in samples)
    plan = plan_packed([len(r.tokens) for r in rows], 4, 64)
    assert sorted(len(p) for p in plan) == [1, 1, 1, 1] and sum(bool(p[0]) for p in plan) == 2
    inert = collate([], 0, True)
    assert inert.sequences == 0 and not inert.token_mask.any() and not inert.loss_mask.any()


def test_ratio_is_anchored_on_behaviour_logprobs_and_clipped():
    logp = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[0.0, -1.0, -2.0, -0.5]])  # ratios 1, e, e^-0.5
    batch = hand_batch(behaviour)
    losses, stats = grpo_token_losses(logp, batch, train_cfg(eps_low=0.2, eps_high=0.28, dual_clip=None))
    ratio = stats["ratio"][0]
    torch.testing.assert_close(ratio, torch.exp(logp - behaviour)[0])
    # A > 0: the objective is clipped at 1 + eps_high for the token whose ratio is e.
    assert losses[0, 2].item() == pytest.approx(-1.28)
    assert losses[0, 1].item() == pytest.approx(-1.0)
    neg = hand_batch(torch.tensor([[0.0, -1.0, -9.0, -0.5]]), adv=-1.0)
    capped, _ = grpo_token_losses(logp, neg, train_cfg(dual_clip=3.0))
    assert capped[0, 2].item() == pytest.approx(3.0)  # ratio e^8 is capped by the dual clip


def test_kl_term_has_the_unbiased_gradient():
    """d/dθ of ratio*k3 at θ = θ_old equals the gradient of KL(π_θ || π_ref) for a categorical."""
    torch.manual_seed(0)
    logits = torch.randn(5, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5), -1)
    logp_all = torch.log_softmax(logits, -1)
    probs = logp_all.exp().detach()
    # Exact expectation over tokens drawn from π_old = π_θ (detached) of the per-token loss.
    tokens = torch.arange(5)
    behaviour = logp_all.detach()[tokens]
    batch = hand_batch(behaviour[:, None], adv=0.0)
    batch.ref_logprobs = ref[tokens][:, None]
    losses, _ = grpo_token_losses(logp_all[tokens][:, None], batch, train_cfg(kl_coef=1.0, dual_clip=None))
    (probs[:, None] * losses).sum().backward()
    expected_logits = logits.detach().clone().requires_grad_(True)
    lp = torch.log_softmax(expected_logits, -1)
    (lp.exp() * (lp - ref)).sum().backward()
    torch.testing.assert_close(logits.grad, expected_logits.grad, rtol=1e-5, atol=1e-6)


def test_group_std_is_the_unbiased_one():
    """verl and TRL divide by the sample standard deviation (ddof 1)."""
    adv = compute_advantages([1.0, 0.0, 0.0], ["g"] * 3, "group")
    centred = np.array([2 / 3, -1 / 3, -1 / 3])
    np.testing.assert_allclose(adv, centred / (np.std([1.0, 0.0, 0.0], ddof=1) + 1e-6))
    batch = compute_advantages([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"], "batch")
    assert batch.std(ddof=1) == pytest.approx(1.0, abs=1e-4)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_the_behaviour_ratio():
    behaviour = torch.tensor([[-1.0, -1.0, -1.0]])
    prox = torch.tensor([[-0.5, -1.0, -2.0]])  # w = e^0.5, 1, e^-1
    logp = torch.tensor([[-0.5, -0.5, -2.0]], requires_grad=True)  # r vs prox: 1, e^0.5 (clipped), 1
    cfg = train_cfg(proximal="learner", dual_clip=None, eps_high=0.28)
    losses, stats = grpo_token_losses(logp, hand_batch(behaviour, prox), cfg)
    w = torch.exp(prox - behaviour)[0]
    torch.testing.assert_close(stats["is_weight"][0], w)
    torch.testing.assert_close(losses[0].detach(), -w * torch.tensor([1.0, 1.28, 1.0]))
    losses.sum().backward()
    # the clipped token gives no gradient; the others -w * d ratio / d logp = -w * ratio
    torch.testing.assert_close(logp.grad[0], torch.stack([-w[0], torch.tensor(0.0), -w[2]]))


def test_truncated_importance_sampling_caps_token_and_sequence_weights():
    behaviour = torch.tensor([[-3.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    prox = torch.tensor([[-1.0, -1.0, -1.5], [-1.0, -0.9, -1.0]])  # token w: e^2, 1, e^-0.5 | 1, e^0.1, 1
    logp = prox.clone()
    tok = train_cfg(proximal="learner", is_correction="tis", is_cap=2.0, dual_clip=None)
    _, stats = grpo_token_losses(logp, hand_batch(behaviour, prox), tok)
    expected = torch.exp(prox - behaviour).clamp(max=2.0)
    torch.testing.assert_close(stats["is_weight"], expected)
    seq = train_cfg(proximal="learner", is_correction="tis", is_level="sequence", is_cap=2.0, dual_clip=None)
    _, stats = grpo_token_losses(logp, hand_batch(behaviour, prox), seq)
    per_seq = torch.exp((prox - behaviour).sum(-1)).clamp(max=2.0)  # e^1.5 -> 2, e^0.1
    torch.testing.assert_close(stats["is_weight"], per_seq[:, None].expand(2, 3))
    geo = train_cfg(proximal="learner", is_correction="tis", is_level="geometric", is_cap=2.0, dual_clip=None)
    _, stats = grpo_token_losses(logp, hand_batch(behaviour, prox), geo)
    torch.testing.assert_close(stats["is_weight"], torch.exp((prox - behaviour).mean(-1))[:, None].expand(2, 3))


def test_masked_importance_sampling_zeroes_tokens_outside_the_band():
    behaviour = torch.tensor([[-3.0, -1.0, -1.0]])
    prox = torch.tensor([[-1.0, -1.2, -1.0]])  # w = e^2 (out), e^-0.2 (in), 1 (in)
    cfg = train_cfg(proximal="learner", is_correction="mis", is_band=(0.5, 5.0), dual_clip=None)
    logp = prox.clone().requires_grad_(True)
    losses, stats = grpo_token_losses(logp, hand_batch(behaviour, prox), cfg)
    assert stats["is_masked"][0].tolist() == [1.0, 0.0, 0.0]
    losses.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    torch.testing.assert_close(stats["is_weight"][0, 1:], torch.exp(prox - behaviour)[0, 1:])


def test_corrections_need_the_learner_proximal_policy_in_the_config():
    from rl.config import ConfigError, validate

    with pytest.raises(ConfigError, match="needs proximal='learner'"):
        validate({"envs": [{"name": "math"}], "train": {"off_policy": {"is_correction": "tis"}}})
    with pytest.raises(ConfigError, match="top_p"):
        validate({"envs": [{"name": "math"}], "rollout": {"top_p": 0.9}})


def test_padding_and_unfed_tokens_never_count_in_the_moe_balancing_statistics():
    """The learner's update on right-padded and on packed micro-batches: the expert load counts the real
    tokens whose experts were recorded, once (the padding used to enter it as experts 0..k-1, and every
    step pushed those experts' bias down; the never-fed last token and an inert placeholder counted too)."""
    from policy import build_model

    samples = _samples(320, 4)
    probe = build_model("toy", vocab_size=320)
    shape = (len(probe.moe_layer_ids), probe.config.num_experts_per_token)
    for s in samples:  # recorded experts for every token but the last (never fed while sampling)
        s.routing = np.stack([np.arange(shape[1]) + i % 3 for i in range(len(s.tokens))] * shape[0], 1)
        s.routing = s.routing.reshape(len(s.tokens), *shape).astype(np.int16)
        s.routing[-1] = -1
    rows = rows_from_samples(samples, [1.0, -1.0, 1.0, -1.0])
    counted = sum(len(s.tokens) - 1 for s in samples) * shape[1]
    loads = []
    for packed, plan in ((False, plan_padded(4, 1, 2)), (True, plan_packed([len(r.tokens) for r in rows], 1, 20))):
        torch.manual_seed(0)
        model = build_model("toy", vocab_size=320).train()
        micro = [collate([rows[i] for i in part], 0, packed, shape) for part in plan[0]] + [collate([], 0, packed)]
        assert packed or sum(mb.input_ids.numel() for mb in micro) > sum(len(s.tokens) for s in samples) + 1
        accumulate_policy_gradient(model, micro, train_cfg(), loss_normaliser(rows, train_cfg(), 16))
        loads.append([layer.block_sparse_moe.load.clone() for layer in model.model.layers if layer.is_moe])
        assert all(load.sum().item() == counted for load in loads[-1])
    for padded, packed in zip(*loads):
        assert torch.equal(padded, packed)
