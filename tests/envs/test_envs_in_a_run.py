"""Environments as a run sees them: a decorator-registered class reaches the Ray environment workers,
and a misspelt or broken environment stops `rl train` with one line before anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import envs
from envs.domains.math import MathEnv, MathGrader
from envs.grades import Grade, Grader

REPO = Path(__file__).resolve().parents[2]

TINY = {
    "name": "tiny",
    "model": {"preset": "toy", "vocab_size": 320},
    "sandbox_backend": "process",
    "effort": {"budgets": {"low": 8, "medium": 12, "high": 16, "max": 24}},
    "rollout": {"num_workers": 1, "env_workers": 1, "groups_per_step": 2, "group_size": 2, "max_context": 160,
                "drop_uniform_groups": False},  # a fixed number of samples a step
    "train": {"steps": 1, "micro_batches": 1},
    "warmup": {"steps": 1, "batch_size": 4, "tasks_per_env": 4},
    "eval": {"tasks_per_env": 1, "efforts": ["medium"], "before_and_after": False},
    "checkpoint": {"every": 1, "keep": 1},
    "logging": {"wandb_mode": "disabled", "progress": False},
    "gate": {"max_tasks": 1},
}


class HalfCreditGrader(MathGrader):
    """Only this module knows it: a Ray worker can use it only if it arrives by value."""

    version = "half-1"

    def score(self, payload: dict) -> Grade:
        grade = super().score(payload)
        grade.reward = 0.5 if grade.passed else 0.0
        return grade


class DecoratedMath(MathEnv):
    name = "decorated-math"

    def make_grader(self) -> Grader:
        return HalfCreditGrader()


def _config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "runs"), **sections}))
    return path


def test_a_decorator_registered_environment_trains(tmp_path, ray_session):
    from rl.trainer import train

    envs.register_env(DecoratedMath)
    config = _config(tmp_path, envs=[{"name": "decorated-math", "kwargs": {"max_operand": 9, "n_train": 20, "n_heldout": 4}}])
    result = train(str(config), [])
    run_dir = Path(result["run_dir"])
    rewards = [json.loads(line)["reward"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rewards) == 4 and set(rewards) <= {0.0, 0.5}  # graded by the class only this module defines
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_0"


def _rl_train(config: Path, envs_home: Path) -> subprocess.CompletedProcess:
    # COLUMNS: the CLI's console would wrap a long line at 80 columns
    env = {**os.environ, "RL_ENVS_HOME": str(envs_home), "COLUMNS": "400"}
    return subprocess.run([sys.executable, "-m", "rl.cli", "train", str(config)], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env=env)


def test_a_misspelt_environment_is_refused_before_anything_starts(tmp_path):
    from rl.config import ConfigError
    from rl.trainer import train

    config = _config(tmp_path, envs=[{"name": "lookup"}, {"name": "mth"}])
    with pytest.raises(ConfigError) as err:
        train(str(config), [])
    assert "\n" not in str(err.value) and "gate.allow_failing" not in str(err.value)
    proc = _rl_train(config, tmp_path / "envs-home")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, lines
    assert len(lines) == 1 and lines[0].startswith(
        "error: config error: unknown environment 'mth' in envs[1]; did you mean 'math'? registered: code, ")
    assert not (tmp_path / "runs").exists()  # no run folder, no Ray


def test_an_environment_file_that_no_longer_imports_is_one_line(tmp_path):
    source = tmp_path / "my_env.py"
    source.write_text("from envs.domains.math import MathEnv\n\n\nclass MyMath(MathEnv):\n    name = 'my-math'\n")
    envs.register_file(f"{source}:MyMath")
    source.write_text("from envs.domains.math import MathEnv\nimport a_module_that_went_away\n")
    config = _config(tmp_path, envs=[{"name": "my-math"}], gate={"allow_failing": True})
    proc = _rl_train(config, tmp_path / "envs-home")
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2, lines[-20:]
    assert lines == [f"error: config error: environment 'my-math' in envs[0] cannot be loaded from {source}:MyMath: "
                     f"ModuleNotFoundError: No module named 'a_module_that_went_away'"]
    assert not (tmp_path / "runs").exists()
