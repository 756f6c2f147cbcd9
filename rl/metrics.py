"""Metrics: the same numbers to a JSONL file in the run folder and to Weights & Biases."""
from __future__ import annotations

import json
import uuid
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from rl.types import Sample


def wandb_mode(requested: str) -> str:
    """`auto`: online when the user is logged in, else offline (never blocks on a prompt)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    try:
        import wandb

        return "online" if wandb.api.api_key else "offline"
    except Exception:
        return "offline"


GRPO_AXIS, WARMUP_AXIS = "grpo_step", "warmup_step"


class MetricsLogger:
    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict[str, Any],
                 resume: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.mode = wandb_mode(mode)
        self._wandb = None
        self._axes_defined: set[str] = set()
        if self.mode != "disabled":
            import wandb

            run_id_file = run_dir / "wandb_id"
            run_id = run_id_file.read_text().strip() if run_id_file.exists() else uuid.uuid4().hex[:12]
            run_id_file.write_text(run_id)
            self._wandb = wandb.init(project=project, name=name, id=run_id, dir=str(run_dir), mode=self.mode,
                                     config=config, resume="allow" if resume else None, reinit="finish_previous")
            for axis in (GRPO_AXIS, WARMUP_AXIS):
                self._wandb.define_metric(axis)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """step >= 0: a GRPO step; step < 0: a warm-up (SFT) step, counted up to -1."""
        record = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            # wandb's own step must only grow, and warm-up steps are negative: each phase gets
            # its own x-axis metric instead, and wandb's step just counts calls
            axis = WARMUP_AXIS if step < 0 else GRPO_AXIS
            for prefix in {k.split("/", 1)[0] for k in metrics} - self._axes_defined:
                self._wandb.define_metric(f"{prefix}/*", step_metric=axis)
                self._axes_defined.add(prefix)
            self._wandb.log({**metrics, axis: step})

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rollout_metrics(samples: Iterable[Sample], current_version: int) -> dict[str, float]:
    """Reward, pass rate and length overall, per domain and per effort level; weight staleness."""
    samples = list(samples)
    out: dict[str, float] = {}
    buckets: dict[str, list[Sample]] = defaultdict(list)
    buckets["all"] = []  # always reported, even for a step whose groups all failed
    for s in samples:
        buckets["all"].append(s)
        buckets[f"domain/{s.domain}"].append(s)
        buckets[f"effort/{s.effort}"].append(s)
    for key, group in buckets.items():
        prefix = "rollout" if key == "all" else f"rollout/{key}"
        n = max(len(group), 1)
        out[f"{prefix}/reward"] = sum(s.reward for s in group) / n
        out[f"{prefix}/pass_rate"] = sum(s.passed for s in group) / n
        out[f"{prefix}/response_tokens"] = sum(s.response_tokens for s in group) / n
    out["rollout/samples"] = float(len(samples))
    out["rollout/truncated"] = sum(s.truncated for s in samples) / max(len(samples), 1)
    out["rollout/grade_errors"] = float(sum(s.grade_error is not None for s in samples))
    out["rollout/turns"] = sum(s.num_turns for s in samples) / max(len(samples), 1)
    out["rollout/weight_lag"] = sum(current_version - s.weight_version for s in samples) / max(len(samples), 1)
    return out
