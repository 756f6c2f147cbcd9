"""The `rl` command line: every command answers --help; bad configs fail with one clear line."""
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [[], ["train"], ["eval"], ["version"], ["env"], ["env", "list"],
                                     ["sandbox"], ["model"], ["model", "info"]])
def test_every_command_has_help(command):
    result = CliRunner().invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.output
    assert "unavailable" not in result.output


def test_version_names_the_stack():
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 0
    for name in ("kimi-rl", "torch", "ray", "deepspeed"):
        assert name in result.output


def test_bad_override_is_one_line_and_exit_code_2(tmp_path):
    # Through the installed entry point, as a user runs it.
    rl = Path(sys.executable).with_name("rl")
    proc = subprocess.run([str(rl), "train", str(REPO / "configs" / "demo.yaml"), "train.lrr=1"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["error: config error: unknown key 'train.lrr'"]


def test_train_refuses_an_environment_that_fails_the_gate(tmp_path):
    import yaml

    from envs.domains.math import MathEnv
    from envs.registry import register_env, unregister
    from tests_rl_config import TINY

    @register_env(name="math-wrong-reference")
    class WrongReference(MathEnv):
        def reference_actions_for(self, task):
            return ["The answer is 12345."]

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "runs"),
                                      "envs": [{"name": "math-wrong-reference", "kwargs": {"n_train": 20}}]}))
    try:
        result = CliRunner().invoke(app, ["train", str(config)])
        assert result.exit_code == 2
        assert "environment 'math-wrong-reference' failed the quality gate (oracle" in result.output
        assert "gate.allow_failing=true" in result.output
        assert (next((tmp_path / "runs").iterdir()) / "gate.json").exists()
    finally:
        unregister("math-wrong-reference")


def test_resume_of_a_folder_that_is_no_run(tmp_path):
    result = CliRunner().invoke(app, ["train", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "has no config.yaml" in " ".join(result.output.split())  # rich wraps long paths
