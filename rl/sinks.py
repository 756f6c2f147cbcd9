"""Where metrics go: the run folder's metrics.jsonl, Weights & Biases, TensorBoard.

Each sink takes the same `(step, metrics)` calls from `rl.metrics.MetricsLogger`; step >= 0 is a
GRPO step, step < 0 a supervised warm-up step (counted up to -1).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Protocol

GRPO_AXIS, WARMUP_AXIS = "grpo_step", "warmup_step"
TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


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


class JsonlSink:
    """One JSON object per call, appended to `path` (what `rl dashboard` and `rl report` read)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        pass


class WandbSink:
    """A wandb run in `run_dir/wandb`, under one id for the whole run folder. Offline, a resumed run
    starts its wandb run afresh (the earlier offline folders of this id are removed) and the
    logger replays metrics.jsonl into it, so one folder holds the whole run, each step once.
    Online, wandb resumes the run of that id."""

    replays_history = True

    def __init__(self, run_dir: Path, mode: str, project: str, name: str, config: dict[str, Any],
                 resume: bool) -> None:
        import wandb

        run_id_file = run_dir / "wandb_id"
        run_id = run_id_file.read_text().strip() if run_id_file.exists() else uuid.uuid4().hex[:12]
        run_id_file.write_text(run_id)
        self.replays_history = mode == "offline"
        if resume and self.replays_history:
            for old in (run_dir / "wandb").glob(f"offline-run-*-{run_id}"):
                shutil.rmtree(old, ignore_errors=True)
        # quiet: no end-of-run history (a sparkline per metric, hundreds of lines) and summary, unless
        # logging.wandb_summary asks (the run prints its own short summary); console off: wandb leaves
        # the process's stdout and stderr alone (no copy into its output.log)
        summary = bool(config.get("logging", {}).get("wandb_summary", False))
        self.run = wandb.init(project=project, name=name, id=run_id, dir=str(run_dir), mode=mode, config=config,
                              resume="allow" if resume and not self.replays_history else None,
                              reinit="finish_previous", settings=wandb.Settings(quiet=not summary, console="off"))
        self._axes_defined: set[str] = set()
        for axis in (GRPO_AXIS, WARMUP_AXIS):
            self.run.define_metric(axis)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # wandb's own step must only grow, and warm-up steps are negative: each phase gets its own
        # x-axis metric instead, and wandb's step just counts calls
        axis = WARMUP_AXIS if step < 0 else GRPO_AXIS
        for prefix in {k.split("/", 1)[0] for k in metrics} - self._axes_defined:
            self.run.define_metric(f"{prefix}/*", step_metric=axis)
            self._axes_defined.add(prefix)
        self.run.log({**metrics, axis: step})

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Scalars in `run_dir/tensorboard` (`tensorboard --logdir RUN_DIR/tensorboard`); the global
    step is the metrics.jsonl step, so warm-up scalars (`sft/*`) sit at negative steps."""

    replays_history = True  # a resumed run rewrites its event files from metrics.jsonl

    def __init__(self, run_dir: Path, resume: bool = False) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("logging.tensorboard needs the tensorboard package: "
                               "pip install 'kimi-rl[tensorboard]'") from None
        if resume:
            shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not math.isnan(value):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()  # a live `tensorboard` sees each step as it lands

    def close(self) -> None:
        self.writer.close()
