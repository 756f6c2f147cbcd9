"""The authoring guide's worked example is real: under 50 lines, registrable, passes the gate."""
from __future__ import annotations

import re
from pathlib import Path

import envs
from envs.grading import LocalGrader
from envs.quality import check_env

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.DOTALL)
    assert blocks, "docs/environments.md has no python example"
    return blocks[0]


def test_guide_example_is_under_50_lines():
    assert len(_example().strip().splitlines()) < 50


def test_guide_example_registers_and_passes_the_gate(tmp_path):
    path = tmp_path / "word_count.py"
    path.write_text(_example())
    assert envs.register_file(f"{path}:WordCountEnv") == "word-count"
    env = envs.make("word-count", sandbox_backend="process")
    assert len(env.dataset("train")) + len(env.dataset("heldout")) == 300
    report = check_env("word-count", {"sandbox_backend": "process"}, max_tasks=3, grader=LocalGrader())
    assert report["ok"], report["reasons"]
    assert report["oracle_pass_rate"] == 1.0 and report["splits"] == {"train": 3, "heldout": 3}
    assert report["adversarial_pass_rate"] == 0.0 and "hedge/list" in report["adversarial"]  # its answer is graded
