"""An environment worker holding many domains: its start time and memory, then what listing every
domain's tasks costs it (what `rl train` asks of the first environment worker before GRPO), beside the
same for a worker holding the demo's two environments. The workers are started by `rl train`'s own
code (rl.cluster.start_env_side), on a local Ray cluster; memory is each worker process's unique set
size (USS: what it alone holds) and resident set size.

    .venv/bin/python benchmarks/env_worker_domains.py                       # configs/many_domains.yaml
    .venv/bin/python benchmarks/env_worker_domains.py --config configs/demo.yaml
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
import ray  # noqa: E402

from rl.cluster import start_env_side, start_ray  # noqa: E402
from rl.config import load_config  # noqa: E402


def worker_memory() -> list[tuple[float, float]]:
    """(USS MiB, RSS MiB) of every environment worker process on this machine."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith("ray::EnvWorker"):
            try:
                info = proc.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out.append((info.uss / 2**20, info.rss / 2**20))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/many_domains.yaml")
    args = parser.parse_args()
    cfg = load_config(args.config, ["logging.wandb_mode=disabled"])
    names = [e.name for e in cfg.envs]
    start_ray(cfg)
    try:
        started = time.perf_counter()
        workers = start_env_side(cfg, f"bench{os.getpid()}")
        ray.get([w.health_report.remote() for w in workers])
        start_s = time.perf_counter() - started
        at_start = worker_memory()
        started = time.perf_counter()
        first = workers[0]  # rl.cluster.start_policy_side lists every domain's tasks from the first worker
        tasks = sum(len(ray.get(first.task_ids.remote(name, split)))
                    for name in names for split in ("train", "heldout"))
        list_s = time.perf_counter() - started
        after = worker_memory()
        print(f"{args.config}: {len(names)} domains, {len(workers)} environment workers; started and answering "
              f"in {start_s:.1f} s; memory per worker at start (USS/RSS MiB): "
              f"{', '.join(f'{u:.0f}/{r:.0f}' for u, r in at_start)}; every domain's task ids ({tasks} tasks) listed "
              f"from the first worker in {list_s:.1f} s; memory then: "
              f"{', '.join(f'{u:.0f}/{r:.0f}' for u, r in after)}; load average {os.getloadavg()[0]:.1f}")
        for w in workers:
            ray.get(w.close.remote())
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
