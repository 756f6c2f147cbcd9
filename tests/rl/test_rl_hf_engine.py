"""TransformersEngine (the slow baseline over transformers' generate) keeps the engine contract:
per-sequence seeds, stop ids, processed-distribution logprobs equal to the learner's, weight updates."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("transformers")

from policy import HFPolicy  # noqa: E402
from rl.rollout.engine_api import SamplingParams  # noqa: E402
from rl.rollout.hf_engine import TransformersEngine  # noqa: E402
from tiny_hf_models import tiny_hf_model  # noqa: E402

PROMPT = [1, 17, 33, 49, 65, 81]
STOP = frozenset({5, 9})


def test_turns_are_reproducible_and_logprobs_are_the_learners():
    engine = TransformersEngine(tiny_hf_model("llama"))

    async def go():
        await engine.start_group(["a", "b", "c"], PROMPT)
        p = lambda seed: SamplingParams(8, 0.7, 0.9, STOP, seed)  # noqa: E731
        first = await asyncio.gather(engine.generate("a", [], p(1)), engine.generate("b", [], p(1)),
                                     engine.generate("c", [], p(2)))
        second = await engine.generate("a", [40, 41], p(1))
        return first, second, await engine.finish("a")

    (a, b, c), a2, record = asyncio.run(go())
    assert a.tokens == b.tokens and a.logprobs == b.logprobs and c.tokens != a.tokens
    for out in (a, c, a2):
        assert out.stopped == (out.tokens[-1] in STOP) and (out.stopped or len(out.tokens) == 8)
        assert out.versions == [0] * len(out.tokens)
    tokens = PROMPT + a.tokens + [40, 41] + a2.tokens
    assert record.fed_tokens == len(tokens) - 1
    with torch.no_grad():
        learner = HFPolicy(engine.model)(torch.tensor([tokens]), logit_scale=1 / 0.7).token_logprobs[0]
    gen = [len(PROMPT) + i for i in range(len(a.tokens))] + \
          [len(PROMPT) + len(a.tokens) + 2 + i for i in range(len(a2.tokens))]
    # top-p renormalises over the nucleus: the processed logprob is >= the plain tempered one
    got = torch.tensor(a.logprobs + a2.logprobs)
    assert torch.all(got >= learner[gen] - 1e-5) and torch.all(got <= 0)
    full = TransformersEngine(engine.model)
    asyncio.run(full.start_group(["f"], PROMPT))
    plain = asyncio.run(full.generate("f", [], SamplingParams(8, 0.7, 1.0, frozenset(), 3)))
    with torch.no_grad():
        ref = HFPolicy(engine.model)(torch.tensor([PROMPT + plain.tokens]), logit_scale=1 / 0.7).token_logprobs[0]
    torch.testing.assert_close(torch.tensor(plain.logprobs), ref[len(PROMPT):], atol=1e-5, rtol=0)


def test_weight_update_changes_the_output():
    model = tiny_hf_model("llama")
    engine = TransformersEngine(model)
    new = {k: v * 1.5 if v.dim() >= 2 else v for k, v in HFPolicy(tiny_hf_model("llama")).state_dict().items()}

    async def go():
        await engine.start_group(["a", "b"], PROMPT)
        before = await engine.generate("a", [], SamplingParams(6, 1.0, 1.0, frozenset(), 4))
        await engine.update_weights(new, version=3)
        after = await engine.generate("b", [], SamplingParams(6, 1.0, 1.0, frozenset(), 4))
        return before, after

    before, after = asyncio.run(go())
    assert engine.version == 3 and after.versions == [3] * 6 and before.logprobs != after.logprobs
    with pytest.raises(KeyError):
        asyncio.run(engine.finish("zz"))


def test_an_update_may_leave_out_a_tied_weights_second_name_but_nothing_else():
    """A bucketed sync sends a tied weight once: the head tied to the embedding arrives as the
    embedding only. Any other tensor missing is refused with the names."""
    model = tiny_hf_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    engine = TransformersEngine(model)
    new = {k: v * 1.5 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    asyncio.run(engine.update_weights(new, version=2))
    assert engine.version == 2 and torch.equal(model.lm_head.weight, new["model.embed_tokens.weight"])
    del new["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        asyncio.run(engine.update_weights(new, version=3))
    assert engine.version == 2
