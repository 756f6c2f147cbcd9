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
