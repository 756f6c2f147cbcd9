"""One run's data as the dashboard and the report see it, refreshed from its run folder."""
from __future__ import annotations

import math
import os
import re
import socket
from collections import deque
from pathlib import Path
from typing import Any

from kimi_vocab.effort import effort_order
from rl.dashboard.runfolder import ROLLOUTS_TAIL_BYTES, JsonlTail, json_file, yaml_file
from rl.run_folder import CONFIG, EVAL_AFTER, EVAL_BEFORE, GATE, METRICS, MOE_LOAD, ROLLOUTS, STATE
from rl.types import RolloutRecord

RECENT_SAMPLES = 2000  # rollouts kept in memory for the sample table
MAX_PROBLEMS = 20


def part_order(part: str) -> tuple[int, int, str]:
    """Sort key for a metric-name part: effort levels by effort, then numbers by value, then names."""
    return effort_order(part), int(part) if part.isdigit() else -1, part


def is_step(value: Any) -> bool:
    """An integer a run could have reached (charts draw steps as floats)."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53


def process_gone(record: dict[str, Any]) -> bool:
    """Whether the process that wrote a state record is known to be gone: written on this host by
    a pid that no longer exists. On another host it cannot be told: not gone."""
    pid, host = record.get("pid"), record.get("host")
    if not is_step(pid) or pid <= 0 or host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # someone else's process: it exists
        return False
    return False


def _number(value: int | float) -> float:
    """A metric as a float; an integer too large for one is shown as infinite rather than lost."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


class MetricTable:
    """Scalar metrics by step. A step logged again (a resumed run repeating the steps after its
    last checkpoint) replaces the earlier record and everything logged after it."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self._columns: dict[str, tuple[list[int], list[float]]] | None = None

    def add(self, step: int, record: dict[str, Any]) -> None:
        if self.rows and step <= max(self.rows):
            self.rows = {s: r for s, r in self.rows.items() if s < step}
        self.rows[step] = {k: _number(v) for k, v in record.items()
                           if k != "step" and isinstance(v, (int, float))}
        self._columns = None

    def clear(self) -> None:
        self.rows, self._columns = {}, None

    @property
    def columns(self) -> dict[str, tuple[list[int], list[float]]]:
        if self._columns is None:
            cols: dict[str, tuple[list[int], list[float]]] = {}
            for step in sorted(self.rows):
                for key, value in self.rows[step].items():
                    xs, ys = cols.setdefault(key, ([], []))
                    xs.append(step)
                    ys.append(value)
            self._columns = cols
        return self._columns

    def series(self, key: str) -> tuple[list[int], list[float]]:
        return self.columns.get(key, ([], []))

    def matching(self, pattern: str) -> dict[str, str]:
        """Keys fitting `pattern`, where `*` stands for one path part: {that part: key}, sorted.
        `matching("rollout/domain/*/reward")` -> {"math": "rollout/domain/math/reward", ...}."""
        regex = re.compile("^" + re.escape(pattern).replace(r"\*", "([^/]+)") + "$")
        found = {m.group(1): key for key in self.columns if (m := regex.match(key))}
        return dict(sorted(found.items(), key=lambda item: part_order(item[0])))

    def last(self, key: str) -> float | None:
        ys = self.series(key)[1]
        return ys[-1] if ys else None

    def window_mean(self, key: str, steps: int) -> float | None:
        ys = self.series(key)[1][-steps:]
        return sum(ys) / len(ys) if ys else None

    @property
    def last_step(self) -> int | None:
        return max(self.rows) if self.rows else None


class MoeLoad:
    """Expert load per MoE layer: the newest step's full table, and the imbalance (max / mean
    load) of every layer at every step, which is what is kept over time."""

    def __init__(self) -> None:
        self.latest_step: int | None = None
        self.layers: list[int] = []
        self.latest: list[list[float]] = []
        self.imbalance: dict[int, dict[int, float]] = {}  # step -> {layer: max/mean}

    def add(self, record: dict[str, Any]) -> str | None:
        try:
            step, layers, load = record["step"], [int(x) for x in record["layers"]], record["load"]
            rows = [[float(v) for v in row] for row in load]
        except (KeyError, TypeError, ValueError, OverflowError):
            return "moe_load.jsonl: a line lacks step / layers / load; skipped"
        if not is_step(step):
            return "moe_load.jsonl: a line has no integer 'step'; skipped"
        if len(rows) != len(layers):
            return f"moe_load.jsonl: step {step} has {len(layers)} layers but {len(rows)} load rows; skipped"
        for later in [s for s in self.imbalance if s >= step]:
            del self.imbalance[later]
        self.imbalance[step] = {layer: max(row) / (sum(row) / len(row)) if row and sum(row) > 0 else 0.0
                                for layer, row in zip(layers, rows)}
        if self.latest_step is None or step >= self.latest_step:
            self.latest_step, self.layers, self.latest = step, layers, rows
        return None

    def clear(self) -> None:
        self.__init__()


class RunData:
    """Everything one run folder holds that the views use; `refresh()` picks up what was written
    since the last call and says whether anything changed."""

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name or self.path.name
        self.config: dict[str, Any] = {}
        self.gate: dict[str, Any] = {}
        self.eval_before: dict[str, Any] | None = None
        self.eval_after: dict[str, Any] | None = None
        self.state: dict[str, Any] | None = None  # state.json: running, finished, failed, interrupted
        self.grpo = MetricTable()  # step >= 0
        self.warmup = MetricTable()  # step < 0: the supervised warm-up's sft/* metrics
        self.moe = MoeLoad()
        self.samples: deque[RolloutRecord] = deque(maxlen=RECENT_SAMPLES)  # rollouts.jsonl's last lines
        self.problems: deque[str] = deque(maxlen=MAX_PROBLEMS)
        self._files = {"config": yaml_file(self.path / CONFIG), "gate": json_file(self.path / GATE),
                       "eval_before": json_file(self.path / EVAL_BEFORE),
                       "eval_after": json_file(self.path / EVAL_AFTER), "state": json_file(self.path / STATE)}
        self._metrics = JsonlTail(self.path / METRICS)
        self._moe = JsonlTail(self.path / MOE_LOAD)
        self._rollouts = JsonlTail(self.path / ROLLOUTS, start_from_end=ROLLOUTS_TAIL_BYTES)

    def refresh(self, final: bool = False) -> bool:
        """`final`: the run has ended (a report), so a last line still unfinished is a torn one."""
        changed = False
        for attr, watched in self._files.items():
            file_changed, value, problem = watched.read()
            if problem:
                self._problem(problem)
            if file_changed:
                empty: Any = {} if attr in ("config", "gate") else None
                setattr(self, attr, value if isinstance(value, dict) else empty)
                changed = True
        changed |= self._tail(self._metrics, self._add_metrics, self._clear_metrics, final)
        changed |= self._tail(self._moe, self._add_moe, self.moe.clear, final)
        changed |= self._tail(self._rollouts, self._add_sample, self.samples.clear, final)
        return changed

    def _tail(self, tail: JsonlTail, add, clear, final: bool) -> bool:
        records, replaced, problems = tail.read(final)
        for problem in problems:
            self._problem(problem)
        if replaced:
            clear()
        for record in records:
            add(record)
        return bool(records) or replaced

    def _add_metrics(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not is_step(step):
            self._problem("metrics.jsonl: a line has no integer 'step'; skipped")
            return
        (self.warmup if step < 0 else self.grpo).add(step, record)

    def _clear_metrics(self) -> None:
        self.grpo.clear()
        self.warmup.clear()

    def _add_sample(self, record: RolloutRecord) -> None:
        # as read from the file: the views read it with .get, an older run's lines may lack a key
        if not isinstance(record.get("transcript", []), list):
            self._problem("rollouts.jsonl: a sample's transcript is not a list of messages; skipped")
            return
        self.samples.append(record)

    def _add_moe(self, record: dict[str, Any]) -> None:
        problem = self.moe.add(record)
        if problem:
            self._problem(problem)

    def _problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    # -- what the views ask -----------------------------------------------------------------------
    @property
    def planned_steps(self) -> int | None:
        train = self.config.get("train")
        steps = train.get("steps") if isinstance(train, dict) else None
        return steps if isinstance(steps, int) else None

    def state_text(self) -> str:
        """The run's state in words: `running`, `finished`, `failed: <its line>`, `interrupted: <its
        line>`, each with `, resumed at step N` after a resume; a `running` run whose process is gone
        (killed: SIGKILL, a lost machine) is `stopped`; `unknown` for a folder without a readable state.json."""
        record = self.state
        name = record.get("state") if isinstance(record, dict) else None
        if not isinstance(name, str):
            return "unknown (no readable state.json)"
        if name == "running" and process_gone(record):
            name = "stopped (its process is gone: killed?)"
        resumed = record.get("resumed_at_step")
        if is_step(resumed):
            name += f", resumed at step {resumed}"
        reason = record.get("reason")
        if name.startswith(("failed", "interrupted")) and isinstance(reason, str) and reason:
            name += f": {reason}"
        return name

    def last_write(self) -> float | None:
        """When the trainer last wrote one of the files read here (seconds since the epoch)."""
        times = []
        for path in self.path.glob("*.json*"):
            try:
                times.append(path.stat().st_mtime)
            except FileNotFoundError:  # replaced meanwhile
                pass
        return max(times, default=None)

    def effort_levels(self, evaluated: bool = False) -> list[str]:
        """Effort levels seen in the metrics or the held-out tables (only these when `evaluated`),
        lowest effort first."""
        seen = set() if evaluated else set(self.grpo.matching("rollout/effort/*/reward"))
        for table in (self.eval_before or {}, self.eval_after or {}):
            for by_effort in table.values():
                if isinstance(by_effort, dict):
                    seen |= set(by_effort) - {"all"}
        return sorted(seen, key=part_order)
