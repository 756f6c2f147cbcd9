"""The quality gate's cost per task, beside one plain reference episode per task, in one run.

    .venv/bin/python benchmarks/gate_cost.py                      # configs/demo.yaml, as `rl train` gates it
    .venv/bin/python benchmarks/gate_cost.py --extra math lookup-docs code shell-fix-test --max-tasks 4
    .venv/bin/python benchmarks/gate_cost.py --no-ray --json /tmp/gate.json

For each environment of the config (its kwargs, `gate.max_tasks` per split, Ray's grader pool as
in `rl train`): the gate's wall time, its tasks and episodes, seconds per task; then the same
tasks played once with the reference and graded, with the same grader (what an honest episode
costs). The ratio says how many reference episodes the gate spends per task. The grader pool's
start-up is timed apart (`rl train` starts one per environment). The config's total is compared
with the one-minute budget for the demo's gate.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import log, write_json  # noqa: E402
from envs.grading import default_grader  # noqa: E402
from envs.gate_episodes import reference_policy, run_episode  # noqa: E402
from envs.quality import check_env  # noqa: E402
from envs.registry import make  # noqa: E402
from rl.cluster import env_kwargs, start_ray  # noqa: E402
from rl.config import load_config  # noqa: E402

BUDGET_S = 60.0


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the sandboxes), not Ray's actors."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def reference_cost(env: Any, grader: Any, max_tasks: int | None) -> tuple[int, float]:
    """Seconds to play and grade each task's reference once (every split, max_tasks each)."""
    ids = [tid for split in ("train", "heldout") for tid in list(env.dataset(split)["task_id"])[:max_tasks]]
    started = time.perf_counter()
    requests = [run_episode(env, tid, reference_policy(env.reference_actions(tid))).request for tid in ids]
    grader.grade_many(requests, use_cache=False)
    return len(ids), time.perf_counter() - started


def measure(name: str, kwargs: dict[str, Any], max_tasks: int | None) -> dict[str, Any]:
    """The grader is started (and has loaded this environment's grader) before the clocks run;
    its start-up is reported on its own (`rl train` pays it once per environment)."""
    env = make(name, **kwargs)
    started = time.perf_counter()
    grader = default_grader(num_actors=2)
    tid = env.dataset("train")[0]["task_id"]
    request = run_episode(env, tid, reference_policy(env.reference_actions(tid))).request
    grader.grade_many([request] * 64, use_cache=False)  # enough chunks to reach every actor
    grader_start_s = time.perf_counter() - started
    started, cpu = time.perf_counter(), _cpu_s()
    report = check_env(name, kwargs, max_tasks=max_tasks, grader=grader, record=False)
    gate_s, gate_cpu_s = time.perf_counter() - started, _cpu_s() - cpu
    n_ref, ref_s = reference_cost(env, grader, max_tasks)
    env.close()
    grader.close()
    tasks = report["tasks"]
    row = {"env": name, "ok": report["ok"], "tasks": tasks, "splits": report.get("splits"),
           "episodes": report["timings"].get("reset", {}).get("n", 0), "grader_start_s": round(grader_start_s, 2),
           "gate_s": round(gate_s, 2), "gate_s_per_task": round(gate_s / max(tasks, 1), 3),
           "gate_cpu_s": round(gate_cpu_s, 2),
           "reference_s_per_task": round(ref_s / max(n_ref, 1), 4), "reasons": report["reasons"],
           "load_avg": round(os.getloadavg()[0], 1)}
    row["ratio"] = round(row["gate_s_per_task"] / max(row["reference_s_per_task"], 1e-9), 1)
    log(f"{name}: {'ok' if report['ok'] else 'FAILED'} {tasks} tasks {row['splits']}, {row['episodes']} episodes: "
        f"gate {gate_s:.1f} s = {row['gate_s_per_task']:.3f} s/task; one reference episode "
        f"{row['reference_s_per_task']:.4f} s/task; ratio {row['ratio']}x; CPU {gate_cpu_s:.1f} s (this process and "
        f"its sandboxes); grader start {grader_start_s:.1f} s; "
        f"load average {row['load_avg']}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--extra", nargs="*", default=[], help="more registered environments (default kwargs)")
    ap.add_argument("--max-tasks", type=int, default=None, help="per split for --extra (default: the config's)")
    ap.add_argument("--no-ray", action="store_true", help="grade in this process instead of Ray's grader pool")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if not args.no_ray:
        start_ray(cfg)
    results: dict[str, Any] = {"config": args.config, "max_tasks": cfg.gate.max_tasks, "ray": not args.no_ray, "rows": []}
    total = 0.0
    for entry in cfg.envs:
        row = measure(entry.name, env_kwargs(cfg, entry.name), cfg.gate.max_tasks)
        results["rows"].append(row)
        total += row["gate_s"]
        write_json(results, args.json)
    starts = sum(r["grader_start_s"] for r in results["rows"])
    results["config_gate_s"] = round(total, 2)
    results["config_gate_with_grader_starts_s"] = round(total + starts, 2)
    log(f"{args.config}: the gate takes {total:.1f} s for {len(cfg.envs)} environments, {total + starts:.1f} s with "
        f"their grader start-ups ({(total + starts) / BUDGET_S:.2f} of the {BUDGET_S:.0f} s budget)")
    for name in args.extra:
        results["rows"].append(measure(name, {"sandbox_backend": cfg.sandbox_backend},
                                       args.max_tasks or cfg.gate.max_tasks))
        write_json(results, args.json)


if __name__ == "__main__":
    main()
