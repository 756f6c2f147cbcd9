"""What per-domain metrics cost a run of many domains: bytes per step in metrics.jsonl and metric names
charted in wandb / TensorBoard, with family domains (`math:d7`: compact per-domain metrics, the rest per
family, single domains kept out of the charting sinks) beside the same samples under plain domain names
(every metric per domain, as before families), through the trainer's own rollout_metrics and the
logger's filter.

    .venv/bin/python benchmarks/domain_metrics.py                       # 200 domains, 16 groups a step
    .venv/bin/python benchmarks/domain_metrics.py --domains 2000 --groups 1024 --steps 20
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.metrics import charted, rollout_metrics  # noqa: E402
from rl.types import Sample  # noqa: E402


def step_samples(rng: random.Random, domains: list[str], groups: int, group_size: int, step: int) -> list[Sample]:
    out = []
    for g in range(groups):
        domain = rng.choice(domains)
        for i in range(group_size):
            passed = rng.random() < 0.5
            out.append(Sample(uid=f"s{step}g{g}/{i}", group_uid=f"s{step}g{g}", env=domain, domain=domain,
                              task_id="t", effort=rng.choice(["low", "medium", "high", "max"]), tokens=[1, 2],
                              loss_mask=[0, 1], behavior_logprobs=[0.0, -1.0], token_versions=[-1, step],
                              reward=float(passed), passed=passed,
                              phase_s={"start": 0.1, "generate": 1.0, "tools": 0.2, "grade": 0.1}))
    return out


def measure(domains: int, groups: int, group_size: int, steps: int, families: bool) -> dict[str, float]:
    rng = random.Random(0)
    names = [f"family{d % 10}:d{d}" if families else f"family{d % 10}-d{d}" for d in range(domains)]
    sizes, every, drawn = [], set(), set()
    for step in range(steps):
        metrics = rollout_metrics(step_samples(rng, names, groups, group_size, step), step)
        # the learner's per-domain mismatch, as rl/learner/loss.py logs it for the domains it trained on
        metrics.update({f"train/mismatch/domain/{d}": 0.01 for d in {k.split("/")[2] for k in metrics
                                                                       if k.startswith("rollout/domain/")}})
        sizes.append(len(json.dumps({"step": step, **metrics})) + 1)
        every |= set(metrics)
        drawn |= set(charted(metrics))
    return {"bytes_per_step": sum(sizes) / steps, "names_in_jsonl": len(every), "names_charted": len(drawn)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--domains", type=int, default=200)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    for families in (False, True):
        row = measure(args.domains, args.groups, args.group_size, args.steps, families)
        print(f"{'families' if families else 'plain domains'}: {args.domains} domains, {args.groups} groups of "
              f"{args.group_size} a step, {args.steps} steps: {row['bytes_per_step']:.0f} bytes a step in "
              f"metrics.jsonl, {row['names_in_jsonl']} metric names there, {row['names_charted']} charted "
              f"(wandb / TensorBoard)")


if __name__ == "__main__":
    main()
