"""Where an episode's wall time went: the rollout worker times each episode's start, generation, tool
steps and grading (Sample.phase_s), and the rollout metrics average them per episode."""
from __future__ import annotations

import asyncio
import time

import pytest

from envs.grades import Grade
from policy import Tokenizer
from rl.metrics import rollout_metrics
from rl.rollout.engine_api import RolloutEngine, SamplingParams, SequenceRecord, TurnOutput
from rl.rollout.env_worker import EpisodeEnd, EpisodeStart, StepReply
from rl.rollout.worker import RolloutWorker
from rl.types import WorkItem

GENERATE_S, STEP_S, RESET_S, GRADE_S, TURNS = 0.03, 0.05, 0.04, 0.02, 3


class SlowEngine(RolloutEngine):
    name = "slow"

    def __init__(self) -> None:
        self.version = 0

    async def start_group(self, seq_ids, prompt):
        return None

    async def generate(self, seq_id, append, params: SamplingParams):
        await asyncio.sleep(GENERATE_S)
        return TurnOutput([40, 41], [-0.5, -0.5], [0, 0], stopped=True)

    async def finish(self, seq_id):
        return SequenceRecord(fed_tokens=0)

    async def update_weights(self, weights, version):
        self.version = version


class _Slow:
    """An actor method answering after `seconds`."""

    def __init__(self, seconds: float, fn) -> None:
        self.seconds, self.fn = seconds, fn

    def remote(self, *args):
        async def answer():
            await asyncio.sleep(self.seconds)
            return self.fn(*args)

        return asyncio.ensure_future(answer())


class SlowEnv:
    """TURNS tool steps, then done; every call takes its time."""

    def __init__(self) -> None:
        self.turns: dict[str, int] = {}
        self.reset_group = _Slow(RESET_S, lambda item, ids: EpisodeStart([{"role": "user", "content": "q"}], "d", 9))
        self.step = _Slow(STEP_S, self._step)
        self.finish = _Slow(GRADE_S, lambda sid: EpisodeEnd(Grade(1.0, True, "1")))
        self.abort = _Slow(0.0, lambda prefix: 0)

    def _step(self, sid: str, text: str) -> StepReply:
        self.turns[sid] = self.turns.get(sid, 0) + 1
        done = self.turns[sid] >= TURNS
        return StepReply(None if done else "output", done, False)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["output", "hello world"] * 10, vocab_size=300)


def test_each_phase_of_an_episode_is_timed_and_averaged_per_episode(tokenizer):
    w = RolloutWorker.__new__(RolloutWorker)  # the actor's logic, without Ray
    w.tokenizer, w._engine, w.env_workers, w.max_context = tokenizer, SlowEngine(), [SlowEnv()], 200
    w.stop_ids, w.context_policy, w.keep_tool_outputs = frozenset({tokenizer.eos_id}), "none", 1
    item = WorkItem(uid="g1", env="shell", task_id="t", effort="low", group_size=2, seed=3, max_new_tokens=6,
                    temperature=1.0, top_p=1.0)
    began = time.monotonic()
    samples = asyncio.run(w.run_group(item))
    wall = time.monotonic() - began
    assert len(samples) == 2
    for s in samples:
        phases = s.phase_s
        assert set(phases) == {"start", "generate", "tools", "grade"}
        # every awaited call counts in its phase (sleeps give lower bounds), and the phases are
        # disjoint parts of the episode, so together no longer than the group took
        assert phases["start"] >= RESET_S and phases["generate"] >= TURNS * GENERATE_S
        assert phases["tools"] >= TURNS * STEP_S and phases["grade"] >= GRADE_S
        assert sum(phases.values()) <= wall
    # the members ran side by side: the group took about one episode's time, not two
    assert wall < 2 * TURNS * (GENERATE_S + STEP_S)
    metrics = rollout_metrics(samples, 0)
    for phase in ("start", "generate", "tools", "grade"):
        mean = sum(s.phase_s[phase] for s in samples) / 2
        assert metrics[f"rollout/episode_s/{phase}"] == pytest.approx(mean)
        assert metrics[f"rollout/domain/d/episode_s/{phase}"] == pytest.approx(mean)


def test_an_episode_in_segments_counts_its_time_once():
    from rl.types import Sample

    def sample(uid: str, phase_s: dict[str, float]) -> Sample:
        return Sample(uid=uid, group_uid="g", env="e", domain="d", task_id="t", effort="low", tokens=[1, 2],
                      loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], token_versions=[-1, 0], phase_s=phase_s)

    long_episode = {"start": 1.0, "generate": 4.0, "tools": 2.0, "grade": 0.5}
    short_episode = {"start": 1.0, "generate": 2.0, "tools": 0.0, "grade": 0.5}
    samples = [sample("g/0", long_episode), sample("g/0@1", long_episode), sample("g/1", short_episode)]
    metrics = rollout_metrics(samples, 0)
    assert metrics["rollout/episodes"] == 2
    assert metrics["rollout/episode_s/generate"] == pytest.approx(3.0)  # (4 + 2) / 2, the segments once
    assert metrics["rollout/episode_s/tools"] == pytest.approx(1.0)
