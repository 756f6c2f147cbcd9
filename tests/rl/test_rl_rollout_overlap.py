"""The native engine with `overlap` (each step launched before the last one's tokens are read back,
sequences decoding their sampled tokens straight from the device): the same tokens, logprobs,
versions and routing as stepping in order, through forks, preemption, turns that end on a stop and
weight updates. On a CPU the steps still run in order; the bookkeeping is the GPU's."""
from __future__ import annotations

import asyncio

import pytest
import torch

from rl.config import RolloutConfig
from rl.rollout.engine_api import SamplingParams
from rl.rollout.native_engine import NativeEngine
from rl.rollout.worker import build_engine
from tests.rl.test_rl_rollout_engine import (TOY, assert_matches_learner_forward, engine, model, play,  # noqa: F401
                                             prompts, tokens_of, turn_with_weights_updated_mid_way)


def assert_same_rollouts(inorder: dict, overlapped: dict) -> None:
    assert tokens_of(overlapped) == tokens_of(inorder)
    for sid in inorder:
        for x, y in zip(inorder[sid][:-1], overlapped[sid][:-1]):
            torch.testing.assert_close(torch.tensor(y[1]), torch.tensor(x[1]), atol=1e-4, rtol=0)
            assert y[2] == x[2]  # the weight versions
        a, b = inorder[sid][-1], overlapped[sid][-1]
        # a turn that ended on a stop had its stop token fed by the step after it: one more fed token
        assert b.fed_tokens in (a.fed_tokens, a.fed_tokens + 1)
        assert (b.routing[:a.fed_tokens] == a.routing).all() and b.routing.shape[0] == b.fed_tokens


@pytest.mark.parametrize("fixed_shapes", [False, True])
@pytest.mark.parametrize("greedy", [True, False])
def test_overlapped_steps_give_the_rollouts_of_steps_in_order(model, fixed_shapes, greedy):
    groups = prompts(4)  # 4 groups of 3: forked prompts, tool results between turns, stops and budgets
    kw = dict(max_slots=16, cache_tokens=4096, decode_graphs=fixed_shapes)
    inorder = asyncio.run(play(engine(model, overlap=False, **kw), groups, greedy=greedy))
    over = engine(model, overlap=True, **kw)
    overlapped = asyncio.run(play(over, groups, greedy=greedy))
    assert_same_rollouts(inorder, overlapped)
    assert over._pending is None and all(s.inflight == 0 for s in over.seqs.values())
    # most tokens were decoded from the device before the host read them
    assert over.stats().extra["fed_unread"] > 0.5 * over.stats().generated_tokens


def test_overlap_under_preemption_gives_the_same_tokens(model):
    groups = prompts(3, size=2)
    roomy = asyncio.run(play(engine(model, max_slots=8, cache_tokens=4096), groups, greedy=True))
    tight = engine(model, max_slots=8, cache_tokens=112, block_size=8, overlap=True, decode_graphs=True)
    squeezed = asyncio.run(play(tight, groups, greedy=True))
    assert tight.stats().extra.get("preempted", 0) > 0
    assert tokens_of(squeezed) == tokens_of(roomy)


def test_a_turn_after_a_stop_with_nothing_appended_continues_as_in_order(model):
    """A turn that ended on a stop had the stop fed (and the token after it dropped); a next turn
    with nothing to append has no logits to continue from: the sequence is rebuilt, same tokens."""

    stops = frozenset(range(100, 200))  # a third of the toy vocabulary: turns end on a stop often

    async def run(e: NativeEngine) -> list[list[int]]:
        await e.start_group(["s"], list(range(40, 52)))
        turns = []
        for _ in range(6):
            p = SamplingParams(max_new_tokens=12, temperature=1.0, stop_ids=stops, seed=11)
            turns.append((await e.generate("s", [], p)).tokens)
        await e.finish("s")
        return turns

    inorder = asyncio.run(run(engine(model, overlap=False)))
    over = engine(model, overlap=True)
    assert asyncio.run(run(over)) == inorder
    stopped = sum(1 for turn in inorder[:-1] if turn[-1] in stops)
    assert stopped > 0 and over.stats().extra.get("recomputed", 0) == stopped


def test_overlapped_logprobs_and_routing_match_a_fresh_learner_forward(model):
    e = engine(model, max_slots=8, cache_tokens=4096, overlap=True, decode_graphs=True)
    result = asyncio.run(play(e, prompts(2), turns=3))
    # a last turn that ended on a stop had the stop fed too
    assert_matches_learner_forward(model, result, prompts(2), fed_beyond=(0, 1))


def test_weights_updated_between_overlapped_steps_label_tokens_by_the_weights_that_sampled_them(model):
    out = turn_with_weights_updated_mid_way(model, 200, overlap=True, decode_graphs=True)
    assert out.versions == sorted(out.versions) and out.versions[0] == 3 and out.versions[-1] == 4
    assert len(out.tokens) == 200
    # the same stream under the same switch point, stepping in order: the tokens after it differ only
    # by the weights, so the count of old-version tokens is all that is compared
    assert 5 <= out.versions.count(3) < 200


def test_overlap_is_the_gpu_default_and_a_config_switch(model):
    assert engine(model).overlap is False  # on a CPU nothing runs beside the host
    assert engine(model, overlap=True).overlap is True
    assert RolloutConfig().overlap_decode is True
    assert build_engine(TOY, RolloutConfig(overlap_decode=True), seed=0).overlap is False  # a CPU worker
