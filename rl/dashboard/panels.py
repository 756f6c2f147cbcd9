"""What the dashboard and the report show: panels of charts and tables built from runs' data.

The charts here are descriptions (`charts`: lines, heatmaps, which metric each comes from, which
expected metric has no data yet); `plotly_render` draws them in the browser and `report` with
matplotlib. A chart holds one plot per run, so several runs sit side by side.
"""
from __future__ import annotations

import time
from typing import Callable

from rl.dashboard import domains
from rl.dashboard.charts import Chart, Heatmap, Line, Panel, Plot, Table, fmt
from rl.dashboard.model import MetricTable, RunData
from rl.run_folder import MOE_LOAD
from rl.metrics import family_member, family_of
from rl.types import EPISODE_PHASES

PARETO_WINDOW = 10  # GRPO steps averaged for the rollout points of the effort Pareto chart
Want = tuple[str, str]  # (label, metric key); a `*` in the key stands for one name part, `{}` in the label


def _plot(table: MetricTable, wants: list[Want], stacked: bool, pool_members: str | None) -> Plot:
    """A family's domains (`*` matching `math:add-9x2`) are left out (the domain picker shows one), or with
    pool_members ("mean" or "sum") drawn as one line per family: its domains' mean or sum at each step."""
    plot = Plot()
    for label, key in wants:
        found = table.matching(key) if "*" in key else ({label: key} if key in table.columns else {})
        if not found:
            plot.missing.append(key)
        pooled: dict[str, dict[int, list[float]]] = {}
        for part, metric in found.items():
            xs, ys = table.series(metric)
            if not family_member(part):
                plot.lines.append(Line(label.format(part) if "*" in key else label, xs, ys, stack=stacked))
            elif pool_members:
                by_step = pooled.setdefault(family_of(part), {})
                for x, y in zip(xs, ys):
                    by_step.setdefault(x, []).append(y)
        for family, by_step in sorted(pooled.items()):
            steps = sorted(by_step)
            ys = [sum(by_step[x]) / (len(by_step[x]) if pool_members == "mean" else 1) for x in steps]
            plot.lines.append(Line(label.format(f"{family} (domains' {pool_members})"), steps, ys, stack=stacked))
    return plot


def lines_chart(chart_id: str, title: str, y_label: str, runs: list[RunData], wants: list[Want],
                y_range: tuple[float, float] | None = None, stacked: bool = False,
                table: Callable[[RunData], MetricTable] = lambda run: run.grpo, x_label: str = "GRPO step",
                pool_members: str | None = None) -> Chart:
    return Chart(chart_id, title, x_label, y_label,
                 {run.name: _plot(table(run), wants, stacked, pool_members) for run in runs}, y_range)


# -- panels ----------------------------------------------------------------------------------------
def runs_panel(runs: list[RunData]) -> Panel:
    rows = []
    for run in runs:
        cfg = run.config
        envs = (domains.families_summary(run) if domains.has_families([run]) else
                ", ".join(f"{e.get('name')} ({e.get('weight', 1)})"
                          for e in cfg.get("envs", []) if isinstance(e, dict)))
        done = run.grpo.last_step
        steps = f"{0 if done is None else done + 1} / {fmt(run.planned_steps)}"
        warmup = -min(run.warmup.rows) if run.warmup.rows else 0  # the first warm-up step is -steps
        held = _cell(run.eval_before, run.eval_after, "all", "all", "reward")
        written = run.last_write()
        rows.append([run.name, run.state_text(), str(run.path), str(cfg.get("model", {}).get("preset", "-")),
                     envs or "-", steps,
                     str(warmup), fmt(run.grpo.window_mean("rollout/reward", PARETO_WINDOW)), held,
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written)) if written else "-",
                     "; ".join(run.problems) or "none"])
    columns = ["run", "state", "folder", "model", "environments / families (weight)", "GRPO steps", "warm-up steps",
               f"reward (last {PARETO_WINDOW} steps)", "held-out reward before -> after", "last write", "problems"]
    return Panel("runs", "Runs", tables=[Table("runs.table", "Runs", columns, rows)])


def rewards_panel(runs: list[RunData]) -> Panel:
    # a run of many domains: one line per family (its domains in the Domains panel and the picker)
    charts = [
        lines_chart("rewards.domain_reward", "Reward per domain (per family)", "reward", runs,
                    [("all", "rollout/reward"), ("{}", "rollout/domain/*/reward"), ("{}", "rollout/family/*/reward")]),
        lines_chart("rewards.domain_pass", "Pass rate per domain (per family)", "pass rate", runs,
                    [("all", "rollout/pass_rate"), ("{}", "rollout/domain/*/pass_rate"),
                     ("{}", "rollout/family/*/pass_rate")], y_range=(0, 1)),
        lines_chart("rewards.effort_reward", "Reward per effort level", "reward", runs,
                    [("all", "rollout/reward"), ("{}", "rollout/effort/*/reward")]),
        lines_chart("rewards.effort_pass", "Pass rate per effort level", "pass rate", runs,
                    [("all", "rollout/pass_rate"), ("{}", "rollout/effort/*/pass_rate")], y_range=(0, 1)),
    ]
    return Panel("rewards", "Reward and pass rate", charts,
                 [domains.heldout_family_table(run) if domains.has_families([run]) else heldout_table(run)
                  for run in runs])


def effort_panel(runs: list[RunData]) -> Panel:
    pareto = Chart("effort.pareto", "Effort Pareto: response length vs reward per effort level",
                   "response tokens", "reward", {run.name: _pareto(run) for run in runs})
    charts = [
        pareto,
        lines_chart("effort.tokens", "Response tokens per effort level", "tokens", runs,
                    [("all", "rollout/response_tokens"), ("{}", "rollout/effort/*/response_tokens")]),
        lines_chart("effort.truncated", "Responses cut by the token budget", "fraction of samples", runs,
                    [("truncated", "rollout/truncated")], y_range=(0, 1)),
    ]
    return Panel("effort", "Effort and response length", charts)


def _pareto(run: RunData) -> Plot:
    """Per source (recent rollouts, held-out before, held-out after) one line through the effort
    levels in (mean response tokens, mean reward)."""
    levels = run.effort_levels()
    plot = Plot()
    points = [(lvl, run.grpo.window_mean(f"rollout/effort/{lvl}/response_tokens", PARETO_WINDOW),
               run.grpo.window_mean(f"rollout/effort/{lvl}/reward", PARETO_WINDOW)) for lvl in levels]
    sources = [(f"rollouts, last {PARETO_WINDOW} steps", points)]
    for name, table in (("held-out before RL", run.eval_before), ("held-out after RL", run.eval_after)):
        cells = (table or {}).get("all", {})
        sources.append((name, [(lvl, cells.get(lvl, {}).get("tokens"), cells.get(lvl, {}).get("reward"))
                               for lvl in levels]))
    for name, pts in sources:
        pts = [(lvl, x, y) for lvl, x, y in pts if x is not None and y is not None]
        if pts:
            plot.lines.append(Line(name, [p[1] for p in pts], [p[2] for p in pts], mode="lines+markers+text",
                                   labels=[p[0] for p in pts]))
        else:
            plot.missing.append(name)
    return plot


def throughput_panel(runs: list[RunData]) -> Panel:
    charts = [
        lines_chart("throughput.samples", "Samples per second", "samples/s", runs,
                    [("samples/s", "throughput/samples_per_s")]),
        lines_chart("throughput.tokens", "Tokens per second", "tokens/s", runs,
                    [("whole step", "throughput/tokens_per_s"), ("rollout generation", "rollout/tokens_per_s")]),
        lines_chart("throughput.time_split", "Time per step: rollout / learner / weight sync", "seconds", runs,
                    [("rollout", "time/rollout_s"), ("learner", "time/train_s"), ("weight sync", "time/sync_s")],
                    stacked=True),
        # GPU busy: NVML's kernel-time fraction over the step (rl/gpu_busy.py; GPU runs only)
        lines_chart("throughput.idle", "Idle fraction, and the GPU's busy fraction", "fraction of the step", runs,
                    [("learner idle", "time/learner_idle_frac"), ("rollout idle", "time/rollout_idle_frac"),
                     ("GPU busy", "gpu/busy_frac")],
                    y_range=(0, 1)),
        # small batches with an idle engine: rollout waits on the episodes; big batches with a busy
        # engine: on the engine's step time
        lines_chart("throughput.engine_batch", "Rollout engine: tokens sampled per forward step", "tokens", runs,
                    [("per step", "engine/tokens_per_step")]),
        lines_chart("throughput.engine_step", "Rollout engine: time per forward step", "milliseconds", runs,
                    [("whole step", "engine/step_ms"), ("launching it (host)", "engine/launch_ms"),
                     ("waiting on the device", "engine/wait_ms")]),
        # an episode long in "tools" or "grade" waits on its environment; in "generate", on the engine
        lines_chart("throughput.episode_phases", "Episode wall time by phase (mean per episode)", "seconds", runs,
                    [(phase, f"rollout/episode_s/{phase}") for phase in EPISODE_PHASES],
                    stacked=True),
    ]
    return Panel("throughput", "Throughput", charts)


def mismatch_panel(runs: list[RunData]) -> Panel:
    charts = [
        lines_chart("mismatch.gap", "Train-vs-rollout logprob gap", "mean |logprob gap|", runs,
                    [("all", "train/mismatch"), ("{}", "train/mismatch/domain/*")], pool_members="mean"),
        lines_chart("mismatch.is_weights", "Importance weights (learner / rollout probability)", "weight", runs,
                    [("mean", "train/is_weight_mean"), ("min", "train/is_weight_min"),
                     ("max", "train/is_weight_max"), ("std", "train/is_weight_std")]),
        lines_chart("mismatch.masked", "Clipped and masked tokens", "fraction of tokens", runs,
                    [("clipped", "train/clipped"), ("IS-masked", "train/is_masked_frac")], y_range=(0, 1)),
        lines_chart("mismatch.staleness", "Staleness (weight versions behind the learner)", "versions", runs,
                    [("mean", "async/staleness_mean"), ("max", "async/staleness_max"),
                     ("weight lag", "rollout/weight_lag")]),
        lines_chart("mismatch.staleness_dist", "Samples by staleness", "fraction of samples", runs,
                    [("staleness {}", "async/staleness/*")], y_range=(0, 1), stacked=True),
        lines_chart("mismatch.routing", "Routing agreement (rollout vs learner experts)", "agreement", runs,
                    [("agreement", "train/routing_agreement")], y_range=(0, 1)),
    ]
    return Panel("mismatch", "Train-vs-rollout mismatch", charts)


def learner_panel(runs: list[RunData]) -> Panel:
    charts = [
        lines_chart("learner.loss", "Policy loss", "loss", runs, [("loss", "train/loss")]),
        lines_chart("learner.entropy", "Entropy and KL", "nats", runs,
                    [("entropy", "train/entropy"), ("KL", "train/kl")]),
        lines_chart("learner.grad_norm", "Gradient norm and |advantage|", "value", runs,
                    [("grad norm", "train/grad_norm"), ("|advantage|", "train/advantage_abs"),
                     ("ratio", "train/ratio")]),
        lines_chart("learner.flops", "Learner model FLOP rate (6 x active parameters per token)", "TFLOP/s", runs,
                    [("TFLOP/s", "train/model_tflops_per_s")]),
        lines_chart("learner.mfu", "Learner MFU (where the device's peak is known)", "fraction of peak", runs,
                    [("MFU", "train/mfu")], y_range=(0, 1)),
        lines_chart("learner.groups", "Groups filtered (uniform reward) and skipped steps", "count", runs,
                    [("groups filtered", "train/groups_filtered"), ("step skipped", "train/skipped")]),
        lines_chart("learner.warmup", "Supervised warm-up", "loss", runs, [("loss", "sft/loss")],
                    table=lambda run: run.warmup, x_label="warm-up step"),
        lines_chart("learner.warmup_time", "Supervised warm-up step time (the first ones compile)", "seconds", runs,
                    [("step", "sft/step_s")], table=lambda run: run.warmup, x_label="warm-up step"),
    ]
    return Panel("learner", "Learner", charts)


def moe_panel(runs: list[RunData]) -> Panel:
    latest, imbalance = {}, {}
    for run in runs:
        moe = run.moe
        if moe.latest_step is not None:
            latest[run.name] = Plot(heatmap=Heatmap(moe.latest, list(range(len(moe.latest[0]) if moe.latest else 0)),
                                                    [f"layer {layer}" for layer in moe.layers]),
                                    caption=f"step {moe.latest_step}")
        else:
            latest[run.name] = Plot(missing=[MOE_LOAD])
        imbalance[run.name] = _imbalance(run)
    return Panel("moe", "MoE expert load", [
        Chart("moe.latest", "Expert load at the newest step (fraction of routed tokens)", "expert", "layer", latest),
        Chart("moe.imbalance", "Load imbalance per layer (max / mean expert load)", "GRPO step", "layer", imbalance),
    ])


def _imbalance(run: RunData) -> Plot:
    """step x layer heatmap of max/mean load, from moe_load.jsonl or else the moe/imbalance metrics."""
    by_step = run.moe.imbalance
    if not by_step:
        by_step = {}
        for layer, key in run.grpo.matching("moe/imbalance/layer*").items():
            for step, value in zip(*run.grpo.series(key)):
                by_step.setdefault(step, {})[int(layer)] = value
    if not by_step:
        return Plot(missing=[MOE_LOAD, "moe/imbalance/layer*"])
    steps = sorted(by_step)
    layers = sorted({layer for row in by_step.values() for layer in row})
    z = [[by_step[s].get(layer, float("nan")) for s in steps] for layer in layers]
    return Plot(heatmap=Heatmap(z, steps, [f"layer {layer}" for layer in layers]))


def env_panel(runs: list[RunData]) -> Panel:
    charts = [
        lines_chart("env.grading", "Grader failures and timeouts", "per step", runs,
                    [("grade errors (all)", "rollout/grade_errors"), ("{} grade errors", "env/*/grade_errors"),
                     ("{} grade timeouts", "env/*/grade_timeouts"), ("{} env errors", "env/*/env_errors")],
                    pool_members="sum"),
        lines_chart("env.groups", "Failed, re-issued, aborted and refilled groups", "groups per step", runs,
                    [("failed", "rollout/failed_groups"), ("re-issued", "rollout/reissued"),
                     ("aborted", "async/aborted_groups"), ("refilled", "rollout/refilled_groups")]),
        lines_chart("env.sandbox_live", "Sandbox pool: live sandboxes", "sandboxes", runs,
                    [("live", "env/sandbox_live")]),
        lines_chart("env.sandbox_acquire", "Sandbox pool: time to acquire a sandbox", "seconds", runs,
                    [("acquire", "env/sandbox_acquire_s")]),
    ]
    return Panel("env", "Environment health", charts,
                 [domains.gate_family_table(run) if domains.has_families([run]) else gate_table(run) for run in runs])


def hacking_panel(runs: list[RunData]) -> Panel:
    charts = [
        lines_chart("hack.distinct", "Distinct final answers per domain", "answers per step", runs,
                    [("{}", "hack/*/distinct_answers")], pool_members="mean"),
        lines_chart("hack.degenerate", "Degenerate responses per domain", "fraction of samples", runs,
                    [("{}", "hack/*/degenerate_frac")], y_range=(0, 1), pool_members="mean"),
    ]
    return Panel("hacking", "Reward-hacking signals", charts)


def domains_panel(runs: list[RunData]) -> Panel:
    """For runs of many domains: the best and worst domains; one domain's curves come from the picker."""
    return Panel("domains", "Domains", tables=[domains.ranking_table(run) for run in runs])


PANELS = (runs_panel, rewards_panel, effort_panel, throughput_panel, mismatch_panel, learner_panel, moe_panel,
          env_panel, hacking_panel)


def build_panels(runs: list[RunData]) -> list[Panel]:
    panels = [make(runs) for make in PANELS]
    if domains.has_families(runs):
        panels.insert(2, domains_panel(runs))
    return panels


# -- tables ----------------------------------------------------------------------------------------
def _cell(before: dict | None, after: dict | None, domain: str, effort: str, key: str) -> str:
    def get(table):
        value = (table or {}).get(domain, {}).get(effort, {}).get(key)
        return value if isinstance(value, (int, float)) else None
    b, a = get(before), get(after)
    if b is None and a is None:
        return "-"
    return f"{fmt(b)} -> {fmt(a)}" if a is not None else fmt(b)


def heldout_table(run: RunData) -> Table:
    """Held-out reward per domain x effort level, before -> after RL (`eval_before/after.json`)."""
    source = run.eval_before or run.eval_after or {}
    domains = sorted(d for d in source if d != "all") + (["all"] if "all" in source else [])
    levels = run.effort_levels(evaluated=True) + ["all"]
    rows = [[d] + [_cell(run.eval_before, run.eval_after, d, lvl, "reward") for lvl in levels] for d in domains]
    return Table(f"heldout.{run.name}", f"{run.name}: held-out reward, before -> after RL", ["domain"] + levels, rows)


def effort_table(run: RunData) -> Table:
    levels = run.effort_levels(evaluated=True)
    rows = [[lvl, _cell(run.eval_before, run.eval_after, "all", lvl, "reward"),
             _cell(run.eval_before, run.eval_after, "all", lvl, "pass_rate"),
             _cell(run.eval_before, run.eval_after, "all", lvl, "tokens")] for lvl in levels]
    return Table(f"effort.{run.name}", f"{run.name}: held-out per effort level (all domains), before -> after",
                 ["effort", "reward", "pass rate", "response tokens"], rows)


def gate_table(run: RunData) -> Table:
    rows = []
    for env, report in sorted(run.gate.items()):
        if not isinstance(report, dict):
            continue
        rows.append([env, "ok" if report.get("ok") else "FAILED", fmt(report.get("oracle_pass_rate")),
                     fmt(report.get("null_pass_rate")), fmt(report.get("adversarial_pass_rate")),
                     str(report.get("deterministic", "-")).lower(), fmt(report.get("flaky_rate")),
                     str(len(report.get("leaks") or [])), str(report.get("tasks", "-")),
                     fmt((report.get("timings", {}).get("grade") or {}).get("mean_s")),
                     "; ".join(report.get("reasons") or []) or "-"])
    columns = ["environment", "gate", "oracle pass", "null pass", "adversarial pass", "deterministic", "flaky",
               "leaks", "tasks", "grade s (mean)", "reasons"]
    return Table(f"gate.{run.name}", f"{run.name}: quality gate", columns, rows)
