"""Held-out evaluation summaries: mean reward per domain and effort level (with its standard
error: two evaluations of one checkpoint differ by about that much), before vs after RL."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence

from rich.table import Table

from policy.effort import effort_order
from rl.types import Sample, episodes


def summarise_eval(samples: Sequence[Sample]) -> dict[str, Any]:
    """{"domain": {"effort": {"reward", "stderr", "pass_rate", "n", "tokens"}}} plus an "all" row and
    column. stderr: the standard error of the mean reward over the cell's samples."""
    cells: dict[tuple[str, str], list[tuple[Sample, int]]] = defaultdict(list)
    for s, length in episodes(list(samples)):  # each episode once, its length over all its segments
        for domain in (s.domain, "all"):
            for effort in (s.effort, "all"):
                cells[(domain, effort)].append((s, length))
    out: dict[str, Any] = defaultdict(dict)
    for (domain, effort), group in sorted(cells.items()):
        mean = sum(s.reward for s, _ in group) / len(group)
        var = sum((s.reward - mean) ** 2 for s, _ in group) / (len(group) - 1) if len(group) > 1 else 0.0
        out[domain][effort] = {
            "reward": mean,
            "stderr": math.sqrt(var / len(group)),
            "pass_rate": sum(s.passed for s, _ in group) / len(group),
            "tokens": sum(length for _, length in group) / len(group),
            "n": len(group),
        }
    return dict(out)


def eval_table(before: dict[str, Any] | None, after: dict[str, Any], title: str | None = None) -> Table:
    """A rich table: one row per domain, one column per effort level, `before -> after +- stderr`
    (or one evaluation's `reward +- stderr` when there is no `before`)."""
    efforts = sorted({e for row in after.values() for e in row if e != "all"}, key=effort_order) + ["all"]
    default = ("Held-out reward per domain and effort level (before RL -> after RL, +- standard error)"
               if before is not None else "Held-out reward per domain and effort level (+- standard error)")
    table = Table(title=title or default)
    table.add_column("domain")
    for effort in efforts:
        table.add_column(effort, justify="right")
    for domain in sorted(after, key=lambda d: (d == "all", d)):
        cells = []
        for effort in efforts:
            new = after[domain].get(effort)
            old = (before or {}).get(domain, {}).get(effort)
            if new is None:
                cells.append("-")
            elif old is None:
                cells.append(f"{new['reward']:.2f} +- {new.get('stderr', 0.0):.2f}")
            else:
                delta = new["reward"] - old["reward"]
                colour = "green" if delta > 0 else ("red" if delta < 0 else "white")
                cells.append(f"{old['reward']:.2f} -> [{colour}]{new['reward']:.2f}[/{colour}] "
                             f"+- {new.get('stderr', 0.0):.2f}")
        table.add_row(domain, *cells)
    return table


def effort_table(before: dict[str, Any] | None, after: dict[str, Any]) -> Table:
    """Reward against response length per effort level (all domains): what each budget buys."""
    table = Table(title="Reward and response tokens per effort level (all domains)")
    for column in ("effort", "reward", "tokens"):
        table.add_column(column, justify="right" if column != "effort" else "left")
    levels = sorted((e for e in after.get("all", {}) if e != "all"), key=effort_order)
    for effort in levels:
        new = after["all"][effort]
        old = (before or {}).get("all", {}).get(effort)
        if old is None:
            table.add_row(effort, f"{new['reward']:.2f}", f"{new['tokens']:.1f}")
        else:
            table.add_row(effort, f"{old['reward']:.2f} -> {new['reward']:.2f}", f"{old['tokens']:.1f} -> {new['tokens']:.1f}")
    return table
