"""End to end through the CLI on a real local Ray cluster: a short run writes metrics and
checkpoints, resume continues at the right step, and a killed rollout worker loses no sample."""
from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rl.cli import app
from rl.metrics import read_metrics

from tests_rl_config import TINY


def write_config(tmp_path: Path, **sections) -> Path:
    tree = {**TINY, "output_dir": str(tmp_path / "runs"), **sections}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def only_run(tmp_path: Path) -> Path:
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


def active_parameters_of(model_spec: dict) -> int:
    from policy import build_policy
    from policy.params import count_parameters

    return count_parameters(build_policy(model_spec))["active"]


def samples_by_step(run_dir: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], []).append(rec["uid"])
    return out


def test_short_run_then_resume(tmp_path, ray_session):
    output = run_cli("train", str(write_config(tmp_path)))
    run_dir = only_run(tmp_path)
    assert "Held-out reward" in output
    # every environment played: none of its groups failed (a prompt over max_context fails its group)
    assert "failed and were left out" not in output, output
    assert set(json.loads((run_dir / "eval_before.json").read_text())) == {"all", "math", "tool_use", "agentic_shell"}
    assert re.search(r"rollout engines: [\d.]+ ms a step \(launching [\d.]+, waiting on the device 0\.0\), "
                     r"[\d.]+ tokens sampled a step, idle \d+% of the run ", " ".join(output.split())), output
    assert re.search(r"episodes: [\d.]+ s each on average \(starting [\d.]+, generating [\d.]+, in tools [\d.]+, "
                     r"grading [\d.]+\)", " ".join(output.split())), output
    metrics = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        # every drawn group is reported; those whose rewards all agree are dropped and replaced
        assert m["rollout/samples"] >= 8 and m["rollout/trained_samples"] <= 8
        assert m["rollout/samples"] == 2 * (m["rollout/trained_samples"] / 2 + m.get("rollout/dropped_uniform_groups", 0))
        assert 0.0 <= m["rollout/reward"] <= 1.0
        assert m["rollout/tokens_per_s"] > 0 and m["async/staleness_max"] == 0 if m["rollout/trained_samples"] else True
        # the engines' pace: they stepped, sampled and prefilled, busy no longer than the step lasted
        assert m["engine/steps"] >= 1 and m["engine/tokens_per_step"] > 0 and m["engine/prefill_tokens"] > 0
        assert 0 < m["engine/busy_s"] <= m["time/step_s"] * 2 + 1  # 2 rollout workers; the step's edges
        assert m["engine/step_ms"] == pytest.approx(1000 * m["engine/busy_s"] / m["engine/steps"])
        # on a CPU a step computes as it is launched: nothing to wait for, no graphs
        assert 0 < m["engine/launch_ms"] <= m["engine/step_ms"] and m["engine/wait_ms"] == 0
        assert m["engine/graph_capture_s"] == 0
        # where the episodes' time went: every phase timed, and generating took some
        assert {f"rollout/episode_s/{p}" for p in ("start", "generate", "tools", "grade")} <= m.keys()
        assert m["rollout/episode_s/generate"] > 0
        assert any(k.startswith("rollout/domain/") and k.endswith("/episode_s/tools") for k in m)
        assert "rollout/effort/low/reward" in m or "rollout/effort/max/reward" in m or "rollout/effort/medium/reward" in m
        if m["rollout/trained_samples"] and not m.get("train/skipped"):  # the learner's FLOPs rate: 6N per real token
            flops = 6 * m["train/seq_tokens"] * active_parameters_of(TINY["model"]) / m["time/learner_step_s"]
            assert m["train/model_tflops_per_s"] == pytest.approx(flops / 1e12, rel=1e-6)
            assert "train/mfu" not in m  # no peak is known for a CPU
    assert (run_dir / "config.yaml").exists() and (run_dir / "eval_after.json").exists()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_2"
    assert (run_dir / "checkpoints" / "step_2" / "hf" / "config.json").exists()
    for line in (run_dir / "rollouts.jsonl").read_text().splitlines():  # each sample can be read back whole
        rec = json.loads(line)
        roles = [m["role"] for m in rec["transcript"]]
        assert roles[:3] == ["system", "user", "assistant"] and rec["task_id"] and rec["domain"]
        assert roles.count("assistant") == rec["turns"]  # a turn the budget cut too: in the record, never stepped
        assert set(rec["phase_s"]) == {"start", "generate", "tools", "grade"}
        assert rec["phase_s"]["generate"] > 0  # a turn at least, and a step for each turn the budget did not cut
        assert rec["phase_s"]["tools"] > 0 or (rec["budget_cut"] and rec["turns"] == 1)
        assert min(rec["phase_s"].values()) >= 0
    # Resume with more steps: it continues at step 3, not from scratch.
    output = run_cli("train", "--resume", str(run_dir), "train.steps=5")
    assert "continuing at step 3" in output
    steps = [m["step"] for m in read_metrics(run_dir) if m["step"] >= 0]
    assert steps == [0, 1, 2, 3, 4]
    versions = [m["weights/version"] for m in read_metrics(run_dir) if m["step"] >= 0]
    assert versions == sorted(versions) and len(set(versions)) == 5
    # The last checkpoint evaluates through `rl eval`.
    out = run_cli("eval", str(write_config(tmp_path)), "--checkpoint", str(run_dir / "checkpoints" / "step_4"))
    assert "math" in out and "tool_use" in out and "before RL" not in out and "+-" in out
    summary = json.loads((run_dir / "checkpoints" / "step_4" / "hf" / "eval.json").read_text())
    assert 0 <= summary["all"]["all"]["reward"] <= 1 and summary["all"]["all"]["stderr"] >= 0


def test_an_expert_parallel_learner_trains_and_resumes(tmp_path, ray_session):
    """Two learner ranks (gloo, ZeRO-1) splitting each MoE layer's experts: the rollout engines get
    whole weights every step, a checkpoint exports every expert, and a resumed run continues."""
    from policy import from_pretrained

    config = write_config(tmp_path, resources={"learner_ranks": 2},
                          train={"steps": 2, "micro_batches": 1, "zero_stage": 1, "expert_parallel": 2},
                          checkpoint={"every": 1, "keep": 2}, gate={"enabled": False},
                          eval={"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False})
    run_cli("train", str(config))
    run_dir = only_run(tmp_path)
    assert [m["step"] for m in read_metrics(run_dir) if m["step"] >= 0] == [0, 1]
    exported = from_pretrained(run_dir / "checkpoints" / "step_1" / "hf").state_dict()
    assert exported["model.layers.1.block_sparse_moe.experts.w1"].shape[0] == 8
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_1").glob("experts_rank*.pt")) == \
        ["experts_rank000.pt", "experts_rank001.pt"]
    output = run_cli("train", "--resume", str(run_dir), "train.steps=3")
    assert "continuing at step 2" in output
    assert [m["step"] for m in read_metrics(run_dir) if m["step"] >= 0] == [0, 1, 2]


def test_killed_rollout_worker_reissues_its_groups(tmp_path, ray_session):
    import ray

    config = write_config(tmp_path, train={"steps": 4, "micro_batches": 1},
                          rollout={**TINY["rollout"], "drop_uniform_groups": False},
                          eval={"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False})
    error: list[BaseException] = []

    def target():
        try:
            run_cli("train", str(config))
        except BaseException as exc:  # surfaced in the main thread below
            error.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    killed = False
    deadline = time.monotonic() + 600
    while thread.is_alive() and time.monotonic() < deadline and not killed:
        time.sleep(0.2)
        runs = list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else []
        if runs and [m for m in read_metrics(runs[0]) if m["step"] >= 0]:
            worker = ray.get_actor(f"rollout-{runs[0].name}-0")
            # only while it holds sequences, so that it dies with a group in flight (between two
            # steps it may hold none, and then nothing is lost or reissued)
            if ray.get(worker.stats.remote(), timeout=60).running > 0:
                ray.kill(worker, no_restart=False)  # it dies mid-group; Ray restarts it
                killed = True
    thread.join(timeout=600)
    assert not error, error
    assert killed, "the run finished before a worker could be killed"
    run_dir = only_run(tmp_path)
    metrics = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert sum(m["rollout/reissued"] for m in metrics) >= 1
    for step, uids in samples_by_step(run_dir).items():
        counts = Counter(uids)
        assert len(uids) == 8, f"step {step} has {len(uids)} samples"
        assert max(counts.values()) == 1, f"step {step} counted a sample twice"
        assert {u.rsplit('/', 1)[0] for u in uids} == {f"g{4 * step + g}" for g in range(4)}


BROKEN_ENV = '''
from envs.domains.math import MathEnv


class ResetFailsAboveMedium(MathEnv):
    """Resets fine at medium effort (so the warm-up works), raises at every other level."""

    name = "math-reset-fails"

    def reset(self, seed=None, options=None):
        if (options or {}).get("effort") != "medium":
            raise RuntimeError("task set-up failed")
        return super().reset(seed=seed, options=options)
'''


def test_groups_whose_environment_raises_are_reported_and_left_out(tmp_path, ray_session):
    from envs.registry import register_file, unregister

    source = tmp_path / "broken_env.py"
    source.write_text(BROKEN_ENV)
    register_file(f"{source}:ResetFailsAboveMedium")
    try:
        config = write_config(
            tmp_path, envs=[{"name": "math-reset-fails", "kwargs": {"max_operand": 9, "n_train": 40, "n_heldout": 8}}],
            train={"steps": 2, "micro_batches": 1}, gate={"enabled": False},
            rollout={**TINY["rollout"], "max_retries": 1},
            eval={"tasks_per_env": 1, "efforts": ["medium", "high"], "before_and_after": True})
        output = run_cli("train", str(config))
    finally:
        unregister("math-reset-fails")
    run_dir = only_run(tmp_path)
    metrics = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    assert [m["step"] for m in metrics] == [0, 1, 1]  # the last: the evaluation after RL's failures
    failed = sum(m.get("rollout/failed_groups", 0) for m in metrics)
    assert failed >= 1
    assert "group(s) failed and were left out" in output and "task set-up failed" in output
    # the held-out groups at "high" fail too: said, and counted with the first step and after the last
    assert output.count("held-out group(s) failed and were left out of the table") == 2
    assert metrics[0]["eval/before/failed_groups"] == metrics[2]["eval/after/failed_groups"] == 1
    assert set(json.loads((run_dir / "eval_after.json").read_text())["all"]) == {"medium", "all"}
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert records and {r["effort"] for r in records} == {"medium"}  # the failing groups left no sample
    for m in metrics[:2]:  # failed groups were replaced by new draws (up to the cap), whole groups trained
        assert m["rollout/trained_samples"] % 2 == 0 and m["rollout/trained_samples"] <= 8


def comparable_metrics(run_dir: Path) -> list[dict]:
    """Metrics without the ones that measure time or sample live resources (they differ between two runs
    of anything: how many sandboxes are open at the moment of logging, or how many sequences share
    an engine step, depends on the clock)."""
    timed = ("time/", "throughput/", "engine/", "rollout/tokens_per_s", "env/sandbox_live", "sft/step_s",
             "train/model_tflops_per_s", "train/mfu")
    return [{k: v for k, v in m.items() if not k.startswith(timed) and "/episode_s/" not in k}
            for m in read_metrics(run_dir)]


def test_synchronous_runs_with_one_seed_are_identical(tmp_path, ray_session):
    """max_staleness 0: the same config and seed give the same samples and the same metrics."""
    runs = []
    for name in ("first", "second"):
        config = write_config(tmp_path / name, train={"steps": 2, "micro_batches": 2},
                              eval={"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
                              gate={"enabled": False})
        run_cli("train", str(config))
        runs.append(only_run(tmp_path / name))
    first, second = runs
    assert comparable_metrics(first) == comparable_metrics(second)
    assert "hack/math/distinct_answers" in read_metrics(first)[-1]  # the reward-hacking monitor watches each step
    samples = [[{k: r[k] for k in ("uid", "reward", "transcript", "trained")}
                for r in map(json.loads, (d / "rollouts.jsonl").read_text().splitlines())] for d in runs]
    assert samples[0] == samples[1] and len(samples[0]) >= 16


RESUMABLE = {"train": {"steps": 5, "micro_batches": 1}, "checkpoint": {"every": 1, "keep": 5},
             "eval": {"tasks_per_env": 1, "efforts": ["low"], "before_and_after": False},
             "rollout": {**TINY["rollout"], "max_staleness": 1}, "gate": {"enabled": False}}


def test_killed_async_run_resumes_without_losing_or_repeating_a_sample(tmp_path, ray_session):
    run_dir = run_killed_at(write_config(tmp_path, **RESUMABLE), tmp_path, "step_1")
    pending = {it["uid"] for it in json.loads((run_dir / "checkpoints" / "step_1" / "scheduler.json").read_text())["pending"]}
    output = run_cli("train", "--resume", str(run_dir))
    assert "continuing at step 2" in output
    assert [m["step"] for m in read_metrics(run_dir) if m["step"] >= 0] == [0, 1, 2, 3, 4]
    records = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    uids = [r["uid"] for r in records]
    assert len(uids) == len(set(uids)), "a sample was logged twice"
    trained_groups = [r["group"] for r in records if r["trained"]]
    assert sorted(Counter(trained_groups).values()) == [2] * (len(trained_groups) // 2)  # whole groups, once
    assert all(0 <= r["staleness"] <= 1 for r in records if r["trained"])
    reported = {r["group"] for r in records if r["step"] >= 2}
    assert pending <= reported, "groups issued before the kill were never played again"


def run_killed_at(config: Path, tmp_path: Path, tag: str) -> Path:
    """`rl train config` in its own process group, SIGKILLed (driver and the Ray cluster it started)
    as soon as checkpoint `tag` is complete; returns the run folder."""
    import os
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "train", str(config)], cwd=str(Path(__file__).parents[2]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            runs = list((tmp_path / "runs").glob("*")) if (tmp_path / "runs").exists() else []
            marker = runs[0] / "checkpoints" / "latest" if runs else None
            if marker is not None and marker.exists() and marker.read_text() == tag:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return only_run(tmp_path)


def test_a_killed_synchronous_run_resumes_into_the_uninterrupted_runs_folder(tmp_path, ray_session):
    """Killed once step 2's checkpoint exists, then resumed: rollouts.jsonl and metrics.jsonl hold what an
    uninterrupted run writes, sample for sample (times aside). The tiny policy's groups all agree, so every
    step refills to the draw cap: the resumed scheduler used to count its batches from 0 against weights at
    version 3, admitting groups past the cap and logging extra rows (640 where 512 belong in the issue's
    demo run). With the KL term on, each checkpoint keeps the reference (tests/rl/test_rl_learner_defects.py
    checks its values)."""
    sync = {**RESUMABLE, "rollout": TINY["rollout"], "train": {"steps": 5, "kl_coef": 0.05}}
    whole_cfg = write_config(tmp_path / "whole", **sync)
    run_cli("train", str(whole_cfg))
    whole = only_run(tmp_path / "whole")
    killed = run_killed_at(write_config(tmp_path / "killed", **sync), tmp_path / "killed", "step_2")
    output = run_cli("train", "--resume", str(killed))
    assert "continuing at step 3" in output

    def rows(run_dir: Path) -> list[dict]:
        return [{k: r[k] for k in ("step", "uid", "reward", "trained", "transcript", "version")}
                for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())]

    assert rows(killed) == rows(whole)
    assert comparable_metrics(killed) == comparable_metrics(whole)
    assert all(m.get("rollout/refilled_groups", 0) > 0 for m in read_metrics(whole) if m["step"] >= 0)
    assert (killed / "checkpoints" / "step_4" / "reference_rank000.pt").exists()


def test_resuming_a_finished_run_changes_nothing(tmp_path, ray_session):
    config = write_config(tmp_path, train={"steps": 1, "micro_batches": 1}, gate={"enabled": False},
                          eval={"tasks_per_env": 1, "efforts": ["low"]})
    run_cli("train", str(config))
    run_dir = only_run(tmp_path)
    files = {name: (run_dir / name).read_text() for name in ("metrics.jsonl", "rollouts.jsonl", "eval_after.json")}
    output = run_cli("train", "--resume", str(run_dir))
    assert "already finished" in output and "Held-out reward" in output
    assert {name: (run_dir / name).read_text() for name in files} == files
