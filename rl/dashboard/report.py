"""`rl report RUN_DIR`: the dashboard's charts as PNG files (matplotlib, offline) and a markdown
summary a user pastes into a write-up: config, quality gate, before/after tables, curves."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rl.dashboard.model import RunData, part_order
from rl.dashboard import domains
from rl.dashboard.charts import MARKERS_UP_TO, OVERALL, Chart, Plot, Table, fmt, series_colours
from rl.dashboard.panels import PARETO_WINDOW, build_panels, effort_table, gate_table, heldout_table
from rl.metrics import family_member, family_of
from rl.dashboard.runfolder import is_run_folder
from rl.run_folder import CONFIG, METRICS

COLUMNS = 2
CHART_W, CHART_H, DPI = 6.4, 3.6, 110
SUMMARY_METRICS = [("reward", "rollout/reward"), ("pass rate", "rollout/pass_rate"),
                   ("response tokens", "rollout/response_tokens"), ("train-vs-rollout logprob gap", "train/mismatch"),
                   ("entropy", "train/entropy"), ("generation tokens/s", "rollout/tokens_per_s"),
                   ("step seconds", "time/step_s")]


log = logging.getLogger(__name__)


class ReportError(ValueError):
    """A run folder the report cannot be written for, as one line."""


def write_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write `report.md` and one PNG per panel with data into out_dir (RUN_DIR/report); its path."""
    if not is_run_folder(run_dir):
        raise ReportError(f"{run_dir} is not a run folder (no {CONFIG} or {METRICS})")
    run = RunData(run_dir)
    run.refresh(final=True)
    for problem in run.problems:  # also listed in the report; said here so no reader misses one
        log.warning(problem)
    out_dir = out_dir or run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# Run report: {run.name}", "",
             f"Run folder `{run_dir}`, report written {time.strftime('%Y-%m-%d %H:%M')}.", "",
             f"State: {run.state_text()}.", ""]  # state.json: running, finished, failed, interrupted
    lines += _config_section(run) + _gate_section(run) + _eval_section(run) + _summary_section(run)
    lines += ["## Curves", ""]
    not_recorded = []
    for panel in build_panels([run]):
        charts = [c for c in panel.charts if c.has_data]
        not_recorded += [c.title for c in panel.charts if not c.has_data]
        if charts:
            name = f"{panel.id}.png"
            draw_panel(charts, run.name, out_dir / name)
            lines += [f"### {panel.title}", "", f"![{panel.title}]({name})", ""]
    if not_recorded:
        lines += [f"Not recorded in this run: {'; '.join(not_recorded)}.", ""]
    if run.problems:
        lines += ["## Problems reading the run folder", ""] + [f"- {p}" for p in run.problems] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


# -- markdown ----------------------------------------------------------------------------------------
def markdown_table(table: Table) -> list[str]:
    if not table.rows:
        return ["(no data)", ""]
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    return out + [""]


def _config_section(run: RunData) -> list[str]:
    cfg = run.config
    if not cfg:
        return ["## Configuration", "", "(no config.yaml)", ""]
    def get(section: str, key: str):
        return cfg[section].get(key, "-") if isinstance(cfg.get(section), dict) else "-"
    envs = (domains.families_summary(run) if domains.has_families([run]) else
            ", ".join(f"{e.get('name')} (weight {e.get('weight', 1)})"
                      for e in cfg.get("envs", []) if isinstance(e, dict)))
    budgets = get("effort", "budgets")
    rows = [["model", f"{get('model', 'preset')} (vocabulary {get('model', 'vocab_size')})"],
            ["environments", envs or "-"],
            ["effort budgets (tokens per turn)", ", ".join(f"{k} {budgets[k]}" for k in sorted(budgets, key=part_order))
             if isinstance(budgets, dict) else "-"],
            ["GRPO steps", str(get("train", "steps"))],
            ["groups per step x group size", f"{get('rollout', 'groups_per_step')} x {get('rollout', 'group_size')}"],
            ["learning rate", str(get("train", "lr"))],
            ["clip (low / high / dual)", f"{get('train', 'eps_low')} / {get('train', 'eps_high')} / "
                                         f"{get('train', 'dual_clip')}"],
            ["KL coefficient", str(get("train", "kl_coef"))],
            ["loss aggregation", str(get("train", "loss_agg"))],
            ["warm-up steps", str(get("warmup", "steps"))],
            ["seed", str(cfg.get("seed", "-"))]]
    return (["## Configuration", ""] + markdown_table(Table("config", "", ["setting", "value"], rows))
            + ["<details><summary>Resolved config (config.yaml)</summary>", "", "```yaml",
               yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", "", "</details>", ""])


def _gate_section(run: RunData) -> list[str]:
    if not run.gate:
        return ["## Quality gate", "", "(no gate.json: the gate was off or has not run)", ""]
    if domains.has_families([run]):
        return ["## Quality gate", ""] + markdown_table(domains.gate_family_table(run))
    return ["## Quality gate", ""] + markdown_table(gate_table(run))


def _eval_section(run: RunData) -> list[str]:
    if run.eval_before is None and run.eval_after is None:
        return ["## Held-out evaluation", "", "(no eval_before.json / eval_after.json yet)", ""]
    if domains.has_families([run]):
        return (["## Held-out evaluation", "", "Reward per family and effort level, before -> after RL (± the "
                 "standard error after, over every sample of the family's domains):", ""]
                + markdown_table(domains.heldout_family_table(run)) + _domains_by_family(run)
                + ["Per effort level, all domains:", ""] + markdown_table(effort_table(run)))
    return (["## Held-out evaluation", "", "Reward per domain and effort level, before -> after RL:", ""]
            + markdown_table(heldout_table(run))
            + ["Per effort level, all domains:", ""] + markdown_table(effort_table(run)))


def _domains_by_family(run: RunData) -> list[str]:
    """Each family's domains, before -> after (all effort levels), folded away under the family."""
    table = run.eval_after or run.eval_before or {}
    by_family: dict[str, list[str]] = {}
    for domain in sorted(d for d in table if d != "all"):
        by_family.setdefault(family_of(domain), []).append(domain)
    out = []
    for family, names in by_family.items():
        rows = [[d] + [row[2] for row in domains.heldout_domain_rows(run, d) if row[1] == "all"] for d in names]
        out += [f"<details><summary>{family}: {len(names)} domains</summary>", ""]
        table = Table(f"heldout.{family}", "", ["domain", "all effort levels"], rows)
        out += markdown_table(table) + ["</details>", ""]
    return out


def _summary_section(run: RunData) -> list[str]:
    steps = len(run.grpo.rows)
    if not steps:
        return ["## Training", "", "(no GRPO steps in metrics.jsonl yet)", ""]
    k = max(1, min(PARETO_WINDOW, steps // 2))
    # a run of many domains: its families here, its best and worst domains in the table below
    per_domain = {d: key for d, key in run.grpo.matching("rollout/domain/*/reward").items() if not family_member(d)}
    per_domain.update(run.grpo.matching("rollout/family/*/reward"))
    wanted = SUMMARY_METRICS + [(f"reward, {domain}", key) for domain, key in per_domain.items()]
    rows = []
    for label, key in wanted:
        ys = run.grpo.series(key)[1]
        if ys:
            rows.append([label, fmt(sum(ys[:k]) / len(ys[:k])), fmt(sum(ys[-k:]) / len(ys[-k:]))])
    table = Table("summary", "", ["metric", f"first {k} steps", f"last {k} steps"], rows)
    intro = f"{steps} GRPO steps (means over the first and the last {k}):"
    ranking = []
    if domains.has_families([run]):
        best_worst = domains.ranking_table(run)
        ranking = [best_worst.title.split(": ", 1)[1].capitalize() + ":", ""] + markdown_table(best_worst)
    return ["## Training", "", intro, ""] + markdown_table(table) + ranking


# -- PNG -------------------------------------------------------------------------------------------
def draw_panel(charts: list[Chart], run: str, path: Path) -> None:
    rows = math.ceil(len(charts) / COLUMNS)
    cols = min(COLUMNS, len(charts))
    fig = Figure(figsize=(CHART_W * cols, CHART_H * rows), dpi=DPI, layout="constrained")
    for i, chart in enumerate(charts):
        ax = fig.add_subplot(rows, cols, i + 1)
        draw_chart(fig, ax, chart, chart.plots[run], series_colours(chart))
    fig.savefig(path)


def draw_chart(fig: Figure, ax, chart: Chart, plot: Plot, colours: dict[str, str]) -> None:
    ax.set_title(chart.title + (f" ({plot.caption})" if plot.caption else ""), fontsize=10)
    ax.set_xlabel(chart.x_label, fontsize=9)
    ax.set_ylabel(chart.y_label, fontsize=9)
    ax.tick_params(labelsize=8)
    if plot.heatmap is not None:
        h = plot.heatmap
        image = ax.imshow(h.z, aspect="auto", cmap="viridis", interpolation="nearest",
                          extent=(h.x[0] - 0.5, h.x[-1] + 0.5, len(h.y) - 0.5, -0.5) if h.x else None)
        ax.set_yticks(range(len(h.y)), h.y)
        fig.colorbar(image, ax=ax)
        return
    base: dict[float, float] = {}  # running total of the stacked lines at each x
    for line in plot.lines:
        colour = colours[line.name]
        if line.stack:
            lower = [base.get(x, 0.0) for x in line.x]
            upper = [lo + y for lo, y in zip(lower, line.y)]
            ax.fill_between(line.x, lower, upper, color=colour, alpha=0.6, label=line.name, linewidth=0)
            base.update(zip(line.x, upper))
            continue
        marker = "o" if "markers" in line.mode or len(line.x) <= MARKERS_UP_TO else None
        ax.plot(line.x, line.y, color=colour, marker=marker, markersize=3 if not line.labels else 6, label=line.name,
                linewidth=2.4 if line.name == OVERALL else 1.5)
        for x, y, text in zip(line.x, line.y, line.labels or []):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if chart.y_range is not None:
        ax.set_ylim(*chart.y_range)
    if chart.x_label.endswith("step"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    if plot.missing:
        ax.text(0.01, 0.01, "no data yet: " + ", ".join(plot.missing), transform=ax.transAxes, fontsize=7,
                color="#888", va="bottom")
