"""Registry: built-ins, decorator, local file (persisted), entry point; the CLI app."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

import envs
from envs import registry
from envs.cli import env_app
from envs.domains.math import MathEnv

ENV_FILE = '''
from envs import Environment, Grade, Grader


class EchoGrader(Grader):
    version = "1"

    def score(self, payload):
        ok = (payload["answer"] or "").strip() == payload["word"]
        return Grade(reward=float(ok), passed=ok, grader_version="")


class {cls}(Environment):
    name = "{name}"
    domain = "toy"

    def make_grader(self):
        return EchoGrader()

    def build_tasks(self):
        words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
        return {{"train": [{{"task_id": w, "word": w}} for w in words[:8]],
                "heldout": [{{"task_id": w, "word": w}} for w in words[8:]]}}

    def prompt(self, task):
        return "Say the word " + task["word"].upper() + " in lower case."

    def reference_actions_for(self, task):
        return [task["word"]]

    def grade_payload(self, task, final_answer):
        return {{"answer": final_answer, "word": task["word"]}}
'''


def _write_env(tmp_path, cls="SayWord", name="say-word"):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE.format(cls=cls, name=name))
    return path


def test_builtins_are_listed_with_domain_tools_and_sizes():
    specs = {s.name: s for s in envs.list_envs()}
    assert {"math", "code", "humaneval", "shell", "lookup"} <= set(specs)
    assert specs["lookup"].tools == ["search"] and specs["shell"].tools == ["bash"] and specs["math"].tools == []
    assert specs["shell"].domain == "agentic_shell" and specs["humaneval"].domain == "code"
    assert sum(specs["humaneval"].dataset_sizes.values()) == 164
    assert all(s.error is None for s in specs.values()), [s.error for s in specs.values() if s.error]


def test_make_applies_preset_defaults_and_overrides():
    assert envs.make("math-word").kind == "word"
    assert envs.make("math-word", kind="arithmetic").kind == "arithmetic"
    with pytest.raises(KeyError, match="unknown environment 'nope'"):
        envs.make("nope")


def test_decorator_registration():
    @envs.register_env(name="tiny-math", max_operand=3)
    class TinyMath(MathEnv):
        pass

    env = envs.make("tiny-math")
    assert env.name == "tiny-math" and env.max_operand == 3
    assert "tiny-math" in envs.env_names()


def test_decorator_rejects_non_environments():
    with pytest.raises(TypeError, match="not an envs.Environment subclass"):
        envs.register_env(dict)


def test_register_from_file_is_persisted(tmp_path, isolated_registry):
    path = _write_env(tmp_path)
    assert envs.register_file(f"{path}:SayWord") == "say-word"
    assert json.loads((isolated_registry / "registry.json").read_text())["say-word"]["target"].endswith("my_env.py:SayWord")
    registry._ENTRIES.clear()  # a new process: only the registry file remembers it
    env = envs.make("say-word")
    obs, info = env.reset(seed=0)
    env.step(env.reference_actions(info["task_id"])[0])
    assert env.grade().passed
    spec = next(s for s in envs.list_envs() if s.name == "say-word")
    assert spec.source == "file" and spec.dataset_sizes == {"train": 8, "heldout": 2}
    registry.unregister("say-word")
    assert "say-word" not in envs.env_names()


def test_register_file_errors_are_clear(tmp_path):
    path = _write_env(tmp_path)
    with pytest.raises(ValueError, match="path/to/file.py:ClassName"):
        envs.register_file(str(path))
    with pytest.raises(FileNotFoundError, match="environment file not found"):
        envs.register_file(f"{tmp_path / 'missing.py'}:X")
    with pytest.raises(AttributeError, match="has no class 'Nope'"):
        envs.register_file(f"{path}:Nope")
    with pytest.raises(TypeError, match="not an envs.Environment subclass"):
        envs.register_file(f"{path}:EchoGrader")


def test_register_from_entry_point(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "ep_pkg_envs").mkdir(parents=True)
    (site / "ep_pkg_envs" / "__init__.py").write_text(ENV_FILE.format(cls="EpEnv", name="from-entry-point"))
    dist = site / "ep_pkg_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-pkg-envs\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rl.envs]\nfrom-entry-point = ep_pkg_envs:EpEnv\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        spec = next(s for s in envs.list_envs() if s.name == "from-entry-point")
        assert spec.source == "entry_point" and spec.domain == "toy" and spec.error is None
        env = envs.make("from-entry-point")
        _, info = env.reset(seed=1)
        env.step(env.reference_actions(info["task_id"])[0])
        assert env.grade().passed
    finally:
        sys.modules.pop("ep_pkg_envs", None)


def test_cli_register_list_check(tmp_path):
    runner = CliRunner()
    path = _write_env(tmp_path)
    r = runner.invoke(env_app, ["register", f"{path}:SayWord"])
    assert r.exit_code == 0 and "registered say-word" in r.output
    r = runner.invoke(env_app, ["list"])
    assert r.exit_code == 0
    line = next(ln for ln in r.output.splitlines() if ln.startswith("say-word"))
    assert "toy" in line and "8" in line and "never" in line
    r = runner.invoke(env_app, ["check", "say-word", "--json", "--max-tasks", "3"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)
    assert report["ok"] and report["tasks"] == 3 and report["env"] == "say-word"
    r = runner.invoke(env_app, ["list"])
    assert "ok" in next(ln for ln in r.output.splitlines() if ln.startswith("say-word"))


def test_cli_check_fails_with_exit_code_1_and_reason(tmp_path):
    path = tmp_path / "bad_env.py"
    path.write_text(ENV_FILE.format(cls="Bad", name="bad-env").replace("return [task[\"word\"]]", "return [\"nope\"]"))
    runner = CliRunner()
    assert runner.invoke(env_app, ["register", f"{path}:Bad"]).exit_code == 0
    r = runner.invoke(env_app, ["check", "bad-env", "--max-tasks", "2"])
    assert r.exit_code == 1 and "FAILED" in r.output and "reason: oracle" in r.output
    r = runner.invoke(env_app, ["check", "math", "--max-tasks", "2", "-k", "max_operand=5", "-k", "ops=+"])
    assert r.exit_code == 0 and "math: ok (2 tasks)" in r.output


def test_cli_register_bad_spec_exits_2():
    r = CliRunner().invoke(env_app, ["register", "no_colon_here.py"])
    assert r.exit_code == 2 and "cannot register" in r.output
