"""Sampling across many domains: the stream's draws match the configured weights (a chi-square test over
many steps), stay a pure function of (seed, index), and adaptive sampling (rollout.adaptive) moves draws
toward domains in the useful pass-rate band, never below its floor, and resumes from a checkpoint with
its weights. The scheduler runs for real here, on rl/rollout/simulate.py's virtual clock."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from rl.config import AdaptiveSamplingConfig, RolloutConfig
from rl.rollout.adaptive import AdaptiveWeights
from rl.rollout.scheduler import RolloutScheduler, SamplingPlan, StreamPosition
from rl.rollout.simulate import SimConfig, VirtualClockLoop, simulate
from rl.types import Sample

DOMAINS = [f"fam{i % 5}:d{i}" for i in range(200)]
WEIGHTS = {d: 1.0 + (i % 7) for i, d in enumerate(DOMAINS)}
EFFORTS = {"low": 1.0, "medium": 2.0, "high": 0.0, "max": 1.0}
TASKS = {d: [f"{d}/t{i}" for i in range(10)] for d in DOMAINS}


def plan(weights=WEIGHTS, seed=0) -> SamplingPlan:
    return SamplingPlan(weights, EFFORTS, {"low": 8, "medium": 16, "high": 24, "max": 32}, 4, 1.0, 1.0, seed)


def chi_square_p(observed: Counter, expected_share: dict[str, float]) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty's normal approximation to chi-square)."""
    n = sum(observed.values())
    stat = sum((observed.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected_share.items() if p > 0)
    dof = sum(1 for p in expected_share.values() if p > 0) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def shares(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}


def test_draws_over_many_steps_match_the_weights():
    stream = plan()
    items = [stream.item(i, TASKS) for i in range(3000 * 16)]  # 3000 steps of 16 groups
    envs, efforts = Counter(it.env for it in items), Counter(it.effort for it in items)
    assert chi_square_p(envs, shares(WEIGHTS)) > 1e-3
    assert chi_square_p(efforts, shares(EFFORTS)) > 1e-3 and efforts["high"] == 0
    # the test can fail: the same draws against equal weights are far off
    assert chi_square_p(envs, shares(dict.fromkeys(DOMAINS, 1.0))) < 1e-9


def test_the_stream_is_a_function_of_seed_and_index():
    a, b = plan(), plan()
    assert [a.item(i, TASKS) for i in range(50)] == [b.item(i, TASKS) for i in range(500)][:50]
    assert [a.item(i, TASKS) for i in range(50)] != [plan(seed=1).item(i, TASKS) for i in range(50)]
    assert a.item(7, TASKS) == a.item(7, TASKS)


def _samples(env: str, passed: int, n: int = 8) -> list[Sample]:
    return [Sample(f"{env}/{i}", env, env, env, "t", "medium", [1], [1], [0.0], [0], float(i < passed), i < passed)
            for i in range(n)]


def test_adaptive_weights_favour_the_band_and_keep_a_floor():
    cfg = AdaptiveSamplingConfig(enabled=True, low=0.1, high=0.9, floor=0.25, min_samples=8, decay=0.8)
    weights = AdaptiveWeights({"solved": 1.0, "hopeless": 1.0, "useful": 1.0, "unseen": 2.0}, cfg)
    for _ in range(10):
        weights.observe(_samples("solved", 8) + _samples("hopeless", 0) + _samples("useful", 4))
    w = weights.weights()
    assert w["useful"] == 1.0 and w["unseen"] == 2.0  # in the band; not yet measured
    assert w["solved"] == pytest.approx(0.25) and w["hopeless"] == pytest.approx(0.25)
    share = shares(w)
    for env, base in shares(weights.base).items():
        assert share[env] >= cfg.floor * base - 1e-12  # no domain starves
    nearly = AdaptiveWeights({"d": 1.0}, cfg)
    nearly.observe(_samples("d", 7, n=8) * 2)  # 0.875 passed: inside the band still
    assert nearly.weights()["d"] == 1.0
    nearly.observe(_samples("d", 8, n=8) * 4)
    assert cfg.floor < nearly.weights()["d"] < 1.0  # moving down linearly toward the floor


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_scheduler_draws_by_pass_rate_when_adaptive(adaptive):
    cfg = SimConfig(rollout_workers=16, sandboxes=512, domains=30, tasks_per_domain=8, groups_per_step=16,
                    steps=45, warmup_steps=15, episode_median_s=5.0, pass_rates=(0.0, 0.5, 1.0), adaptive=adaptive)
    result = simulate(cfg)
    by_rate = {rate: [result.drawn.get(f"family{d % 20}:domain-{d}", 0) for d in range(30) if d % 3 == i]
               for i, rate in enumerate(cfg.pass_rates)}
    useful = sum(by_rate[0.5]) / 10
    extremes = (sum(by_rate[0.0]) + sum(by_rate[1.0])) / 20
    if adaptive:
        assert useful > 2.5 * extremes and min(by_rate[0.0] + by_rate[1.0]) >= 1
        assert result.position["sampling"]["seen"]
    else:
        assert 0.6 < useful / extremes < 1.6 and result.position["sampling"] is None


def test_a_checkpoint_restores_the_adaptive_weights():
    cfg = SimConfig(rollout_workers=16, sandboxes=512, domains=30, tasks_per_domain=8, groups_per_step=16,
                    steps=20, warmup_steps=5, episode_median_s=5.0, pass_rates=(0.0, 0.5, 1.0), adaptive=True)
    saved = json.loads(json.dumps(simulate(cfg).position))  # scheduler.json's round trip
    domains = [f"family{d % 20}:domain-{d}" for d in range(30)]
    rollout = RolloutConfig(num_workers=1, groups_per_step=16, group_size=8, groups_per_worker=2, max_slots=16,
                            adaptive={"enabled": True})
    stream = SamplingPlan(dict.fromkeys(domains, 1.0), {"medium": 1.0}, {"medium": 64}, 8, 1.0, 1.0, 0)
    resumed = RolloutScheduler([], [], {d: {"train": ["t"], "heldout": []} for d in domains}, stream, rollout)
    fresh = RolloutScheduler([], [], {d: {"train": ["t"], "heldout": []} for d in domains}, stream, rollout)
    loop = VirtualClockLoop()
    try:
        loop.run_until_complete(resumed.start_training(StreamPosition.from_dict(saved)))
        loop.run_until_complete(resumed.stop_training())
    finally:
        loop.close()
    restored = resumed.adaptive.weights()
    assert restored != fresh.adaptive.weights() and min(restored.values()) < 1.0
    assert resumed.snapshot().to_dict()["sampling"] == saved["sampling"]
    ids = {d: ["t"] for d in domains}
    after = [stream.item(saved["next_index"] + i, ids, resumed.adaptive.distribution()) for i in range(20)]
    again = AdaptiveWeights(stream.env_weights, rollout.adaptive)
    again.restore(saved["sampling"])
    assert after == [stream.item(saved["next_index"] + i, ids, again.distribution()) for i in range(20)]
