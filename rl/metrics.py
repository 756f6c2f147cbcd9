"""Metrics: the same numbers to every sink (metrics.jsonl in the run folder, Weights & Biases,
TensorBoard when `logging.tensorboard` is on); the per-step rollout summaries."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from rl.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink, wandb_mode
from rl.types import Sample, episodes


class MetricsLogger:
    """Fans each `log(step, metrics)` out to the sinks. `mode` is the wandb mode (`disabled`: no
    wandb); the TensorBoard sink follows `config["logging"]["tensorboard"]`, the resolved run
    config the logger is handed anyway."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict[str, Any],
                 resume: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.mode = wandb_mode(mode)
        self.sinks: list[Sink] = [JsonlSink(self.path)]
        fresh: list[Sink] = []  # sinks that start over on resume: they get the history first
        if self.mode != "disabled":
            fresh.append(WandbSink(run_dir, self.mode, project, name, config, resume))
        if config.get("logging", {}).get("tensorboard", False):
            fresh.append(TensorBoardSink(run_dir, resume))
        if resume:  # metrics.jsonl was rewound to the checkpoint: one unbroken run in every sink
            for record in read_metrics(run_dir):
                step = record.pop("step")
                for sink in fresh:
                    if sink.replays_history:
                        sink.log(step, record)
        self.sinks += fresh

    @property
    def wandb_run(self):
        """The wandb run, or None when wandb is disabled."""
        return next((s.run for s in self.sinks if isinstance(s, WandbSink)), None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """step >= 0: a GRPO step; step < 0: a warm-up (SFT) step, counted up to -1."""
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_metrics(samples: Iterable[Sample], current_version: int) -> dict[str, float]:
    """Reward, pass rate, length and wall time by phase overall, per domain and per effort level (each
    episode once, its length over all its segments); weight staleness."""
    samples = list(samples)
    out: dict[str, float] = {}
    buckets: dict[str, list[tuple[Sample, int]]] = defaultdict(list)
    buckets["all"] = []  # always reported, even for a step whose groups all failed
    for s, length in episodes(samples):
        for key in ("all", f"domain/{s.domain}", f"effort/{s.effort}"):
            buckets[key].append((s, length))
    for key, group in buckets.items():
        prefix = "rollout" if key == "all" else f"rollout/{key}"
        n = max(len(group), 1)
        out[f"{prefix}/reward"] = sum(s.reward for s, _ in group) / n
        out[f"{prefix}/pass_rate"] = sum(s.passed for s, _ in group) / n
        out[f"{prefix}/response_tokens"] = sum(length for _, length in group) / n
        for phase in sorted({p for s, _ in group for p in s.phase_s}):  # where an episode's time went
            out[f"{prefix}/episode_s/{phase}"] = sum(s.phase_s.get(phase, 0.0) for s, _ in group) / n
    out["rollout/samples"] = float(len(samples))
    out["rollout/episodes"] = float(len(buckets["all"]))
    out["rollout/truncated"] = sum(s.truncated for s in samples) / max(len(samples), 1)
    out["rollout/grade_errors"] = float(sum(s.grade_error is not None for s in samples))
    out["rollout/turns"] = sum(s.num_turns for s in samples) / max(len(samples), 1)
    sampled = [s for s in samples if s.weight_version >= 0]  # a sample with no generated token has no lag
    out["rollout/weight_lag"] = sum(current_version - s.weight_version for s in sampled) / max(len(sampled), 1)
    return out
