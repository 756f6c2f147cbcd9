"""Synchronous vs asynchronous GRPO, in one run, on the same config and seed.

The workload (benchmarks/async_vs_sync_env.py) is the `lookup` tool-use domain with a long tail of tool
latency (Pareto, median 0.3 s, capped at 8 s) and 0.2 s of grading per episode: a synchronous step
waits for its slowest episode, an asynchronous one does not. Both runs train the toy policy for the
same number of GRPO steps (so the same number of trained samples) from the same warm-up, and
measure held-out reward before and after.

    .venv/bin/python benchmarks/async_vs_sync.py                     # k = 0 vs k = 2, 24 steps
    .venv/bin/python benchmarks/async_vs_sync.py --staleness 1 --steps 12 --json /tmp/pipeline.json

Reported per mode: samples/s over the GRPO phase (every sample played: trained and dropped),
trained samples/s, learner idle fraction (waiting for a batch or for the weight push), rollout
engines' idle fraction, staleness, held-out reward after RL with its standard error."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_common import log, write_json  # noqa: E402


def config(out: Path, steps: int, staleness: int, groups: int, group_size: int, seed: int) -> dict:
    return {
        "name": f"pipeline-k{staleness}", "seed": seed, "output_dir": str(out),
        "model": {"preset": "toy", "vocab_size": 384},
        "envs": [{"name": "lookup-slow", "kwargs": {"kind": "keys", "n_train": 300, "n_heldout": 48}}],
        "effort": {"budgets": {"low": 24, "medium": 32, "high": 40, "max": 48}},
        "rollout": {"num_workers": 2, "groups_per_step": groups, "group_size": group_size, "max_context": 256,
                    "max_staleness": staleness, "groups_per_worker": groups, "max_slots": 2 * groups * group_size},
        "grader": {"num_workers": 4},
        "train": {"steps": steps, "lr": 5.0e-4, "micro_batches": 2, "threads": 1},
        "warmup": {"steps": 60, "batch_size": 32, "lr": 3.0e-3, "tasks_per_env": 200},
        "eval": {"tasks_per_env": 24, "samples_per_task": 4, "efforts": ["low", "high"], "temperature": 1.0},
        "checkpoint": {"every": 1000},
        "logging": {"wandb_mode": "disabled", "progress": False},
        "gate": {"enabled": False},
        "sandbox_backend": "process",
    }


def summarise(run_dir: Path) -> dict:
    from rl.metrics import read_metrics

    steps = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    wall = sum(m["time/step_s"] for m in steps)
    after = json.loads((run_dir / "eval_after.json").read_text())["all"]["all"]
    before = json.loads((run_dir / "eval_before.json").read_text())["all"]["all"]
    return {
        "grpo_wall_s": wall,
        "samples": sum(m["rollout/samples"] for m in steps),
        "samples_per_s": sum(m["rollout/samples"] for m in steps) / wall,
        "trained_samples_per_s": sum(m["rollout/trained_samples"] for m in steps) / wall,
        "learner_idle_frac": statistics.mean(m["time/learner_idle_frac"] for m in steps),
        "rollout_idle_frac": statistics.mean(m["time/rollout_idle_frac"] for m in steps),
        "staleness_mean": statistics.mean(m.get("async/staleness_mean", 0.0) for m in steps),
        "reward_before": before["reward"], "reward_after": after["reward"], "reward_after_stderr": after["stderr"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--staleness", type=int, default=2, help="max_staleness of the asynchronous run")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from envs.registry import register_file, unregister
    from rl.trainer import train

    register_file(f"{REPO / 'benchmarks' / 'async_vs_sync_env.py'}:SlowLookupEnv")
    results: dict = {"args": vars(args)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for k in (0, args.staleness):
                path = Path(tmp) / f"k{k}.yaml"
                path.write_text(yaml.safe_dump(config(Path(tmp) / "runs", args.steps, k, args.groups,
                                                      args.group_size, args.seed)))
                log(f"max_staleness={k}: training {args.steps} steps")
                run = train(str(path), [])
                results[f"k{k}"] = summarise(Path(run["run_dir"]))
                log(f"max_staleness={k}: {json.dumps(results[f'k{k}'])}")
                write_json(results, args.json)
    finally:
        unregister("lookup-slow")
    sync, fast = results["k0"], results[f"k{args.staleness}"]
    results["speedup_samples_per_s"] = fast["samples_per_s"] / sync["samples_per_s"]
    results["speedup_trained_samples_per_s"] = fast["trained_samples_per_s"] / sync["trained_samples_per_s"]
    write_json(results, args.json)
    print(f"\n| mode | samples/s | trained samples/s | learner idle | rollout idle | staleness | held-out before -> after |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("sync (k=0)", sync), (f"async (k={args.staleness})", fast)):
        print(f"| {name} | {r['samples_per_s']:.2f} | {r['trained_samples_per_s']:.2f} | {r['learner_idle_frac']:.0%} "
              f"| {r['rollout_idle_frac']:.0%} | {r['staleness_mean']:.2f} | {r['reward_before']:.2f} -> "
              f"{r['reward_after']:.2f} +- {r['reward_after_stderr']:.2f} |")
    print(f"\nasync / sync: {results['speedup_samples_per_s']:.2f}x samples/s, "
          f"{results['speedup_trained_samples_per_s']:.2f}x trained samples/s")


if __name__ == "__main__":
    main()
