"""Views of runs over many domains: families instead of domains in tables, the best and worst domains by
recent reward, one domain's curves (the picker), the held-out table by family and the gate by family.

A family's domain is named FAMILY:member (envs.families); a domain outside any family is its own. A
family's held-out cell pools its domains' samples exactly: each domain's mean, standard error and count
give back its sums of rewards and of squares."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from rl.dashboard.charts import Chart, Line, Plot, Table, fmt
from rl.dashboard.model import RunData
from rl.metrics import family_member, family_of

BEST_WORST = 10  # domains at each end of the ranking
RANK_STEPS = 30  # GRPO steps the ranking's rewards are averaged over (a domain is drawn now and then)


def run_domains(run: RunData) -> list[str]:
    """The run's domains: its config's environments, else what its metrics and held-out tables name."""
    names = {e.get("name") for e in run.config.get("envs", []) if isinstance(e, dict)} - {None}
    if not names:
        names = set(run.grpo.matching("rollout/domain/*/reward"))
        names |= {d for table in (run.eval_before or {}, run.eval_after or {}) for d in table if d != "all"}
    return sorted(str(n) for n in names)


def has_families(runs: list[RunData]) -> bool:
    return any(family_member(d) for run in runs for d in run_domains(run))


def family_weights(run: RunData) -> dict[str, tuple[int, float]]:
    """{family: (domains, summed weight)} of the run's config, in name order."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in run.config.get("envs", []):
        if isinstance(e, dict) and e.get("name"):
            row = out[family_of(str(e["name"]))]
            row[0] += 1
            weight = e.get("weight", 1.0)
            row[1] += weight if isinstance(weight, (int, float)) else 0.0
    return {f: (int(n), w) for f, (n, w) in sorted(out.items())}


def recent_rewards(run: RunData, steps: int = RANK_STEPS) -> dict[str, tuple[float, float]]:
    """{domain: (mean reward, episodes)} over the run's last `steps` steps, each step's mean weighted by
    its episodes (a step without the `episodes` count weighs 1)."""
    last = run.grpo.last_step
    if last is None:
        return {}
    out = {}
    for domain, key in run.grpo.matching("rollout/domain/*/reward").items():
        xs, ys = run.grpo.series(key)
        counts = dict(zip(*run.grpo.series(f"rollout/domain/{domain}/episodes")))
        pairs = [(y, counts.get(x, 1.0)) for x, y in zip(xs, ys) if x > last - steps]
        n = sum(w for _, w in pairs)
        if n:
            out[domain] = (sum(y * w for y, w in pairs) / n, n)
    return out


def _heldout(run: RunData, domain: str) -> str:
    def get(table):
        value = (table or {}).get(domain, {}).get("all", {}).get("reward")
        return value if isinstance(value, (int, float)) else None
    b, a = get(run.eval_before), get(run.eval_after)
    return "-" if b is None and a is None else (f"{fmt(b)} -> {fmt(a)}" if a is not None else fmt(b))


def ranking_table(run: RunData, n: int = BEST_WORST, steps: int = RANK_STEPS) -> Table:
    """The best and the worst `n` domains by recent training reward, with their held-out reward."""
    ranked = sorted(recent_rewards(run, steps).items(), key=lambda kv: (-kv[1][0], kv[0]))
    ends = [("best", i, kv) for i, kv in enumerate(ranked[:n])]
    ends += [("worst", len(ranked) - 1 - i, kv) for i, kv in enumerate(ranked[::-1][:n])
             if len(ranked) - 1 - i >= n]  # a short ranking lists each domain once
    rows = [[f"{end} {rank + 1}", domain, family_of(domain), fmt(reward), f"{episodes:g}", _heldout(run, domain)]
            for end, rank, (domain, (reward, episodes)) in ends]
    return Table(f"ranking.{run.name}", f"{run.name}: best and worst {n} of {len(ranked)} domains trained on "
                 f"(reward over the last {steps} steps)",
                 ["rank", "domain", "family", "reward", "episodes", "held-out before -> after"], rows)


def pool(cells: list[dict[str, Any]]) -> dict[str, float] | None:
    """One cell of several (reward, stderr, n, pass_rate, tokens): the mean and standard error of all
    their samples together, exactly (stderr = sqrt(sample variance / n) in each)."""
    cells = [c for c in cells
             if isinstance(c.get("reward"), (int, float)) and isinstance(c.get("n"), int) and c["n"] > 0]
    n = sum(c["n"] for c in cells)
    if not n:
        return None
    total = sum(c["reward"] * c["n"] for c in cells)
    squares = sum(c.get("stderr", 0.0) ** 2 * c["n"] * (c["n"] - 1) + c["n"] * c["reward"] ** 2 for c in cells)
    mean = total / n
    var = max(0.0, (squares - n * mean ** 2) / (n - 1)) if n > 1 else 0.0
    out = {"reward": mean, "stderr": math.sqrt(var / n), "n": n}
    for key in ("pass_rate", "tokens"):
        if all(isinstance(c.get(key), (int, float)) for c in cells):
            out[key] = sum(c[key] * c["n"] for c in cells) / n
    return out


def family_eval(table: dict[str, Any] | None) -> dict[str, dict[str, dict[str, float]]]:
    """An eval_*.json table (domain -> effort -> cell) pooled by family; "all" kept as it is."""
    if not table:
        return {}
    by_family: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for domain, row in table.items():
        if domain == "all" or not isinstance(row, dict):
            continue
        for effort, cell in row.items():
            if isinstance(cell, dict):
                by_family[family_of(domain)][effort].append(cell)
    out = {f: {e: c for e, cells in row.items() if (c := pool(cells)) is not None} for f, row in by_family.items()}
    if isinstance(table.get("all"), dict):
        out["all"] = table["all"]
    return out


def _cell(before: dict | None, after: dict | None) -> str:
    b = before.get("reward") if before else None
    a = after.get("reward") if after else None
    if a is None and b is None:
        return "-"
    text = f"{fmt(b)} -> {fmt(a)}" if b is not None and a is not None else fmt(a if a is not None else b)
    cell = after or before
    return f"{text} ± {cell.get('stderr', 0.0):.2f} (n={cell.get('n', '-')})"


def heldout_family_table(run: RunData) -> Table:
    """Held-out reward per family x effort level, before -> after RL, ± the standard error after."""
    before, after = family_eval(run.eval_before), family_eval(run.eval_after)
    source = after or before
    domains = defaultdict(int)
    for d in (run.eval_after or run.eval_before or {}):
        if d != "all":
            domains[family_of(d)] += 1
    levels = run.effort_levels(evaluated=True) + ["all"]
    families = sorted(f for f in source if f != "all") + (["all"] if "all" in source else [])
    rows = [[f, str(domains[f]) if f != "all" else str(sum(domains.values()))]
            + [_cell(before.get(f, {}).get(lvl), after.get(f, {}).get(lvl)) for lvl in levels] for f in families]
    return Table(f"heldout.{run.name}", f"{run.name}: held-out reward per family, before -> after RL "
                 f"(± standard error, samples)", ["family", "domains"] + levels, rows)


def heldout_domain_rows(run: RunData, domain: str) -> list[list[str]]:
    """One domain's held-out cells per effort level, before -> after."""
    levels = run.effort_levels(evaluated=True) + ["all"]
    return [[run.name, lvl, _cell((run.eval_before or {}).get(domain, {}).get(lvl),
                                  (run.eval_after or {}).get(domain, {}).get(lvl))] for lvl in levels]


def gate_family_table(run: RunData) -> Table:
    """The quality gate per family: domains checked, passed, taken from the cache, and which failed."""
    by_family: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for env, report in sorted(run.gate.items()):
        if isinstance(report, dict):
            by_family[family_of(env)].append((env, report))
    rows = []
    for family, reports in sorted(by_family.items()):
        failed = [env for env, r in reports if not r.get("ok")]
        seconds = sum(r.get("gate_s") or 0.0 for _, r in reports if not r.get("cached"))
        rows.append([family, str(len(reports)), str(len(reports) - len(failed)),
                     str(sum(1 for _, r in reports if r.get("cached"))), f"{seconds:.1f}",
                     "; ".join(f"{env}: {'; '.join(r.get('reasons') or [])}" for env, r in reports if not r.get("ok"))
                     or "-"])
    return Table(f"gate.{run.name}", f"{run.name}: quality gate per family",
                 ["family", "domains", "passed", "from the cache", "gate s (checked)", "failed"], rows)


def domain_chart(runs: list[RunData], domain: str) -> Chart:
    """One domain's reward and pass rate at the steps that drew it, beside its family's reward."""
    plots = {}
    for run in runs:
        plot = Plot()
        for label, key in (("reward", f"rollout/domain/{domain}/reward"),
                           ("pass rate", f"rollout/domain/{domain}/pass_rate"),
                           (f"family {family_of(domain)}", f"rollout/family/{family_of(domain)}/reward")):
            xs, ys = run.grpo.series(key)
            if xs:
                plot.lines.append(Line(label, xs, ys, mode="markers" if label != f"family {family_of(domain)}"
                                       else "lines"))
            else:
                plot.missing.append(key)
        plots[run.name] = plot
    return Chart(f"domain.{domain}", f"Domain {domain}: reward and pass rate at the steps that drew it",
                 "GRPO step", "reward", plots, y_range=(0, 1))


def families_summary(run: RunData) -> str:
    """`math x49 (weight 6), lookup x32 (weight 32)` for the config's environments."""
    return ", ".join(f"{f} x{n} (weight {w:g})" if n > 1 else f"{f} ({w:g})"
                     for f, (n, w) in family_weights(run).items())
