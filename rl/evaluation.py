"""Held-out evaluation summaries: mean reward per domain and effort level (with its standard
error: two evaluations of one checkpoint differ by about that much), before vs after RL; and the
effort Pareto: accuracy against tokens used per level, as a table, JSON and a PNG chart."""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

from kimi_vocab.effort import effort_order
from rl.metrics import budget_stats
from rl.types import Sample, episodes


def summarise_eval(samples: Sequence[Sample]) -> dict[str, Any]:
    """{"domain": {"effort": {"reward", "stderr", "pass_rate", "n", "tokens"}}} plus an "all" row and
    column; with effort budgets also the budget and rl.metrics.budget_stats (reasoning tokens,
    within_budget, forced, budget_cut, budget_used). stderr: the standard error of the mean reward
    over the cell's samples."""
    cells: dict[tuple[str, str], list[tuple[Sample, int]]] = defaultdict(list)
    members: dict[tuple[str, str], list[Sample]] = defaultdict(list)
    for s, length in episodes(list(samples)):  # each episode once, its length over all its segments
        for domain in (s.domain, "all"):
            for effort in (s.effort, "all"):
                cells[(domain, effort)].append((s, length))
    for s in samples:
        for domain in (s.domain, "all"):
            for effort in (s.effort, "all"):
                members[(domain, effort)].append(s)
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
        budgets = [s.budget for s, _ in group if s.budget > 0]
        if budgets:
            out[domain][effort].update(budget=sum(budgets) / len(budgets), **budget_stats(members[(domain, effort)]))
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


def effort_table(before: dict[str, Any] | None, after: dict[str, Any], domain: str = "all") -> Table:
    """Reward against tokens used per effort level: what each budget buys (with budgets: the budget,
    the reasoning tokens among the tokens, and the share of episodes that ended within it)."""
    table = Table(title=f"Reward and tokens used per effort level ({'all domains' if domain == 'all' else domain})")
    levels = sorted((e for e in after.get(domain, {}) if e != "all"), key=effort_order)
    budgeted = any("budget" in after[domain][e] for e in levels)
    columns = ["effort", "reward", "accuracy", "tokens"] + (["reasoning", "within budget", "budget"] if budgeted else [])
    for column in columns:
        table.add_column(column, justify="right" if column != "effort" else "left")

    def cell(key: str, new: dict, old: dict | None, fmt: str) -> str:
        if key not in new:
            return "-"
        if old is None or key not in old:
            return format(new[key], fmt)
        return f"{format(old[key], fmt)} -> {format(new[key], fmt)}"

    for effort in levels:
        new, old = after[domain][effort], (before or {}).get(domain, {}).get(effort)
        row = [effort, cell("reward", new, old, ".2f") + f" +- {new.get('stderr', 0.0):.2f}",
               cell("pass_rate", new, old, ".2f"), cell("tokens", new, old, ".1f")]
        if budgeted:
            row += [cell("reasoning_tokens", new, old, ".1f"), cell("within_budget", new, old, ".0%"),
                    f"{new['budget']:.0f}" if "budget" in new else "-"]
        table.add_row(*row)
    return table


def effort_pareto(summary: Mapping[str, Any], domain: str = "all") -> dict[str, Any]:
    """Accuracy against tokens used, one point per effort level in order, and whether the levels
    order as they should: tokens strictly increasing and reward never decreasing with the level."""
    levels = sorted((e for e in summary.get(domain, {}) if e != "all"), key=effort_order)
    points = []
    for level in levels:
        c = summary[domain][level]
        n = max(int(c["n"]), 1)
        points.append({"effort": level, "accuracy": c["pass_rate"],
                       "accuracy_stderr": math.sqrt(c["pass_rate"] * (1 - c["pass_rate"]) / n),
                       "reward": c["reward"], "reward_stderr": c.get("stderr", 0.0), "tokens": c["tokens"],
                       **{k: c[k] for k in ("reasoning_tokens", "within_budget", "forced", "budget_cut", "budget")
                          if k in c},
                       "n": n})
    pairs = list(zip(points, points[1:]))
    return {"domain": domain, "points": points,
            "tokens_increasing": all(b["tokens"] > a["tokens"] for a, b in pairs),
            "reward_non_decreasing": all(b["reward"] >= a["reward"] for a, b in pairs)}


def write_pareto(summaries: Mapping[str, Mapping[str, Any]], path: Path, title: str = "") -> list[Path]:
    """The effort Pareto of each labelled summary ("before RL", "after RL", a checkpoint), every domain
    and "all": `path` (.json) and the chart of the "all" rows beside it (.png). Returns the files."""
    path = Path(path)
    data = {label: {domain: effort_pareto(summary, domain) for domain in summary}
            for label, summary in summaries.items()}
    path.write_text(json.dumps(data, indent=1))
    png = path.with_suffix(".png")
    _pareto_chart({label: d["all"] for label, d in data.items() if "all" in d}, png, title)
    return [path, png]


def _pareto_chart(curves: Mapping[str, dict[str, Any]], png: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=110)
    ax = fig.add_subplot()
    for label, curve in curves.items():
        pts = curve["points"]
        xs, ys = [p["tokens"] for p in pts], [p["accuracy"] for p in pts]
        ax.errorbar(xs, ys, yerr=[p["accuracy_stderr"] for p in pts], marker="o", capsize=3, label=label)
        for p in pts:
            ax.annotate(p["effort"], (p["tokens"], p["accuracy"]), textcoords="offset points", xytext=(4, -12),
                        fontsize=8)
    ax.set_xlabel("tokens used per episode (reasoning + response)")
    ax.set_ylabel("held-out accuracy (pass rate)")
    ax.set_title(title or "Accuracy against tokens used, per effort level", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)


def pareto_table(curves: Mapping[str, Mapping[str, Any]]) -> Table:
    """The Pareto points of each labelled curve (all domains): accuracy and tokens per level."""
    table = Table(title="Accuracy against tokens used per effort level (all domains)")
    for column in ("run", "effort", "accuracy", "reward", "tokens", "reasoning", "within budget"):
        table.add_column(column, justify="left" if column in ("run", "effort") else "right")
    for label, curve in curves.items():
        for p in curve["points"]:
            table.add_row(label, p["effort"], f"{p['accuracy']:.2f} +- {p['accuracy_stderr']:.2f}",
                          f"{p['reward']:.2f}", f"{p['tokens']:.1f}",
                          f"{p['reasoning_tokens']:.1f}" if "reasoning_tokens" in p else "-",
                          f"{p['within_budget']:.0%}" if "within_budget" in p else "-")
    return table
