"""The quality gate: built-ins pass; each deliberately broken env is caught for the right reason."""
from __future__ import annotations

import json

import pytest

import envs
from envs.grading import LocalGrader
from envs.quality import EnvQualityError, check_env, require_env_ok
from envs_testutil import (SMALL, FlakyGraderEnv, LeakedAnswerFileEnv, LeakedHiddenTestsEnv, LenientGraderEnv,
                           NondeterministicEnv, WrongReferenceEnv)

PROC = {"sandbox_backend": "process"}
REQUIRED_KEYS = {"env", "ok", "oracle_pass_rate", "null_pass_rate", "adversarial_pass_rate", "deterministic",
                 "flaky_rate", "leaks", "tasks", "timings", "reasons"}


def _check(name, kwargs=None, max_tasks=3):
    return check_env(name, kwargs or {}, max_tasks=max_tasks, grader=LocalGrader())


@pytest.mark.parametrize("name, kwargs", [
    ("math", {}), ("lookup", {}), ("lookup-docs", {}), ("code", PROC), ("humaneval", PROC),
    ("shell", PROC), ("shell-fix-test", PROC), ("shell-sqlite", PROC),
])
def test_builtin_envs_pass_the_gate(name, kwargs):
    report = _check(name, kwargs)
    assert REQUIRED_KEYS <= set(report), REQUIRED_KEYS - set(report)
    assert report["ok"], report["reasons"]
    assert report["oracle_pass_rate"] == 1.0 and report["null_pass_rate"] == 0.0
    assert report["adversarial_pass_rate"] == 0.0 and report["flaky_rate"] == 0.0
    assert report["deterministic"] and report["leaks"] == [] and report["tasks"] == 3
    assert report["timings"]["reset"]["n"] > 0 and report["timings"]["grade"]["mean_s"] >= 0
    json.dumps(report.to_dict())  # the report is plain JSON


def test_wrong_reference_is_caught():
    envs.register_env(WrongReferenceEnv)
    report = _check("broken-wrong-reference", SMALL)
    assert not report["ok"] and report["oracle_pass_rate"] == 0.0
    assert any(r.startswith("oracle: the reference solution failed on 3/3") for r in report["reasons"])
    assert report["flaky_rate"] == 0.0 and report["deterministic"]


def test_flaky_grader_is_caught():
    envs.register_env(FlakyGraderEnv)
    report = _check("broken-flaky-grader", SMALL)
    assert not report["ok"] and report["flaky_rate"] == 1.0
    assert any(r.startswith("flaky grader: 3/3 tasks") for r in report["reasons"])


def test_lenient_grader_is_caught_by_null_and_adversarial_policies():
    envs.register_env(LenientGraderEnv)
    report = _check("broken-lenient-grader", SMALL)
    assert not report["ok"] and report["null_pass_rate"] == 1.0 and report["adversarial_pass_rate"] == 1.0
    assert any(r.startswith("null policy") for r in report["reasons"])
    assert any(r.startswith("adversarial policy 'echo_prompt'") for r in report["reasons"])


def test_nondeterministic_reset_is_caught():
    envs.register_env(NondeterministicEnv)
    report = _check("broken-nondeterministic", SMALL)
    assert not report["ok"] and not report["deterministic"]
    assert any(r.startswith("nondeterministic: ") and "different prompt" in r for r in report["reasons"])


def test_leaked_hidden_tests_are_caught_by_content():
    envs.register_env(LeakedHiddenTestsEnv)
    report = _check("broken-leaked-tests", {"kind": "fix_test", **PROC}, max_tasks=2)
    assert not report["ok"] and report["leaks"]
    assert any(leak["where"].endswith("/hidden_tests.py") and leak["probe"].startswith("assert") for leak in report["leaks"])
    assert any(r.startswith("leaks: ") for r in report["reasons"])
    assert report["oracle_pass_rate"] == 1.0  # only the leak is wrong with it


def test_leaked_answer_file_is_caught_by_name():
    envs.register_env(LeakedAnswerFileEnv)
    report = _check("broken-leaked-answer", {"kind": "sqlite", **PROC}, max_tasks=2)
    assert not report["ok"]
    assert any(leak["where"].endswith(".cache_data/answer_key.json") for leak in report["leaks"])
    assert [r for r in report["reasons"] if r.startswith("leaks: ")]


def test_unbuildable_env_fails_with_a_reason():
    report = _check("math", {"kind": "calculus"})
    assert not report["ok"] and "could not build the environment" in report["reasons"][0] and "calculus" in report["reasons"][0]


def test_require_env_ok_refuses_failing_envs_unless_told_otherwise():
    envs.register_env(WrongReferenceEnv)
    with pytest.raises(EnvQualityError, match="broken-wrong-reference.*failed the quality gate: oracle"):
        require_env_ok("broken-wrong-reference", SMALL, max_tasks=2, grader=LocalGrader())
    report = require_env_ok("broken-wrong-reference", SMALL, allow_failing=True, max_tasks=2, grader=LocalGrader())
    assert not report.ok
    assert require_env_ok("math", {}, max_tasks=2, grader=LocalGrader()).ok


def test_last_check_is_recorded_for_list():
    _check("math", {}, max_tasks=2)
    spec = next(s for s in envs.list_envs() if s.name == "math")
    assert spec.last_check is not None and spec.last_check["ok"] is True


def test_gate_uses_the_ray_grader_pool_when_ray_runs(ray_session):
    report = check_env("math", {}, max_tasks=2)
    assert report["ok"], report["reasons"]


def test_shell_and_code_pass_the_gate_on_docker(docker_image):
    for name in ("shell-fix-test", "code"):
        report = check_env(name, {"sandbox_backend": "docker"}, max_tasks=1, replays=2, grader=LocalGrader())
        assert report["ok"], (name, report["reasons"])
