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
    assert report["ok"] and report["splits"] == {"train": 3, "heldout": 2} and report["env"] == "say-word"
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
    assert r.exit_code == 0 and "math: ok (4 tasks: 2 train, 2 heldout)" in r.output


def test_cli_register_bad_spec_exits_2():
    r = CliRunner().invoke(env_app, ["register", "no_colon_here.py"])
    assert r.exit_code == 2 and "cannot register" in r.output


class TinyMath(MathEnv):
    """Registered with the decorator by the tests below (a module-level class, as users write them)."""

    name = "tiny-math"


def test_a_taken_name_is_refused_unless_replacing():
    with pytest.raises(registry.EnvRegistryError, match="'math' is already registered .*builtin.*replace=True"):
        envs.register_env(name="math")(TinyMath)
    envs.register_env(TinyMath)
    envs.register_env(TinyMath)  # the same class again: a no-op

    class Other(MathEnv):
        pass

    with pytest.raises(registry.EnvRegistryError, match="'tiny-math' is already registered"):
        envs.register_env(name="tiny-math")(Other)
    envs.register_env(name="math", replace=True)(TinyMath)
    assert type(envs.make("math")) is TinyMath


def test_cli_register_refuses_a_taken_name_and_unregisters(tmp_path):
    runner = CliRunner()
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE.format(cls="SayWord", name="math"))
    r = runner.invoke(env_app, ["register", f"{path}:SayWord"])
    assert r.exit_code == 2 and "'math' is already registered (builtin: envs.domains.math:MathEnv)" in r.output
    assert "--replace" in r.output
    r = runner.invoke(env_app, ["register", f"{path}:SayWord", "--replace"])
    assert r.exit_code == 0 and envs.make("math").name == "math" and type(envs.make("math")).__name__ == "SayWord"
    r = runner.invoke(env_app, ["unregister", "math"])
    assert r.exit_code == 0 and "unregistered math" in r.output
    assert type(envs.make("math")) is MathEnv  # the built-in is back
    r = runner.invoke(env_app, ["unregister", "math"])
    assert r.exit_code == 2 and "built-in environment and cannot be unregistered" in r.output
    r = runner.invoke(env_app, ["unregister", "nope"])
    assert r.exit_code == 2 and "unknown environment 'nope'" in r.output


def test_checks_are_shown_per_class_version(tmp_path):
    runner = CliRunner()
    path = _write_env(tmp_path)
    assert runner.invoke(env_app, ["register", f"{path}:SayWord"]).exit_code == 0
    assert runner.invoke(env_app, ["check", "say-word", "--max-tasks", "2"]).exit_code == 0
    line = lambda out: next(ln for ln in out.splitlines() if ln.startswith("say-word"))  # noqa: E731
    assert line(runner.invoke(env_app, ["list"]).output).endswith("ok")
    # the class is edited (its reference now wrong): the old verdict is not shown for the new class
    path.write_text(ENV_FILE.format(cls="SayWord", name="say-word").replace('return [task["word"]]', 'return ["nope"]'))
    for mod in [m for m in sys.modules if m.startswith("rl_envs_file_")]:
        del sys.modules[mod]  # a new process would import the edited file
    assert line(runner.invoke(env_app, ["list"]).output).endswith("never (the class changed since its last check)")
    assert runner.invoke(env_app, ["check", "say-word", "--max-tasks", "2"]).exit_code == 1
    assert "FAILED: oracle" in line(runner.invoke(env_app, ["list"]).output)


def test_check_names_says_which_entry_is_wrong_in_one_line(tmp_path):
    registry.check_names(["math", "lookup"])
    with pytest.raises(registry.EnvRegistryError) as err:
        registry.check_names(["lookup", "mth"])
    assert str(err.value).startswith("unknown environment 'mth' in envs[1]; did you mean 'math'? registered: code, ")
    path = _write_env(tmp_path)
    envs.register_file(f"{path}:SayWord")
    path.write_text("import nonexistent_module_xyz\n")
    for mod in [m for m in sys.modules if m.startswith("rl_envs_file_")]:
        del sys.modules[mod]
    with pytest.raises(registry.EnvRegistryError) as err:
        registry.check_names(["say-word"])
    message = str(err.value)
    assert "\n" not in message and f"'say-word' in envs[0] cannot be loaded from {path}:SayWord" in message
    assert "ModuleNotFoundError: No module named 'nonexistent_module_xyz'" in message


def test_a_resolved_decorator_class_builds_in_a_process_that_never_imported_it(tmp_path):
    """The recipe carries the class by value: a Ray worker cannot import this test module."""
    import subprocess

    from ray import cloudpickle

    envs.register_env(TinyMath)
    recipe = registry.resolve("tiny-math", {"max_operand": 5})
    blob = tmp_path / "recipe.pkl"
    blob.write_bytes(cloudpickle.dumps(recipe))
    code = ("import sys, pickle; r = pickle.load(open(sys.argv[1], 'rb')); env = r.make(); "
            "print(type(env).__name__, env.name, env.max_operand, 'test_envs_registry' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, cwd=tmp_path)
    assert out.stdout.split() == ["TinyMath", "tiny-math", "5", "False"], out.stderr[-2000:]
