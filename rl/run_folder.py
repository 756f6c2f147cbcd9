"""The run folder's files: where they live, appending to them, and rewinding them on resume so a
resumed run reads as one unbroken run (no step logged twice)."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Iterable

from rl.config import RunConfig
from rl.errors import RunRefused
from rl.integrity import read_jsonl, verify_manifest

CHECKPOINTS = "checkpoints"
STEP_LOGS = ("metrics.jsonl", "rollouts.jsonl", "moe_load.jsonl")  # one or more lines per step

log = logging.getLogger(__name__)


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
    """The newest whole checkpoint (its manifest verifies) as (tag, step); None when there is none."""
    return _whole_checkpoint(run_dir)[0]


def is_checkpoint_dir(path: Path) -> bool:
    """A training checkpoint: RUN/checkpoints/step_N."""
    return path.parent.name == CHECKPOINTS and re.fullmatch(r"step_[0-9]+", path.name) is not None


def checkpoint_to_resume(run_dir: Path) -> tuple[tuple[str, int] | None, str | None]:
    """(the newest whole checkpoint, one line naming the newer ones passed over and why, or None).
    Refuses a run whose checkpoints are all torn: starting it again from scratch is the user's call."""
    found, passed_over = _whole_checkpoint(run_dir)
    if found is None and passed_over:
        raise RunRefused(f"cannot resume {run_dir}: no checkpoint is whole ({'; '.join(passed_over)}); "
                         f"remove {run_dir / CHECKPOINTS} to train this run again from the start")
    if not passed_over:
        return found, None
    return found, f"{'; '.join(passed_over)}: resuming from {found[0]}, the newest whole checkpoint"


def _whole_checkpoint(run_dir: Path) -> tuple[tuple[str, int] | None, list[str]]:
    """(newest checkpoint whose manifest verifies, a line for each newer one or a `latest` marker
    naming what is not there). Steps come from the folder names; `latest` only names the newest."""
    root = run_dir / CHECKPOINTS
    steps = sorted((int(p.name[5:]), p.name) for p in root.glob("step_*") if p.is_dir() and is_checkpoint_dir(p))
    passed_over = []
    marker = root / "latest"
    named = marker.read_text(errors="replace").strip() if marker.is_file() else None
    if named is not None and named not in {tag for _, tag in steps}:
        passed_over.append(f"{CHECKPOINTS}/latest names {named[:40]!r}, which is not there")
    for step, tag in reversed(steps):
        problem = verify_manifest(root / tag)
        if problem is None:
            return (tag, step), passed_over
        passed_over.append(f"{tag} is torn ({problem})")
    return None, passed_over


def append_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps(record, default=str) + "\n")


def rewind_step_logs(run_dir: Path, last_step: int) -> int:
    """Drop the records of steps after `last_step` (written after the checkpoint a run resumes from;
    they are about to be written again). Warm-up records (negative steps) stay. A torn last line or
    a line that is not a record is dropped with a warning. Returns the records dropped."""
    dropped = 0
    for name in STEP_LOGS:
        path = run_dir / name
        if not path.exists():
            continue
        records = read_jsonl(path, log.warning)
        keep = [r for r in records if _step_of(r, name) is not None and r["step"] <= last_step]
        dropped += len(records) - len(keep)
        tmp = path.with_name(f".{path.name}.rewind")
        tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in keep))
        tmp.replace(path)  # atomic: a crash here leaves the old file whole, not half of the new one
    return dropped


def _step_of(record: dict[str, Any], file: str) -> int | None:
    step = record.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    log.warning(f"{file}: a record without an integer 'step'; dropped")
    return None


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None
