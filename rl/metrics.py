"""Metrics: the same numbers to every sink (metrics.jsonl in the run folder, Weights & Biases,
TensorBoard when `logging.tensorboard` is on); the per-step rollout summaries."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from rl.run_folder import METRICS
from rl.sinks import JsonlSink, Sink, TensorBoardSink, WandbSink, wandb_mode
from rl.types import Sample, episodes


class MetricsLogger:
    """Fans each `log(step, metrics)` out to the sinks. `mode` is the wandb mode (`disabled`: no
    wandb); the TensorBoard sink follows `config["logging"]["tensorboard"]`, the resolved run
    config the logger is handed anyway."""

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict[str, Any],
                 resume: bool) -> None:
        self.path = run_dir / METRICS
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
                        sink.log(step, charted(record))
        self.sinks += fresh
        self.pending: dict[str, float] = {}  # what was left out before a step: logged with the next row

    def add_to_next(self, metrics: dict[str, float]) -> None:
        """Metrics of something done between steps (reference episodes, an evaluation), logged with
        the next row."""
        self.pending.update(metrics)

    @property
    def wandb_run(self):
        """The wandb run, or None when wandb is disabled."""
        return next((s.run for s in self.sinks if isinstance(s, WandbSink)), None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """step >= 0: a GRPO step; step < 0: a warm-up (SFT) step, counted up to -1. metrics.jsonl gets
        every metric; wandb and TensorBoard, a chart per metric name, not those of single family domains."""
        metrics, self.pending = {**self.pending, **metrics}, {}
        for sink in self.sinks:
            sink.log(step, metrics if isinstance(sink, JsonlSink) else charted(metrics))

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def charted(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics without those of a family's single domains (a run of hundreds of domains would draw
    thousands of charts): their families' aggregates stay, and metrics.jsonl keeps them all."""
    return {k: v for k, v in metrics.items() if not any(family_member(part) for part in k.split("/"))}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


FAMILY_SEP = ":"  # a family's domains are FAMILY:member (envs.registry.SEP: envs sits below rl)


def family_of(domain: str) -> str:
    """`math` for `math:add-9x2`; a domain outside any family is a family of its own."""
    return domain.split(FAMILY_SEP, 1)[0]


def family_member(key_part: str) -> bool:
    """Whether a metric name's part is a family's domain (`math:add-9x2`, envs.families)."""
    return FAMILY_SEP in key_part


def rollout_metrics(samples: Iterable[Sample], current_version: int) -> dict[str, float]:
    """Reward, pass rate, length and wall time by phase overall, per domain and per effort level (each
    episode once, its length over all its segments); weight staleness. A family's domain (`math:add-9x2`)
    gets only its reward, pass rate and episodes (`rollout/domain/<d>/...`, for the dashboard's ranking
    and picker) and its family the rest (`rollout/family/<f>/...`): a step's volume grows with the groups
    it holds, not with the run's domains."""
    samples = list(samples)
    out: dict[str, float] = {}
    buckets: dict[str, list[tuple[Sample, int]]] = defaultdict(list)
    buckets["all"] = []  # always reported, even for a step whose groups all failed
    members: dict[str, list[Sample]] = defaultdict(list)
    for s, length in episodes(samples):
        family, in_family, _ = s.domain.partition(FAMILY_SEP)
        if in_family:
            members[s.domain].append(s)
        for key in ("all", f"family/{family}" if in_family else f"domain/{s.domain}", f"effort/{s.effort}"):
            buckets[key].append((s, length))
    for key, group in buckets.items():
        prefix = "rollout" if key == "all" else f"rollout/{key}"
        n = max(len(group), 1)
        out[f"{prefix}/reward"] = sum(s.reward for s, _ in group) / n
        out[f"{prefix}/pass_rate"] = sum(s.passed for s, _ in group) / n
        out[f"{prefix}/response_tokens"] = sum(length for _, length in group) / n
        for phase in sorted({p for s, _ in group for p in s.phase_s}):  # where an episode's time went
            out[f"{prefix}/episode_s/{phase}"] = sum(s.phase_s.get(phase, 0.0) for s, _ in group) / n
        turns = [tool_call_turns(s.transcript) for s, _ in group]
        if sum(t for t, _ in turns):  # the share of the assistant's turns that called a tool
            out[f"{prefix}/tool_call_rate"] = sum(c for _, c in turns) / sum(t for t, _ in turns)
    for domain, group in members.items():
        out[f"rollout/domain/{domain}/reward"] = sum(s.reward for s in group) / len(group)
        out[f"rollout/domain/{domain}/pass_rate"] = sum(s.passed for s in group) / len(group)
        out[f"rollout/domain/{domain}/episodes"] = float(len(group))
    out.update(effort_budget_metrics(samples))
    out["rollout/samples"] = float(len(samples))
    out["rollout/episodes"] = float(len(buckets["all"]))
    out["rollout/truncated"] = sum(s.truncated for s in samples) / max(len(samples), 1)
    out["rollout/grade_errors"] = float(sum(s.grade_error is not None for s in samples))
    out["rollout/turns"] = sum(s.num_turns for s in samples) / max(len(samples), 1)
    sampled = [s for s in samples if s.weight_version >= 0]  # a sample with no generated token has no lag
    out["rollout/weight_lag"] = sum(current_version - s.weight_version for s in sampled) / max(len(sampled), 1)
    return out


def tool_call_turns(transcript: list[dict[str, Any]]) -> tuple[int, int]:
    """(assistant turns, those that called a tool) in an episode's transcript: a turn called a tool
    when the environment answered it with a `tool` message (a malformed call's error included);
    a turn the effort budget cut, never stepped, called none."""
    turns = calls = 0
    for i, message in enumerate(transcript):
        if message.get("role") == "assistant":
            turns += 1
            calls += i + 1 < len(transcript) and transcript[i + 1].get("role") == "tool"
    return turns, calls


def budget_stats(samples: Iterable[Sample]) -> dict[str, float]:
    """Over the episodes of `samples` (each once, its segments summed) that recorded an effort budget:
    reasoning tokens, the share of the budget used, and the shares of episodes whose reasoning the
    budget forced closed (`forced`), that the budget ended (`budget_cut`), and that ended on their own
    within it (`within_budget`: neither). Empty when none recorded a budget."""
    reasoning: dict[str, int] = defaultdict(int)
    for s in samples:
        reasoning[s.episode] += s.reasoning_tokens
    rows = [(s, length, reasoning[s.episode]) for s, length in episodes(list(samples)) if s.budget > 0]
    if not rows:
        return {}
    n = len(rows)
    return {"reasoning_tokens": sum(r for _, _, r in rows) / n,
            "budget_used": sum(length / s.budget for s, length, _ in rows) / n,
            "forced": sum(s.forced_turns > 0 for s, _, _ in rows) / n,
            "budget_cut": sum(s.budget_cut for s, _, _ in rows) / n,
            "within_budget": sum(not s.budget_cut and not s.forced_turns for s, _, _ in rows) / n}


def effort_budget_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """budget_stats overall (`rollout/...`) and per effort level (`rollout/effort/<level>/...`)."""
    samples = list(samples)
    levels: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        levels[s.effort].append(s)
    out = {f"rollout/{k}": v for k, v in budget_stats(samples).items()}
    for level, group in levels.items():
        out.update({f"rollout/effort/{level}/{k}": v for k, v in budget_stats(group).items()})
    return out
