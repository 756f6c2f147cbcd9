"""The run folder's files: where they live, appending to them, and rewinding them on resume so a
resumed run reads as one unbroken run (no step logged twice)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from rl.config import RunConfig

CHECKPOINTS = "checkpoints"
STEP_LOGS = ("metrics.jsonl", "rollouts.jsonl", "moe_load.jsonl")  # one or more lines per step


def new_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True)
    return run_dir


def latest_checkpoint(run_dir: Path) -> tuple[str, int] | None:
    marker = run_dir / CHECKPOINTS / "latest"
    if not marker.exists():
        return None
    tag = marker.read_text().strip()
    return tag, int(tag.split("_")[1])


def append_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")


def rewind_step_logs(run_dir: Path, last_step: int) -> int:
    """Drop the lines of steps after `last_step` (written after the checkpoint a run resumes from;
    they are about to be written again). Warm-up lines (negative steps) stay. Returns lines dropped."""
    dropped = 0
    for name in STEP_LOGS:
        path = run_dir / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines()
        keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= last_step]
        dropped += len(lines) - len(keep)
        path.write_text("".join(line + "\n" for line in keep))
    return dropped


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None
