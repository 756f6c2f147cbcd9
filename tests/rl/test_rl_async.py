"""The scheduler's two modes on a simulated workload (episodes with a long tail of lengths, tokens
generated over time under whatever weights the worker holds): the staleness bound holds for every
trained sample, partial rollouts record each token's version, uniform groups are dropped and
refilled, nothing is trained twice."""
from __future__ import annotations

import asyncio
import random
import sys
import time

import pytest
from ray import cloudpickle

from rl.config import RolloutConfig
from rl.types import Sample, WorkItem

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import a test module

GROUP = 2
TICK_S = 0.002


def uniform(item: WorkItem) -> bool:
    return item.index % 3 == 0  # every third group's rewards all agree: dynamic sampling drops it


class SimulatedWorker:
    """A rollout worker whose episodes take a random (long-tailed) number of ticks; each generated
    token records the weights held when it was drawn."""

    def __init__(self, seed: int) -> None:
        self.version = -1
        self.rng = random.Random(seed)

    async def ping(self) -> int:
        return 1

    async def set_weights(self, state: dict, version: int) -> int:
        self.version = version
        return version

    async def run_group(self, item: WorkItem) -> list[Sample]:
        lengths = [min(400, int(self.rng.paretovariate(1.3) * 30)) for _ in range(item.group_size)]
        versions: list[list[int]] = [[] for _ in lengths]
        for tick in range(max(lengths)):
            for m, n in enumerate(lengths):
                if tick < n:
                    versions[m].append(self.version)
            await asyncio.sleep(TICK_S)
        out = []
        for m, vs in enumerate(versions):
            reward = 1.0 if uniform(item) else float(m % 2)
            out.append(Sample(uid=f"{item.uid}/{m}", group_uid=item.uid, env=item.env, domain=item.env,
                              task_id=item.task_id, effort=item.effort, tokens=[1] * (1 + len(vs)),
                              loss_mask=[0] + [1] * len(vs), behavior_logprobs=[0.0] * (1 + len(vs)),
                              token_versions=[-1] + vs, reward=reward))
        return out


class QuietEnvWorker:
    async def ping(self) -> int:  # the scheduler asks every worker's pid at each batch (a restart shows)
        return 1

    async def abort(self, uid: str) -> int:
        return 0


class EmptyTurnWorker(SimulatedWorker):
    """Episodes whose turn budget the prompt used up: no generated token, so no weight version."""

    async def run_group(self, item: WorkItem) -> list[Sample]:
        await asyncio.sleep(TICK_S)
        return [Sample(uid=f"{item.uid}/{m}", group_uid=item.uid, env=item.env, domain=item.env,
                       task_id=item.task_id, effort=item.effort, tokens=[1, 1], loss_mask=[0, 0],
                       behavior_logprobs=[0.0, 0.0], token_versions=[-1, -1], reward=float(m % 2))
                for m in range(item.group_size)]


def run_schedule(ray, max_staleness: int, seed: int, steps: int = 6, groups: int = 4, learner_s: float = 0.15,
                 start: int = 0, resume=None, worker=SimulatedWorker):
    """Steps start..steps-1 as the trainer runs them (batch, learner, push the next weights); returns
    the batches, their reports and the stream's position after the last push (a checkpoint's)."""
    from rl.rollout.scheduler import RolloutScheduler, SamplingPlan

    workers = [ray.remote(worker).remote(seed * 10 + i) for i in range(2)]
    env_worker = ray.remote(QuietEnvWorker).remote()
    plan = SamplingPlan(env_weights={"a": 1.0, "b": 1.0}, effort_weights={"low": 1.0, "high": 1.0},
                        effort_budgets={"low": 8, "high": 16}, group_size=GROUP, temperature=1.0, top_p=1.0,
                        seed=seed)
    tasks = {e: {"train": [f"{e}{i}" for i in range(50)], "heldout": []} for e in ("a", "b")}
    cfg = RolloutConfig(groups_per_step=groups, group_size=GROUP, max_staleness=max_staleness, groups_per_worker=4,
                        max_slots=64)
    scheduler = ray.remote(RolloutScheduler).remote(workers, [env_worker], tasks, plan, cfg)
    weights = ray.put({})
    ray.get(scheduler.set_weights.remote([weights], start))
    ray.get(scheduler.start_training.remote(resume))
    batches, reports = [], []
    for step in range(start, steps):
        ref, report = ray.get(scheduler.next_batch.remote(step), timeout=120)
        batches.append(ray.get(ref[0]))
        reports.append(report)
        time.sleep(learner_s)  # the learner's step: rollout goes on meanwhile when k > 0
        ray.get(scheduler.set_weights.remote([weights], step + 1))
    time.sleep(learner_s)  # the next step's groups under way when the checkpoint is taken
    position = ray.get(scheduler.snapshot.remote())
    ray.get(scheduler.stop_training.remote())
    for actor in [*workers, env_worker, scheduler]:
        ray.kill(actor)
    return batches, reports, position


def test_a_resumed_synchronous_stream_trains_on_what_an_uninterrupted_one_does(ray_session):
    """Killed after step 2's checkpoint and resumed, a synchronous run trains on the same groups, reports
    the same dropped ones and counts the same draws as one never interrupted. (The resumed scheduler
    used to count its batches from 0 against weights at version 3: it admitted groups up to the draw
    cap, 8 groups where 2 belong, and its batches were whichever finished first.)"""
    whole, whole_reports, _ = run_schedule(ray_session, 0, seed=3)
    first, first_reports, position = run_schedule(ray_session, 0, seed=3, steps=3)
    assert position.pending, "the checkpoint caught none of step 3's groups in flight: the test tests nothing"
    rest, rest_reports, _ = run_schedule(ray_session, 0, seed=3, start=3, resume=position)

    def trained(batch) -> list[str]:
        return sorted({s.group_uid for s in batch.samples})

    def dropped(report) -> list[str]:
        return sorted({r["group"] for r in report.records if not r["trained"]})

    assert [trained(b) for b in first + rest] == [trained(b) for b in whole]
    assert [dropped(r) for r in first_reports + rest_reports] == [dropped(r) for r in whole_reports]
    for key in ("rollout/refilled_groups", "rollout/dropped_uniform_groups"):
        assert [r.metrics.get(key) for r in first_reports + rest_reports] == [r.metrics.get(key) for r in whole_reports]


def test_samples_without_a_generated_token_are_never_stale(ray_session):
    """A group whose samples generated nothing (version -1) used to look infinitely stale: it was aborted
    and re-issued again and again, and the batch never came."""
    batches, reports, _ = run_schedule(ray_session, 0, seed=4, steps=2, worker=EmptyTurnWorker)
    assert [len(b.samples) for b in batches] == [4 * GROUP, 4 * GROUP]
    assert not any(r.metrics.get("async/aborted_groups") for r in reports)
    assert all(r["staleness"] is None for report in reports for r in report.records)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("seed", [1, 2])
def test_staleness_never_exceeds_the_bound(ray_session, max_staleness, seed):
    batches, reports, _ = run_schedule(ray_session, max_staleness, seed)
    seen: set[str] = set()
    spans = 0
    for step, batch in enumerate(batches):
        assert batch.step == step
        groups = {s.group_uid for s in batch.samples}
        assert len(groups) == 4 and len(batch.samples) == 4 * GROUP  # refilled to the batch size, whole groups
        assert not groups & seen, "a group was trained twice"
        seen |= groups
        for s in batch.samples:
            assert not uniform_uid(s.group_uid), "a group whose rewards all agree reached the learner"
            staleness = step - s.weight_version
            assert 0 <= staleness <= max_staleness, (s.uid, s.token_versions, step)
            generated = [v for v in s.token_versions if v >= 0]
            assert generated == sorted(generated)  # a token never records older weights than the one before
            spans += len(set(generated)) > 1
    if max_staleness == 0:
        assert spans == 0  # synchronous: every token from the weights it is trained against
    else:
        assert spans > 0  # partial rollouts: episodes in flight went on under new weights
    dropped = sum(r.metrics.get("rollout/dropped_uniform_groups", 0) for r in reports)
    refilled = sum(r.metrics["rollout/refilled_groups"] for r in reports)
    assert dropped > 0 and refilled >= dropped - 4 * (max_staleness + 1)


def uniform_uid(uid: str) -> bool:
    return int(uid[1:]) % 3 == 0


def test_async_overlaps_rollout_with_learning(ray_session):
    """With k = 1 the next batch is (mostly) ready when the learner asks; with k = 0 it never is."""
    _, sync, _ = run_schedule(ray_session, 0, seed=3, steps=5, learner_s=0.3)
    _, overlapped, _ = run_schedule(ray_session, 1, seed=3, steps=5, learner_s=0.3)
    wait = lambda reports: sum(r.metrics["time/batch_wait_s"] for r in reports[1:])  # noqa: E731
    assert wait(overlapped) < 0.6 * wait(sync)
