"""train.cpu_matmul_dtype=bfloat16: a Hugging Face policy's decoder runs its matrix products under CPU
autocast while its weights, gradients and head stay float32 — the token logprobs are the float32 head's
on the bf16 body's hidden states, and the gradient is float32 and close to the float32 one."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from policy import HFPolicy, build_policy  # noqa: E402
from rl.config import TrainConfig  # noqa: E402
from rl.learner.learner import set_cpu_matmul_dtype  # noqa: E402
from tests.rl.test_rl_rollout_engine import TOY  # noqa: E402
from tiny_hf_models import VOCAB, tiny_hf_model  # noqa: E402


def _packed_row(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = torch.randint(3, VOCAB, (10,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(3, VOCAB, (n,), generator=g)]) for n in (6, 3, 8)]
    seqs.append(torch.randint(3, VOCAB, (9,), generator=g))
    lengths = torch.tensor([len(s) for s in seqs])
    return torch.cat(seqs)[None], torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def test_the_bf16_body_keeps_float32_weights_gradients_and_head():
    ids, cu = _packed_row(torch.Generator().manual_seed(0))
    exact = HFPolicy(tiny_hf_model("llama"))
    mixed = copy.deepcopy(exact)
    mixed.set_body_dtype(torch.bfloat16)
    outs, grads = [], []
    for policy in (exact, mixed):
        out = policy(ids, cu_seqlens=cu, logit_scale=1 / 0.7)
        (out.token_logprobs * torch.linspace(-1, 1, ids.shape[1])).sum().backward()
        outs.append(out.token_logprobs.detach())
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in policy.parameters())
    assert not torch.equal(outs[0], outs[1])  # the body did run in bf16
    torch.testing.assert_close(outs[1], outs[0], rtol=0.03, atol=0.02)  # bf16 rounding of the body
    assert F.cosine_similarity(grads[0], grads[1], dim=0) > 0.99

    # the head is float32: the logprobs are log_softmax of the float32 head on the body's hidden states
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = mixed.hf.base_model(input_ids=ids[:, :16]).last_hidden_state
    logits = (h.double() @ mixed.lm_head.weight.double().t()) / 0.7
    want = torch.log_softmax(logits, -1)[0, :-1].gather(1, ids[0, 1:16, None]).squeeze(1)
    got = mixed(ids[:, :16], logit_scale=1 / 0.7).token_logprobs[0, 1:]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_the_learner_sets_the_body_dtype_or_says_it_cannot():
    policy, reference = HFPolicy(tiny_hf_model("llama")), HFPolicy(tiny_hf_model("llama"))
    cpu = torch.device("cpu")
    assert set_cpu_matmul_dtype([policy, None], "float32", cpu) is None and policy.body_dtype is None
    assert set_cpu_matmul_dtype([policy], "bfloat16", torch.device("cuda")) is None and policy.body_dtype is None
    assert set_cpu_matmul_dtype([policy, reference], "bfloat16", cpu) is None
    assert policy.body_dtype == reference.body_dtype == torch.bfloat16  # the KL reference runs as the policy
    toy = build_policy(TOY)
    note = set_cpu_matmul_dtype([toy, None], "bfloat16", cpu)
    assert "cpu_matmul_dtype=bfloat16 applies to Hugging Face policies" in note and "trains in float32" in note
    assert TrainConfig().cpu_matmul_dtype == "float32"
    with pytest.raises(ValueError, match="cpu_matmul_dtype"):
        TrainConfig(cpu_matmul_dtype="float16")
