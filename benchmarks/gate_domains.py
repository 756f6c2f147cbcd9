"""The quality gate of a run of many domains as `rl train` runs it (envs.gate_parallel.check_all over Ray
gate workers), first with an empty report cache, then again with the cache the first run filled, then
once more after one data file changed (its family's domains are checked again, the rest come from the
cache). Beside it, the gate the old way (one domain at a time in this process, a grader pool started
per domain) on a sample of the domains, to compare per domain.

    .venv/bin/python benchmarks/gate_domains.py                     # configs/many_domains.yaml, 2 workers
    .venv/bin/python benchmarks/gate_domains.py --workers 1 --serial-sample 0
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.gate_cache import GateCache  # noqa: E402
from envs.gate_parallel import check_all  # noqa: E402
from envs.quality import check_env  # noqa: E402
from envs.registry import resolve  # noqa: E402
from rl.cluster import env_kwargs, start_ray  # noqa: E402
from rl.config import load_config  # noqa: E402


def run(checks, max_tasks: int, workers: int, cache: GateCache) -> tuple[float, dict]:
    started = time.perf_counter()
    reports = check_all(checks, max_tasks, workers, cache)
    return time.perf_counter() - started, reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/many_domains.yaml")
    parser.add_argument("--workers", type=int, default=None, help="gate workers (default: the config's)")
    parser.add_argument("--serial-sample", type=int, default=10,
                        help="domains checked the old way, as many of each family")
    args = parser.parse_args()
    cfg = load_config(args.config, ["logging.wandb_mode=disabled"])
    workers = args.workers or cfg.gate.workers or cfg.rollout.env_workers
    names = [e.name for e in cfg.envs]
    start_ray(cfg)
    root = Path(tempfile.mkdtemp(prefix="gate-cache-"))
    data_copy = root / "data"
    try:
        # the data family reads a copy, changed for the third run
        shutil.copytree(Path(args.config).resolve().parent / "data", data_copy)
        kwargs = {n: {k: (str(data_copy / Path(v).name) if k == "data_files" else v)
                      for k, v in env_kwargs(cfg, n).items()} for n in names}
        checks = [(n, resolve(n, kwargs[n]), kwargs[n]) for n in names]
        cache = GateCache(root / "gate")
        load = os.getloadavg()[0]
        first_s, first = run(checks, cfg.gate.max_tasks, workers, cache)
        families = Counter(n.split(":")[0] for n in names)
        print(f"{len(names)} domains ({dict(families)}), gate.max_tasks={cfg.gate.max_tasks} per split, "
              f"{workers} gate workers: first run (empty cache) {first_s:.1f} s, "
              f"{sum(r['ok'] for r in first.values())} passed; load average {load:.1f}", flush=True)
        slowest = sorted(((r.get("gate_s") or 0.0, n) for n, r in first.items()), reverse=True)[:3]
        print(f"  slowest checks: {', '.join(f'{n} {s:.1f} s' for s, n in slowest)}; sum of checks "
              f"{sum(r.get('gate_s') or 0.0 for r in first.values()):.1f} s", flush=True)
        load = os.getloadavg()[0]
        second_s, second = run(checks, cfg.gate.max_tasks, workers, cache)
        cached = sum(bool(r.get("cached")) for r in second.values())
        print(f"second run (the cache from the first): {second_s:.1f} s, {cached} from the cache; "
              f"load average {load:.1f}", flush=True)
        changed = data_copy / "word_tasks.parquet"
        if changed.exists():  # one data file edited: a space after every question
            import datasets

            edited = datasets.Dataset.from_parquet(str(changed)).map(lambda r: {"question": r["question"] + " "})
            edited.to_parquet(str(root / "edited.parquet"))
            (root / "edited.parquet").replace(changed)
            load = os.getloadavg()[0]
            third_s, third = run(checks, cfg.gate.max_tasks, workers, cache)
            rechecked = sorted(n for n, r in third.items() if not r.get("cached"))
            print(f"third run after editing {changed.name}: {third_s:.1f} s, {len(rechecked)} checked again "
                  f"({dict(Counter(n.split(':')[0] for n in rechecked))}), the rest from the cache; load average "
                  f"{load:.1f}", flush=True)
        sample = []
        for family in families:  # the old way, for its cost per domain
            sample += [c for c in checks if c[0].startswith(family + ":")][:max(1, args.serial_sample // len(families))]
        if sample and args.serial_sample:
            load = os.getloadavg()[0]
            started = time.perf_counter()
            for name, _, kw in sample:
                check_env(name, kw, max_tasks=cfg.gate.max_tasks, record=False)
            old_s = time.perf_counter() - started
            print(f"the old way (serial, a grader pool per domain) on {len(sample)} of them: {old_s:.1f} s, "
                  f"{old_s / len(sample):.1f} s a domain -> ~{old_s / len(sample) * len(names) / 60:.0f} min for all "
                  f"{len(names)}; load average {load:.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
