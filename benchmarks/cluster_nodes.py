"""The demo config on one node against a three-node cluster whose nodes share no filesystem (the head on
this host with the driver and the environment workers; the learner and the rollout workers each on a
Docker container node, tests/rl/docker_cluster.py), in one call: samples/s, weight-sync seconds a step,
and the bytes that cross the (loopback) network a step. Needs Docker and the sandbox base image.

    python benchmarks/cluster_nodes.py [--steps 8] [--config configs/demo.yaml]

On one host the "network" is the loopback device: its byte counters are read when the run logs its
first and its last GRPO step, and the difference is divided by the steps between. A single-node run
moves objects through shared memory, so its loopback bytes are Ray's control traffic alone."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "rl"))

from benchmarks.bench_common import log, write_json  # noqa: E402
from docker_cluster import DockerCluster  # noqa: E402

OVERRIDES = ["eval.before_and_after=false", "gate.enabled=false", "logging.progress=false",
             "logging.wandb_mode=disabled", "warmup.steps=20", "checkpoint.every=1000"]


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            fields = rest.split()
            return int(fields[0]) + int(fields[8])  # received + sent
    raise RuntimeError("no loopback device in /proc/net/dev")


def run(config: Path, steps: int, out: Path, extra: list[str], env: dict[str, str]) -> dict[str, float]:
    """`rl train` with the overrides; the loopback counters at its first and last GRPO step's line."""
    cmd = [str(ROOT / ".venv" / "bin" / "rl"), "train", str(config), f"train.steps={steps}",
           f"output_dir={out}", *OVERRIDES, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    marks: dict[int, tuple[float, int]] = {}
    while proc.poll() is None:
        metrics = list(out.glob("*/metrics.jsonl"))
        if metrics:
            for line in metrics[0].read_text().splitlines():
                step = json.loads(line)["step"]
                if step in (0, steps - 1) and step not in marks:
                    marks[step] = (time.monotonic(), loopback_bytes())
        time.sleep(0.2)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read()[-2000:]}")
    rows = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
    grpo = [m for m in rows if m["step"] >= 1]  # step 0 pays the first weight push and compiles
    return {"samples_per_s": statistics.mean(m["throughput/samples_per_s"] for m in grpo),
            "sync_s": statistics.mean(m["time/sync_s"] for m in grpo),
            "step_s": statistics.mean(m["time/step_s"] for m in grpo),
            "loopback_bytes_per_step": (marks[steps - 1][1] - marks[0][1]) / (steps - 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--image", default="rl-sandbox-base:latest")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict = {"steps": args.steps, "config": str(args.config)}
    with tempfile.TemporaryDirectory() as tmp:
        log("one node")
        results["one_node"] = run(args.config, args.steps, Path(tmp) / "one", [], dict(os.environ))
        log(f"one node: {results['one_node']}")
        write_json(results, args.json)
        cluster = DockerCluster(args.image, f"rl-bench-node-{os.getpid()}", head_resources={"env_node": 1})
        try:
            cluster.add_node({"learner_node": 1})
            cluster.add_node({"rollout_node": 2})
            log("three nodes")
            roles = ["resources.learner_resources={learner_node: 1}", "resources.rollout_resources={rollout_node: 1}",
                     "resources.env_resources={env_node: 1}", f"ray.address={cluster.address}"]
            results["three_nodes"] = run(args.config, args.steps, Path(tmp) / "three", roles,
                                         {**os.environ, **cluster.auth_env})
            log(f"three nodes: {results['three_nodes']}")
        finally:
            cluster.shutdown()
    write_json(results, args.json)


if __name__ == "__main__":
    main()
