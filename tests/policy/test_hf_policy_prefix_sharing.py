"""HFPolicy runs a packed row's shared prefixes once (a GRPO group's prompt): the token logprobs, the
entropies and the GRPO gradient equal those of the unshared row, fewer tokens run through the model,
and what the tree shares is exactly what its neighbouring sequences begin with."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from policy import HFPolicy  # noqa: E402
from policy.hf_policy import shared_prefix_tree  # noqa: E402
from rl.config import TrainConfig  # noqa: E402
from rl.learner.batches import collate, rows_from_samples  # noqa: E402
from rl.learner.loss import accumulate_policy_gradient, compute_advantages, loss_normaliser  # noqa: E402
from tiny_hf_models import VOCAB, tiny_hf_model  # noqa: E402


def _row(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A packed row: a lone sequence, a group of 6 sharing a 12-token prompt (one of them shorter
    than the prompt, one ending a token after it), and a pair sharing 9 tokens."""
    prompt = torch.randint(3, VOCAB, (12,), generator=g)
    other = torch.randint(3, VOCAB, (9,), generator=g)
    seqs = [torch.randint(3, VOCAB, (7,), generator=g)]
    seqs += [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (5, 1, 9, 3)]
    seqs += [prompt[:10].clone(), torch.cat([prompt, torch.tensor([5, 6])])]
    seqs += [torch.cat([other, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (4, 2)]
    lengths = [len(s) for s in seqs]
    return torch.cat(seqs)[None], torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()]), lengths


def test_the_tree_holds_each_shared_prefix_once():
    ids, cu, lengths = _row(torch.Generator().manual_seed(0))
    tree = shared_prefix_tree(ids[0], cu)
    # the group shares 9 tokens (its 10-token member keeps its last one), the pair 9
    assert tree.ids.numel() == sum(lengths) - 5 * 9 - 1 * 9
    torch.testing.assert_close(tree.ids[tree.to_tree], ids[0])  # every token stands for itself
    starts = cu[:-1].tolist()
    for n, (a, b) in enumerate(zip(starts, cu[1:].tolist())):
        assert tree.positions[tree.to_tree[a:b]].tolist() == list(range(b - a))
        assert tree.index[n, :b - a].tolist() == tree.to_tree[a:b].tolist()
    owners = tree.index[tree.owned]
    assert sorted(owners.tolist()) == list(range(tree.ids.numel()))  # each tree token has one owner
    assert shared_prefix_tree(ids[0, :7], torch.tensor([0, 7])) is None
    # shorter common prefixes than the minimum are not shared
    assert shared_prefix_tree(ids[0], cu, min_shared=13) is None


def test_groups_behind_one_system_prompt_each_hold_their_whole_prompt_once():
    """GRPO groups whose prompts begin with the same system prompt: each group shares its whole prompt
    (one run sharing only the system prompt saved 5 x 10 tokens here instead of 2 x 2 x 30)."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, VOCAB, (10,), generator=g)
    prompts = [torch.cat([system, torch.randint(3, VOCAB, (20,), generator=g)]) for _ in range(2)]
    seqs = [torch.cat([p, torch.randint(3, VOCAB, (n,), generator=g)]) for p in prompts for n in (3, 5, 4)]
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    ids = torch.cat(seqs)
    tree = shared_prefix_tree(ids, cu)
    assert tree.ids.numel() == sum(lengths) - 2 * 2 * 30
    torch.testing.assert_close(tree.ids[tree.to_tree], ids)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_shared_prefixes_give_the_unshared_logprobs_and_gradient(kind):
    ids, cu, lengths = _row(torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, 20:30] = False  # positions without a logprob stay 0 in both
    results = {}
    for share in (False, True):
        policy = HFPolicy(tiny_hf_model(kind), share_prefixes=share)
        out = policy(ids, cu_seqlens=cu, logit_scale=1 / 0.7, token_mask=mask)
        weight = torch.randn(out.token_logprobs.shape, generator=torch.Generator().manual_seed(2))
        (out.token_logprobs * weight).sum().backward()
        results[share] = (out.token_logprobs.detach(), out.token_entropy, policy.forwarded_tokens,
                          [p.grad for p in policy.parameters()])
    (lp, ent, n, grads), (lp2, ent2, n2, grads2) = results[False], results[True]
    assert n == sum(lengths) and n2 == sum(lengths) - 54
    assert torch.all(lp2[0, 20:30] == 0) and float(lp.abs().max()) > 0.1
    torch.testing.assert_close(lp2, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent2, ent, atol=1e-4, rtol=0)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))


def test_the_grpo_gradient_of_groups_does_not_change_with_prefix_sharing():
    from rl.types import Sample

    g = torch.Generator().manual_seed(3)
    samples = []
    for group in range(3):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(9, 16, (1,), generator=g)),), generator=g).tolist()
        for m in range(4):
            n = int(torch.randint(1, 8, (1,), generator=g))
            samples.append(Sample(
                uid=f"g{group}/{m}", group_uid=f"g{group}", env="e", domain="d", task_id="t", effort="low",
                tokens=prompt + torch.randint(3, VOCAB, (n,), generator=g).tolist(),
                loss_mask=[0] * len(prompt) + [1] * n,
                behavior_logprobs=[0.0] * len(prompt) + (-torch.rand(n, generator=g) * 3).tolist(),
                token_versions=[-1] * len(prompt) + [0] * n, reward=float(m % 2)))
    rows = rows_from_samples(samples, compute_advantages([s.reward for s in samples], [s.group_uid for s in samples]))
    cfg = TrainConfig()

    def grads(share: bool) -> list[torch.Tensor]:
        policy = HFPolicy(tiny_hf_model("llama"), share_prefixes=share)
        accumulate_policy_gradient(policy, [collate(rows, 0, True)], cfg, loss_normaliser(rows, cfg, 16))
        return [p.grad for p in policy.parameters()]

    plain, shared = grads(False), grads(True)
    scale = max(float(x.abs().max()) for x in plain)
    assert scale > 0
    for a, b in zip(plain, shared):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * scale)


def test_only_the_targets_run_through_the_head_and_their_logprobs_are_unchanged(monkeypatch):
    """target_mask (the learner passes its loss mask): a prompt's tokens need no logprob, so only the
    targets' rows reach the head; their logprobs and entropies are those of a forward without it, the
    others are 0. Our hybrid model takes the same mask (its head runs on every row) with the same result."""
    import policy.hf_policy as hf_policy
    from policy import build_model

    ids, cu, lengths = _row(torch.Generator().manual_seed(3))
    target = torch.zeros_like(ids, dtype=torch.bool)
    for a, n in zip(cu[:-1].tolist(), lengths):
        target[0, a + n // 2:a + n] = True  # each sequence's second half: its "completion"
    headed = []
    real_head = hf_policy.linear_token_logprobs
    monkeypatch.setattr(hf_policy, "linear_token_logprobs",
                        lambda h, *a, **k: headed.append(h.shape[0]) or real_head(h, *a, **k))
    policy = HFPolicy(tiny_hf_model("llama"))
    every = policy(ids, cu_seqlens=cu)
    some = policy(ids, cu_seqlens=cu, target_mask=target)
    assert headed[1] < headed[0] and headed[1] <= int(target.sum())
    for name in ("token_logprobs", "token_entropy"):
        full, part = getattr(every, name), getattr(some, name)
        torch.testing.assert_close(part[target], full[target])
        assert not part[~target].any()
    hybrid = build_model("toy", vocab_size=VOCAB).eval()
    with torch.no_grad():
        full = hybrid(ids, cu_seqlens=cu, return_token_logprobs=True).token_logprobs
        part = hybrid(ids, cu_seqlens=cu, return_token_logprobs=True, target_mask=target).token_logprobs
    torch.testing.assert_close(part[target], full[target])
    assert not part[~target].any()
