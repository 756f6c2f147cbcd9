"""Held-out evaluation summaries: mean reward per domain and effort level, before vs after RL."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from rich.table import Table

from policy.effort import effort_order
from rl.types import Sample


def summarise_eval(samples: Sequence[Sample]) -> dict[str, Any]:
    """{"domain": {"effort": {"reward", "pass_rate", "n", "tokens"}}} plus an "all" row and column."""
    cells: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s in samples:
        for domain in (s.domain, "all"):
            for effort in (s.effort, "all"):
                cells[(domain, effort)].append(s)
    out: dict[str, Any] = defaultdict(dict)
    for (domain, effort), group in sorted(cells.items()):
        out[domain][effort] = {
            "reward": sum(s.reward for s in group) / len(group),
            "pass_rate": sum(s.passed for s in group) / len(group),
            "tokens": sum(s.response_tokens for s in group) / len(group),
            "n": len(group),
        }
    return dict(out)


def eval_table(before: dict[str, Any] | None, after: dict[str, Any]) -> Table:
    """A rich table: one row per domain, one column per effort level, `before -> after`."""
    efforts = sorted({e for row in after.values() for e in row if e != "all"}, key=effort_order) + ["all"]
    table = Table(title="Held-out reward per domain and effort level (before RL -> after RL)")
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
                cells.append(f"{new['reward']:.2f}")
            else:
                delta = new["reward"] - old["reward"]
                colour = "green" if delta > 0 else ("red" if delta < 0 else "white")
                cells.append(f"{old['reward']:.2f} -> [{colour}]{new['reward']:.2f}[/{colour}]")
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
