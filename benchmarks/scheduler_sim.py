"""The rollout scheduler at lab scale, by simulation (rl/rollout/simulate.py): the real RolloutScheduler
on a virtual clock with 1,000 rollout workers, 10,000 sandboxes, 2,000 domains and lognormal episode
times (median 20 s, p99 ~16x the median), a learner step of 30 s and a weight push of 2 s.

Part 1, at max_staleness 0, 2 and 8: the scheduler's CPU per step, the staleness of trained samples,
the idle share of the workers' group places, of the sandboxes and of the learner. Part 2: the same at
k=2 with the cluster (workers, sandboxes, groups per step) scaled up, and the cluster at which the
scheduler's CPU would fill one core (CPU seconds per simulated second reaching 1), from a power-law fit.

    .venv/bin/python benchmarks/scheduler_sim.py                     # both parts
    .venv/bin/python benchmarks/scheduler_sim.py --scales 1 2 --steps 8
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.rollout.simulate import SimConfig, simulate  # noqa: E402


def line(r) -> str:
    c = r.config
    staleness = ", ".join(f"{k}: {v:.0%}" for k, v in r.staleness.items())
    return (f"{c.rollout_workers} workers, {c.sandboxes} sandboxes, {c.domains} domains, {c.groups_per_step} groups "
            f"a step, k={c.max_staleness}: scheduler CPU {r.scheduler_cpu_s_per_step:.2f} s a step "
            f"({r.core_share():.1%} of a core; simulated world {r.world_cpu_s_per_step:.2f} s), driver's bookkeeping "
            f"{r.driver_cpu_s_per_step:.2f} s ({r.rollouts_bytes_per_step / 2**20:.0f} MiB of rollouts.jsonl), step "
            f"{r.sim_s / r.steps:.0f} s simulated, {r.samples_per_s:.0f} samples/s; staleness {staleness}; idle: "
            f"group places {r.slot_idle:.0%}, sandboxes {r.sandbox_idle:.0%}, learner {r.learner_idle:.0%}; "
            f"{r.aborted_groups:.0f} groups aborted and {r.redrawn_groups:.0f} redrawn a step; at most "
            f"{r.most_backlog} group(s) queued beyond a worker's places")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--staleness", type=int, nargs="*", default=[0, 2, 8])
    parser.add_argument("--scales", type=float, nargs="*", default=[1, 2, 4], help="cluster sizes x 1,000 workers")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    for k in args.staleness:
        started = time.perf_counter()
        r = simulate(SimConfig(max_staleness=k, steps=args.steps))
        print(f"{line(r)} [{time.perf_counter() - started:.0f} s to simulate]", flush=True)
    points = []
    for scale in args.scales:
        cfg = SimConfig(rollout_workers=int(1000 * scale), sandboxes=int(10_000 * scale),
                        groups_per_step=int(1024 * scale), max_staleness=2, steps=args.steps)
        started = time.perf_counter()
        r = simulate(cfg)
        points.append((cfg.rollout_workers, r.core_share()))
        print(f"{line(r)} [{time.perf_counter() - started:.0f} s to simulate]", flush=True)
    if len(points) >= 2:  # share = a * workers^b, fitted in log-log through the points
        xs, ys = [math.log(w) for w, _ in points], [math.log(s) for _, s in points]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = math.exp(my - b * mx)
        print(f"scheduler CPU share ~ workers^{b:.2f}: one core is full at ~{(1 / a) ** (1 / b):,.0f} rollout workers "
              f"(with 10 sandboxes and ~1 group a step per worker)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end; settings: {asdict(SimConfig())}")


if __name__ == "__main__":
    main()
