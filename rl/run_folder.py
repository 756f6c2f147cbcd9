"""The run folder's files: where they live, appending to them, and rewinding them on resume so a
resumed run reads as one unbroken run (no step logged twice)."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from rl.errors import RunRefused, RunStopped
from rl.integrity import read_jsonl, verify_manifest

if TYPE_CHECKING:  # the file names below are imported by light readers (the dashboard, the learner)
    from rl.config import RunConfig

# The run folder's files and folders, named here once: every writer and reader imports these
# (docs/run-folder.md says what each holds).
CONFIG = "config.yaml"  # the resolved config (rl.config.dump_config); --resume reads it
TOKENIZER = "tokenizer"  # the tokenizer folder, in the run folder and in each checkpoint's hf/
GATE = "gate.json"  # the quality gate's reports
METRICS = "metrics.jsonl"  # a line of metrics per step (warm-up steps negative)
ROLLOUTS = "rollouts.jsonl"  # a line per sample played (rl.types.RolloutRecord)
MOE_LOAD = "moe_load.jsonl"  # the experts' load per MoE layer, a line per step
STEP_LOGS = (METRICS, ROLLOUTS, MOE_LOAD)  # one or more lines per step
EVAL_BEFORE = "eval_before.json"  # the held-out evaluation before RL
EVAL_AFTER = "eval_after.json"  # ... and after
EFFORT_PARETO = "effort_pareto.json"  # accuracy against tokens per effort level; its chart beside it (.png)
STATE = "state.json"  # the run's state: running, finished, failed, interrupted (write_state)
CHECKPOINTS = "checkpoints"  # checkpoints/step_N/, one per saved step
LATEST = "latest"  # checkpoints/latest: the newest step_N's name (also in a checkpoint.dir mirror)
CHECKPOINT_HF = "hf"  # checkpoints/step_N/hf/: the policy as a save_pretrained folder, its tokenizer/ inside
SCHEDULER = "scheduler.json"  # checkpoints/step_N/scheduler.json: the stream's position (StreamPosition)
RUN_STATES = ("running", "finished", "failed", "interrupted")
SIGNAL_EXIT_CODES = (130, 143)  # a run stopped by SIGINT or SIGTERM (rl.faults.SIGNAL_EXIT)

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
    marker = root / LATEST
    named = marker.read_text(errors="replace").strip() if marker.is_file() else None
    if named is not None and named not in {tag for _, tag in steps}:
        passed_over.append(f"{CHECKPOINTS}/{LATEST} names {named[:40]!r}, which is not there")
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


def write_state(run_dir: Path, state: str, **fields: Any) -> dict[str, Any]:
    """Set the run's state in state.json, atomically (a reader sees the old file or the new one):
    `state` one of RUN_STATES, with the fields given (e.g. `reason`, `resumed_at_step`) over those
    already there, the time, and the process and host that wrote it (a reader on the same host can
    tell a `running` run whose process is gone). Returns what was written."""
    assert state in RUN_STATES, state
    path = Path(run_dir) / STATE
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = None
    record = dict(old) if isinstance(old, dict) else {}
    now = time.time()
    record.setdefault("started", now)  # when the run first started; a resume adds `resumed`
    if state == "running":  # a new process: what the last one ended with no longer holds
        for key in ("ended", "reason", "exit_code") + (("resumed_at_step",) if "resumed" in fields else ()):
            record.pop(key, None)
    else:
        record["ended"] = now
    record.update(fields, state=state, updated=now, pid=os.getpid(), host=socket.gethostname())
    tmp = path.with_name(f".{STATE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(path)
    return record


def read_state(run_dir: Path) -> dict[str, Any] | None:
    """state.json as written by write_state; None where there is none or it does not parse."""
    try:
        record = json.loads((Path(run_dir) / STATE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_tracked(run_dir: Path, resume: bool, run: Callable[[], Any]) -> Any:
    """`run()` with the run's state in state.json: running from the start (a resume adds the time it
    resumed), then finished, or interrupted (SIGINT, SIGTERM: a RunStopped with their exit code),
    or failed with its one line (a RunStopped for a fault, a refused run, anything raised). Writing
    the state never hides what the run raised (a full disk may refuse it too)."""
    def state(name: str, **fields: Any) -> None:
        try:
            write_state(run_dir, name, **fields)
        except OSError as exc:
            log.warning(f"{STATE}: not written ({exc})")

    state("running", **({"resumed": time.time()} if resume else {}))
    try:
        result = run()
    except RunStopped as exc:
        state("interrupted" if exc.exit_code in SIGNAL_EXIT_CODES else "failed", reason=str(exc),
              exit_code=exc.exit_code)
        raise
    except KeyboardInterrupt:
        state("interrupted", reason="interrupted (SIGINT)", exit_code=130)
        raise
    except BaseException as exc:
        lines = str(exc).strip().splitlines()
        state("failed", reason=f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
              if not isinstance(exc, RunRefused) else str(exc), exit_code=1)
        raise
    state("finished")
    return result
