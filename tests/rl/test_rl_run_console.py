"""What a run says, end to end: `rl train` in a subprocess with its output to a pipe (not a
terminal), on two environments registered from tests/rl/console_envs.py: `flat-lookup`, whose
groups never carry a learning signal (its steps are skipped), and `coin-math`, scored by a coin
(its steps train). One group a step, drawn by the seeded stream, so the run has both kinds."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests_rl_config import TINY

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 8


def console_config(tmp_path: Path, **changes) -> Path:
    tree = {**TINY, "output_dir": str(tmp_path / "runs"),
            "envs": [{"name": "coin-math", "weight": 1.0, "kwargs": {"max_operand": 9, "n_train": 40, "n_heldout": 8}},
                     {"name": "flat-lookup", "weight": 1.0, "kwargs": {"n_train": 40, "n_heldout": 8}}],
            "rollout": {**TINY["rollout"], "groups_per_step": 1, "group_size": 6, "max_draws_per_step": 1.0},
            "train": {**TINY["train"], "steps": STEPS},
            "eval": {**TINY["eval"], "before_and_after": False},
            "checkpoint": {"every": STEPS, "keep": 1},
            # progress bars on (the default): the output is no terminal
            "logging": {"wandb_mode": "offline", "no_signal_steps": 2},
            "gate": {"enabled": False},  # a grader that always gives 0 would fail it
            **changes}
    path = tmp_path / "console.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def register_envs(home: Path) -> None:
    env = {**os.environ, "RL_ENVS_HOME": str(home)}
    for cls in ("FlatLookup", "CoinMath"):
        subprocess.run([sys.executable, "-m", "rl.cli", "env", "register", f"{HERE / 'console_envs.py'}:{cls}"],
                       cwd=REPO, env=env, check=True, capture_output=True, timeout=120)


def rl(args: list[str], home: Path, **kw) -> subprocess.CompletedProcess:
    # stdout is a pipe: the console is no terminal. COLUMNS: rich would wrap long lines at 80.
    env = {**os.environ, "RL_ENVS_HOME": str(home), "COLUMNS": "400", "WANDB_MODE": "offline",
           "WANDB_SILENT": "false"}
    return subprocess.run([sys.executable, "-m", "rl.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("console")
    home = tmp_path / "envs-home"
    register_envs(home)
    proc = rl(["train", str(console_config(tmp_path))], home, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] >= 0:
            metrics[row["step"]] = row
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    return {"output": output, "lines": output.splitlines(), "run_dir": run_dir, "metrics": metrics,
            "records": records, "home": home, "tmp_path": tmp_path}


def test_a_run_to_a_pipe_prints_a_line_per_step_and_says_each_skip(run):
    lines, metrics = run["lines"], run["metrics"]
    assert sorted(metrics) == list(range(STEPS))
    step_lines = {int(m.group(1)): line for line in lines
                  if (m := re.search(rf"\] step (\d+) \((\d+)/{STEPS}\): reward ", line))}
    assert sorted(step_lines) == list(range(STEPS)), run["output"][-4000:]
    skipped = [s for s, m in metrics.items() if m.get("train/skipped")]
    assert skipped and len(skipped) < STEPS, metrics  # the stream drew both environments
    for step, line in step_lines.items():
        domain = "flat" if any(r["domain"] == "flat" for r in run["records"] if r["step"] == step) else "coin"
        # the reward overall and per domain, skipped or not (and why), the seconds
        assert re.search(rf"reward [\d.]+ \({domain} [\d.]+\), ", line), line
        assert re.search(r", [\d.]+ s \(rollout [\d.]+, learner [\d.]+, sync [\d.]+\)$", line), line
        if step in skipped:
            assert "skipped: no group to train on: all 1 group(s) drawn had rewards that agreed" in line, line
        else:
            assert "trained on 1 group(s)" in line, line
    for step in skipped:  # every flat step is skipped
        assert any(r["domain"] == "flat" for r in run["records"] if r["step"] == step) or \
            len({r["reward"] for r in run["records"] if r["step"] == step}) == 1
    # no progress bar printed once at the end, cut to 80 columns
    assert not any("GRPO" in line and "━" in line for line in lines), run["output"][-3000:]


def test_the_end_of_run_rates_leave_out_skipped_steps(run):
    metrics = run["metrics"]
    trained = [m for m in metrics.values() if not m.get("train/skipped")]
    skipped = sorted(s for s, m in metrics.items() if m.get("train/skipped"))
    seconds = sum(m["time/step_s"] for m in trained)
    samples = sum(m["rollout/samples"] for m in trained)
    (summary,) = [line for line in run["lines"] if "] GRPO: " in line and " step(s) in " in line]
    assert f"{len(skipped)} skipped with no learning signal (step {', '.join(map(str, skipped))})" in summary, summary
    rate = float(re.search(rf"over the {len(trained)} trained step\(s\): ([\d.]+) samples/s", summary).group(1))
    assert rate == pytest.approx(samples / seconds, abs=0.06), summary
    # counting the skipped steps too (all rollout, no learner) gives another rate, when it differs
    # beyond the summary's one decimal (it came within 0.006 of the trained steps' once in CI)
    counted_all = sum(m["rollout/samples"] for m in metrics.values()) / sum(m["time/step_s"] for m in metrics.values())
    if abs(counted_all - samples / seconds) > 0.1:
        assert abs(counted_all - rate) > 0.05, (counted_all, rate)


def tool_call_rate(records: list[dict]) -> float:
    """Assistant turns answered by a tool message, over all assistant turns, each episode once."""
    episodes = {r["uid"].split("@", 1)[0]: r["transcript"] for r in records}
    turns = calls = 0
    for transcript in episodes.values():
        for i, m in enumerate(transcript):
            if m["role"] == "assistant":
                turns += 1
                calls += i + 1 < len(transcript) and transcript[i + 1]["role"] == "tool"
    return calls / turns


def test_the_tool_call_rate_per_domain_is_a_metric(run):
    flat_steps = 0
    for step, m in run["metrics"].items():
        records = [r for r in run["records"] if r["step"] == step]
        (domain,) = {r["domain"] for r in records}
        assert m[f"rollout/domain/{domain}/tool_call_rate"] == pytest.approx(tool_call_rate(records)), step
        assert m["rollout/tool_call_rate"] == pytest.approx(tool_call_rate(records))
        if domain == "coin":  # math has no tools
            assert m["rollout/domain/coin/tool_call_rate"] == 0.0
        else:
            flat_steps += 1
            assert m["rollout/domain/flat/uniform_groups"] == 1.0
    assert flat_steps >= 2


def test_a_domain_without_learning_signal_for_n_steps_is_warned_about_once(run):
    flat = sorted(s for s in run["metrics"] if any(r["domain"] == "flat" for r in run["records"] if r["step"] == s))
    warnings = [line for line in run["lines"] if "no learning signal in domain" in line]
    assert warnings == [f"no learning signal in domain flat for 2 steps (steps {flat[0]}-{flat[1]}): every group "
                        f"scored 0, so every advantage was zero"], run["output"][-3000:]


def test_the_no_signal_warning_counts_the_steps_a_domain_is_played_and_says_when_it_comes_back():
    from rl.step_report import SignalMonitor

    def group(step, domain, rewards):
        return [{"uid": f"{domain}{step}/{i}", "group": f"{domain}{step}", "domain": domain, "reward": r}
                for i, r in enumerate(rewards)]

    monitor = SignalMonitor(steps=3)
    said = []
    for step, records in enumerate([group(0, "a", [1, 1]), group(1, "b", [0, 1]), group(2, "a", [1, 1]),
                                    group(3, "a", [0.5, 0.5]) + group(3, "a2", [0, 1]), group(4, "a", [0, 1])]):
        metrics, lines = monitor.observe(step, records)
        said += lines
    assert said == ["no learning signal in domain a for 3 steps (steps 0-3): each group's rewards agreed, so every "
                    "advantage was zero", "domain a has a learning signal again at step 4"]
    assert metrics == {"rollout/domain/a/uniform_groups": 0.0}
    # the rewards trained on (shaped by length) decide: a group the verifier scored alike may differ
    assert SignalMonitor(steps=1).observe(0, group(0, "a", [1, 1]), {"a0/0": 0.9, "a0/1": 1.0})[1] == []
    assert SignalMonitor(steps=0).observe(0, group(0, "a", [1, 1]))[1] == []


def test_wandbs_end_of_run_history_is_not_printed_the_runs_own_summary_is(run):
    output = run["output"]
    assert "Run history:" not in output and "Run summary:" not in output, output[-3000:]
    assert not re.search(r"wandb: +rollout/reward ", output), output[-3000:]
    assert list(run["run_dir"].glob("wandb/offline-run-*/run-*.wandb"))  # wandb logged all the same
    assert any("] GRPO: " in line and "trained step(s):" in line for line in run["lines"])


def dashboard_row(run_dir: Path) -> dict[str, str]:
    """The run's row of the dashboard's runs table, by column."""
    from rl.dashboard.model import RunData
    from rl.dashboard.panels import runs_panel

    data = RunData(run_dir)
    data.refresh(final=True)
    (table,) = runs_panel([data]).tables
    (row,) = table.rows
    return dict(zip(table.columns, row))


def report_of(run_dir: Path) -> str:
    from typer.testing import CliRunner

    from rl.cli import app

    result = CliRunner().invoke(app, ["report", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return (run_dir / "report" / "report.md").read_text()


def state_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def test_a_finished_run_shows_as_finished(run):
    state = state_of(run["run_dir"])
    assert state["state"] == "finished" and state["ended"] >= state["started"], state
    assert dashboard_row(run["run_dir"])["state"] == "finished"
    assert "State: finished." in report_of(run["run_dir"])


def test_a_run_that_failed_at_start_shows_as_failed(run, tmp_path):
    config = console_config(tmp_path, gate={"max_tasks": 1})  # neither a coin nor a constant 0 passes it
    proc = rl(["train", str(config)], run["home"], timeout=300)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    state = state_of(run_dir)
    assert state["state"] == "failed" and re.match(r"environment '[a-z-]+' failed the quality gate", state["reason"])
    row = dashboard_row(run_dir)
    assert row["state"] == f"failed: {state['reason']}" and row["GRPO steps"] == f"0 / {STEPS}"
    assert f"State: failed: {state['reason']}." in report_of(run_dir)


def test_an_interrupted_run_shows_as_interrupted_then_resumed(run, tmp_path):
    import signal
    import time

    config = console_config(tmp_path, checkpoint={"every": 2, "keep": 2})
    env = {**os.environ, "RL_ENVS_HOME": str(run["home"]), "COLUMNS": "400", "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "train", str(config)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list((tmp_path / "runs").glob("*/checkpoints/step_1/manifest*")):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        (run_dir,) = (tmp_path / "runs").iterdir()
        assert state_of(run_dir)["state"] == "running"
        assert dashboard_row(run_dir)["state"] == "running"
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    state = state_of(run_dir)
    assert state["state"] == "interrupted" and state["reason"].startswith("interrupted (SIGINT)"), state
    assert dashboard_row(run_dir)["state"] == f"interrupted: {state['reason']}"
    resumed = subprocess.run([sys.executable, "-m", "rl.cli", "train", "--resume", str(run_dir)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    at = int(re.search(r"continuing at step (\d+)", resumed.stdout).group(1))
    state = state_of(run_dir)
    assert state["state"] == "finished" and state["resumed_at_step"] == at and "reason" not in state, state
    assert dashboard_row(run_dir)["state"] == f"finished, resumed at step {at}"
    assert f"State: finished, resumed at step {at}." in report_of(run_dir)


def test_a_running_run_whose_process_is_gone_shows_as_stopped(tmp_path):
    from rl.run_folder import write_state

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "config.yaml").write_text("name: x\n")
    record = write_state(tmp_path, "running")
    assert dashboard_row(tmp_path)["state"] == "running"
    (tmp_path / "state.json").write_text(json.dumps({**record, "pid": dead.pid}))
    assert dashboard_row(tmp_path)["state"].startswith("stopped (its process is gone")
    (tmp_path / "state.json").write_text("{not json")
    assert dashboard_row(tmp_path)["state"] == "unknown (no readable state.json)"
