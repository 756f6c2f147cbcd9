"""Soak: one long run with faults injected, watched for what it leaks. On demand, not in CI.

    .venv/bin/python benchmarks/soak.py                          # 1,000 episodes, k = 2, a fault every ~45 s
    .venv/bin/python benchmarks/soak.py --episodes 200 --every 20 --staleness 0 --json /tmp/soak.json

The run is the tiny config's three domains (math, lookup, and shell with its sandboxes) on the toy
policy, driven through `rl train` in a process of its own. Faults come at random moments (--seed),
once the run is training: SIGKILL to a rollout worker, the environment worker or a grader actor (the
run goes on), to the learner, or SIGINT / SIGTERM to the driver (the run stops in one line and is
resumed with `rl train --resume`). A worker is killed at most as often as Ray restarts it within one
driver's life (a kill beyond that stops the run by design: docs/faults.md).

Reported: episodes played; each fault and the console line it ended in; every actor's memory (RSS)
over time (memory.csv beside the run: seconds, actor, pid, MB) with first / peak / last per process
and the growth per 100 episodes of those that lived through the whole run; after the run, what is
left: processes of the run still alive (Ray workers, sandbox agents), sandboxes and containers
labelled with the run, sandbox state directories and /dev/shm files that were not there before;
and whether the run folder reads as one run (every step once, no sample twice, whole groups)."""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_common import log, write_json  # noqa: E402

STOP_LINE = re.compile(r"; the run stopped(;| before its first checkpoint)")
MAX_RETRIES = 3  # rollout.max_retries: a rollout worker restarts max_retries + 1 times
KILLS_PER_LIFE = {"rollout worker": MAX_RETRIES, "environment worker": 2}  # below Ray's restarts (rl/cluster.py)
GROUPS, GROUP_SIZE = 4, 2


def config(out: Path, episodes: int, staleness: int, seed: int, backend: str) -> dict:
    return {
        "name": "soak", "seed": seed, "output_dir": str(out), "sandbox_backend": backend,
        "model": {"preset": "toy", "vocab_size": 320},
        "envs": [{"name": "math", "kwargs": {"max_operand": 9, "n_train": 40, "n_heldout": 8}},
                 {"name": "lookup", "kwargs": {"n_train": 40, "n_heldout": 8}},
                 {"name": "shell", "kwargs": {"n_train": 40, "n_heldout": 8}}],
        "effort": {"budgets": {"low": 8, "medium": 12, "high": 16, "max": 24}},
        "rollout": {"num_workers": 2, "groups_per_step": GROUPS, "group_size": GROUP_SIZE, "max_context": 256,
                    "max_staleness": staleness, "drop_uniform_groups": False, "max_retries": MAX_RETRIES},
        "train": {"steps": math.ceil(episodes / (GROUPS * GROUP_SIZE)), "micro_batches": 1},
        "warmup": {"steps": 2, "batch_size": 8, "tasks_per_env": 4},
        "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
        "checkpoint": {"every": 5, "keep": 2},
        "logging": {"wandb_mode": "disabled", "progress": False},
        "gate": {"enabled": False},
    }


def run_processes(driver: int) -> dict[int, tuple[str, float]]:
    """pid -> (what it is, its start time) for the driver and everything under it: Ray's processes
    (an actor's title is ray::Class or ray::Class.method while it runs one), sandboxes."""
    out = {}
    try:
        procs = [psutil.Process(driver), *psutil.Process(driver).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            cmd = p.cmdline()
            title = "driver" if p.pid == driver else (cmd[0].split(".")[0] if cmd and cmd[0].startswith("ray::")
                                                      else Path(cmd[0]).name if cmd else p.name())
            out[p.pid] = (title, p.create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


class Watch:
    """Samples every process of the run: memory over time, and every process ever seen (a leak is
    one still alive once the run has ended)."""

    def __init__(self, out_csv: Path, every_s: float) -> None:
        self.started = time.monotonic()
        self.every_s = every_s
        self.seen: dict[tuple[int, float], str] = {}
        self.memory: dict[tuple[int, float], list[tuple[float, float]]] = {}  # (pid, start) -> [(s, MB)]
        self.csv = out_csv.open("w", newline="")
        self.writer = csv.writer(self.csv)
        self.writer.writerow(["seconds", "actor", "pid", "rss_mb"])

    def sample(self, driver: int) -> None:
        now = time.monotonic() - self.started
        for pid, (title, start) in run_processes(driver).items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                continue
            self.seen[(pid, start)] = title
            self.memory.setdefault((pid, start), []).append((now, rss))
            self.writer.writerow([f"{now:.1f}", title, pid, f"{rss:.1f}"])
        self.csv.flush()

    def alive_now(self) -> list[dict]:
        left = []
        for (pid, start), title in self.seen.items():
            try:
                if psutil.Process(pid).create_time() == start:
                    left.append({"pid": pid, "what": title})
            except psutil.NoSuchProcess:
                pass
        return left


class Segment:
    """One `rl train` process (the first run, or a resume), its output collected."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "train", *args], cwd=str(REPO),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()


def steps_logged(run_dir: Path | None) -> int:
    path = run_dir / "metrics.jsonl" if run_dir else None
    if path is None or not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"step": -' not in line and line.strip())


def inject(kind: str, driver: int, rng: random.Random) -> str:
    """Do the fault; what was hit."""
    if kind in ("SIGINT", "SIGTERM"):
        os.kill(driver, getattr(signal, kind))
        return f"driver pid {driver}"
    title = {"rollout worker": "ray::RolloutWorker", "environment worker": "ray::EnvWorker",
             "grader actor": "ray::GraderActor", "learner": "ray::Learner"}[kind]
    targets = [pid for pid, (what, _) in run_processes(driver).items() if what == title]
    if not targets:
        return "none found"
    pid = rng.choice(targets)
    os.kill(pid, signal.SIGKILL)
    return f"pid {pid}"


def leftovers(run_dir: Path, shm_before: set[str]) -> dict:
    """What the run left behind: process sandboxes (their state dirs) and containers labelled with
    the run, half-written files and checkpoints without a manifest in the run folder, and /dev/shm
    files that were not there before (another program's may show there too)."""
    from sandbox.docker_backend import docker_available, list_docker_sandboxes
    from sandbox.process_backend import list_process_sandboxes

    ours = lambda s: (s.get("labels") or {}).get("run") == run_dir.name  # noqa: E731
    sandboxes = [s.get("state_dir", s["id"]) for s in list_process_sandboxes() if ours(s)]
    containers = [s["container"] for s in list_docker_sandboxes() if ours(s)] if docker_available() else []
    strays = [str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if ".tmp" in p.name or p.name.endswith(".rewind")]
    strays += [str(p.relative_to(run_dir)) for p in (run_dir / "checkpoints").glob("step_*")
               if not (p / "manifest.json").exists()]
    return {"process_sandboxes": sandboxes, "containers": containers, "run_folder_strays": strays,
            "dev_shm": sorted(set(os.listdir("/dev/shm")) - shm_before)}


def consistent(run_dir: Path) -> list[str]:
    """What is wrong with the run folder as one run; [] when nothing."""
    problems = []
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s >= 0]
    if steps != list(range(len(steps))):
        problems.append(f"steps logged out of order or twice: {steps}")
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    uids = Counter(r["uid"] for r in records)
    if uids and max(uids.values()) > 1:
        problems.append(f"{sum(1 for n in uids.values() if n > 1)} sample(s) logged twice")
    groups = Counter(r["group"] for r in records if r["trained"])
    if any(n != GROUP_SIZE for n in groups.values()):
        problems.append("a group was trained in part or twice")
    return problems


def memory_summary(watch: Watch, episodes: int) -> list[dict]:
    """First, peak and last RSS of the run's own processes (the driver, Ray's, the actors); the
    sandboxes' short-lived processes are left to the leak check."""
    rows = []
    end = max((points[-1][0] for points in watch.memory.values()), default=0.0)
    for (pid, _), points in watch.memory.items():
        if not watch.seen[(pid, _)].startswith(("ray::", "driver", "raylet", "gcs_server")):
            continue
        mbs = [mb for _, mb in points]
        row = {"actor": watch.seen[(pid, _)], "pid": pid, "first_mb": round(mbs[0], 1), "peak_mb": round(max(mbs), 1),
               "last_mb": round(mbs[-1], 1), "seconds": round(points[-1][0] - points[0][0], 1)}
        if row["seconds"] > 0.8 * end and episodes:  # lived through the run: its growth is a leak's measure
            row["growth_mb_per_100_episodes"] = round(100 * (mbs[-1] - mbs[0]) / episodes, 2)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["actor"], r["pid"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--staleness", type=int, default=2, help="rollout.max_staleness (0: synchronous)")
    ap.add_argument("--every", type=float, default=45.0, help="mean seconds between faults")
    ap.add_argument("--faults", default="rollout worker,environment worker,grader actor,learner,SIGINT,SIGTERM")
    ap.add_argument("--backend", default="process", help="sandbox backend (docker, process)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FAULT_SEED", 0)))
    ap.add_argument("--out", default=None, help="folder for the run (default: a new temporary one)")
    ap.add_argument("--json", default=None, help="write the report here too")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    out = Path(args.out or tempfile.mkdtemp(prefix="soak-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "soak.yaml"
    cfg_path.write_text(yaml.safe_dump(config(out / "runs", args.episodes, args.staleness, args.seed, args.backend)))
    shm_before = set(os.listdir("/dev/shm"))
    watch = Watch(out / "memory.csv", args.sample)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    faults, run_dir, started = [], None, time.monotonic()
    log(f"soak: {args.episodes} episodes, max_staleness {args.staleness}, a fault every ~{args.every:.0f} s "
        f"({', '.join(kinds)}), seed {args.seed}, in {out}")
    while True:
        seg = Segment([str(cfg_path)] if run_dir is None else ["--resume", str(run_dir)])
        kills: Counter = Counter()  # this driver's life: Ray's restarts are counted per life
        next_fault, next_sample, at_start = None, 0.0, None
        while seg.proc.poll() is None:
            now = time.monotonic()
            if now >= next_sample:
                watch.sample(seg.proc.pid)
                next_sample = now + args.sample
            run_dir = run_dir or next(iter((out / "runs").glob("soak-*")), None)
            logged = steps_logged(run_dir)
            if at_start is None:
                at_start = logged
            if next_fault is None and logged > at_start:  # training: faults may come
                next_fault = now + args.every * rng.uniform(0.5, 1.5)
            if next_fault is not None and now >= next_fault:
                allowed = [k for k in kinds if kills[k] < KILLS_PER_LIFE.get(k, 10**9)]
                kind = rng.choice(allowed)
                kills[kind] += 1
                hit = inject(kind, seg.proc.pid, rng)
                faults.append({"seconds": round(now - started, 1), "fault": kind, "hit": hit, "step": logged - 1})
                log(f"fault: {kind} ({hit}) after step {logged - 1}")
                next_fault = now + args.every * rng.uniform(0.5, 1.5)
            time.sleep(0.5)
        rc = seg.proc.wait()
        time.sleep(1.0)
        said = [line for line in "".join(seg.lines).splitlines() if line.strip()]
        for line in said:
            if re.search(r"died; Ray restarts it|cut off by|grader actor\(s\) died", line):
                log(f"  said: {line.strip()}")
        last = said[-1] if said else ""
        if faults and rc != 0:
            faults[-1]["ended_in"] = {"exit": rc, "line": last}
        if rc == 0:
            break
        log(f"stopped (exit {rc}): {last}")
        if not STOP_LINE.search(last) or run_dir is None:
            log("the run did not end in a stop line; the soak stops here")
            break
    time.sleep(10.0)  # what dies with its owner has had time to
    episodes = sum(1 for _ in (run_dir / "rollouts.jsonl").open()) if run_dir else 0
    report = {
        "episodes": episodes, "seconds": round(time.monotonic() - started, 1), "seed": args.seed,
        "run_dir": str(run_dir), "exit": rc, "faults": faults,
        "memory": memory_summary(watch, episodes),
        "leaked_processes": watch.alive_now(),
        **(leftovers(run_dir, shm_before) if run_dir else {}),
        "run_folder_problems": consistent(run_dir) if run_dir else ["no run folder"],
    }
    watch.csv.close()
    log(f"{episodes} episodes in {report['seconds']:.0f} s, {len(faults)} faults, exit {rc}")
    for row in report["memory"]:
        growth = row.get("growth_mb_per_100_episodes")
        log(f"  {row['actor']:<24} pid {row['pid']:<7} {row['first_mb']:7.1f} -> {row['last_mb']:7.1f} MB "
            f"(peak {row['peak_mb']:.1f})" + (f", {growth:+.2f} MB per 100 episodes" if growth is not None else ""))
    for key in ("leaked_processes", "process_sandboxes", "containers", "run_folder_strays", "dev_shm",
                "run_folder_problems"):
        log(f"{key}: {report.get(key) or 'none'}")
    write_json(report, args.json)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    log(f"report: {out / 'soak.json'}, memory over time: {out / 'memory.csv'}")


if __name__ == "__main__":
    main()
