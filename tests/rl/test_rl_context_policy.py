"""The context policy for long agentic episodes: when the next turn would not fit rollout.max_context,
the episode continues in a new segment whose context elides old tool outputs; each segment trains on
the tokens generated in it, and the episode counts once in advantages and metrics."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from envs.grades import Grade
from policy import Tokenizer
from rl.config import RolloutConfig
from rl.learner.loss import compute_advantages
from rl.metrics import rollout_metrics
from rl.rollout.context import ELIDED, Turn, elide_tool_outputs
from rl.rollout.engine_api import RolloutEngine, SamplingParams, SequenceRecord, TurnOutput
from rl.rollout.env_worker import EpisodeEnd, EpisodeStart, StepReply
from rl.rollout.worker import RolloutWorker
from rl.types import WorkItem
from fake_remote import LocalCall

ACTION = [40, 41, 42, 43, 44, 45]  # one scripted assistant turn


class ScriptedEngine(RolloutEngine):
    """Every turn generates ACTION; records the contexts sequences were opened with."""

    name = "scripted"

    def __init__(self) -> None:
        self.version = 0
        self.opened: dict[str, list[int]] = {}
        self.generated = 0

    async def start_group(self, seq_ids, prompt):
        for sid in seq_ids:
            self.opened[sid] = list(prompt)

    async def generate(self, seq_id, append, params: SamplingParams):
        assert seq_id in self.opened
        n = min(len(ACTION), params.max_new_tokens)
        self.generated += n
        return TurnOutput(ACTION[:n], [-0.5] * n, [self.version] * n, stopped=n == len(ACTION))

    async def finish(self, seq_id):
        return SequenceRecord(fed_tokens=0)

    async def update_weights(self, weights, version):
        self.version = version


class ToolHeavyEnv:
    """Five tool turns, each answered with a long output, then done."""

    def __init__(self) -> None:
        self.turns = 0
        self.step = LocalCall(self._step)
        self.finish = LocalCall(lambda sid: EpisodeEnd(Grade(1.0, True, "1"), [{"role": "user", "content": "q"}]))
        self.abort = LocalCall(lambda prefix: 0)

    def _step(self, sid: str, text: str) -> StepReply:
        self.turns += 1
        done = self.turns >= 5
        return StepReply(None if done else "output line " * 8, done, False)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["output line " * 8, ELIDED, "hello world"] * 10, vocab_size=300)


def worker(tokenizer, policy: str, max_context: int) -> RolloutWorker:
    w = RolloutWorker.__new__(RolloutWorker)  # the actor's logic, without Ray
    cfg = RolloutConfig(max_context=max_context, context_policy=policy, keep_tool_outputs=1)
    w.tokenizer, w._engine, w.max_context = tokenizer, ScriptedEngine(), cfg.max_context
    w.stop_ids = frozenset({tokenizer.eos_id})
    w.context_policy, w.keep_tool_outputs = cfg.context_policy, cfg.keep_tool_outputs
    w.elided = tokenizer.encode_tool_result(ELIDED)
    return w


def play(w: RolloutWorker, prompt: list[int]):
    item = WorkItem(uid="g1", env="shell", task_id="t", effort="low", group_size=1, seed=3, max_new_tokens=30,
                    temperature=1.0, top_p=1.0)
    start = EpisodeStart([{"role": "user", "content": "q"}], "agentic_shell", max_turns=5)

    async def go():
        await w.engine.start_group(["g1/0"], prompt)
        return await w._episode(item, 0, "g1/0", prompt, start, ToolHeavyEnv(), ["g1/0"])

    return asyncio.run(go())


def test_elision_keeps_the_policys_tokens_and_the_last_outputs():
    turns = [Turn([1, 2], [10, 11, 12]), Turn([3], [13, 14]), Turn([4, 5], [15])]
    assert elide_tool_outputs([0], turns, [99], keep_last=1) == [0, 1, 2, 99, 3, 99, 4, 5, 15]
    assert elide_tool_outputs([0], turns, [99], keep_last=2) == [0, 1, 2, 99, 3, 13, 14, 4, 5, 15]


def test_a_long_episode_continues_in_segments_instead_of_being_cut(tokenizer):
    prompt = list(range(50, 70))
    without = play(worker(tokenizer, "none", max_context=90), prompt)
    assert len(without) == 1 and without[0].truncated and without[0].num_turns < 5
    w = worker(tokenizer, "elide_tool_outputs", max_context=90)
    segments = play(w, prompt)
    assert len(segments) > 1 and not segments[-1].truncated and segments[0].num_turns == 5
    assert [s.uid for s in segments] == ["g1/0"] + [f"g1/0@{k}" for k in range(1, len(segments))]
    assert all(len(s.tokens) <= 90 for s in segments)
    generated = sum(s.response_tokens for s in segments)
    assert generated == w.engine.generated  # every generated token is trained exactly once
    second = segments[1]
    assert w.engine.opened["g1/0@1"] == second.tokens[:len(w.engine.opened["g1/0@1"])]
    context = w.engine.opened["g1/0@1"]
    assert context[:len(prompt)] == prompt and ACTION == context[len(prompt):len(prompt) + len(ACTION)]
    assert w.elided == context[len(prompt) + len(ACTION):len(prompt) + len(ACTION) + len(w.elided)]
    assert all(s.reward == 1.0 for s in segments)
    # each episode counts once: in advantages and in the rollout metrics
    adv = compute_advantages([1.0] * len(segments) + [0.0], ["g"] * (len(segments) + 1), "none",
                             episode_keys=[s.episode for s in segments] + ["g1/1"])
    np.testing.assert_allclose(adv, [0.5] * len(segments) + [-0.5])
    metrics = rollout_metrics(segments, 0)
    assert metrics["rollout/episodes"] == 1 and metrics["rollout/response_tokens"] == generated
