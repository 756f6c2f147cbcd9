"""The quality gate: built-ins pass; each deliberately broken env is caught for the right reason,
without its author's help (no leak probes, no hints)."""
from __future__ import annotations

import json

import pytest

import envs
from envs.grading import LocalGrader
from envs.quality import EnvQualityError, check_env, require_env_ok
from envs_testutil import (SMALL, AnswerInSandboxFileEnv, AnswerInToolEnvironmentEnv, BrokenHeldoutEnv,
                           CrashOnMalformedCallEnv, FlakyGraderEnv, HangsOnNullEnv, HedgeAcceptingEnv, LeakedAnswerFileEnv,
                           LeakedHiddenTestsEnv, LeakyCheckToolEnv, LenientGraderEnv, NoisyPartialCreditEnv,
                           NondeterministicEnv, OwnAdversaryEnv, RaisesOnNullEnv, RunsToolsAfterFinalEnv,
                           SubstringLookupEnv, ToleranceEnv, ToleranceManyAnswersEnv, TruncationPassesEnv,
                           UnboundedToolEnv, WordCountEnv, WrongReferenceEnv)

PROC = {"sandbox_backend": "process"}
REQUIRED_KEYS = {"env", "ok", "oracle_pass_rate", "null_pass_rate", "adversarial_pass_rate", "deterministic",
                 "flaky_rate", "leaks", "tasks", "splits", "timings", "reasons", "findings", "reported", "adversaries",
                 "consistency", "class_version"}


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
    assert report["deterministic"] and report["leaks"] == [] and report["tasks"] == 6
    assert report["splits"] == {"train": 3, "heldout": 3}  # every split, max_tasks each
    assert report["consistency"]["regraded"] > 0 and not report["consistency"]["inconsistent"]
    assert {"null", "cheat", "found_answer", "hedge", "near_miss", "tool_abuse"} == set(report["adversaries"])
    assert report["timings"]["reset"]["n"] > 0 and report["timings"]["grade"]["mean_s"] >= 0
    json.dumps(report.to_dict())  # the report is plain JSON


def test_wrong_reference_is_caught():
    envs.register_env(WrongReferenceEnv)
    report = _check("broken-wrong-reference", SMALL)
    assert not report["ok"] and report["oracle_pass_rate"] == 0.0
    assert any(r.startswith("oracle: the reference solution failed on 6/6") for r in report["reasons"])
    assert report["flaky_rate"] == 0.0 and report["deterministic"]


def test_flaky_grader_is_caught():
    envs.register_env(FlakyGraderEnv)
    # one grade at a time: its pass/fail alternation then falls on each task's replays in turn
    report = check_env("broken-flaky-grader", SMALL, max_tasks=3, grader=LocalGrader(parallelism=1))
    assert not report["ok"] and report["flaky_rate"] == 1.0
    assert any(r.startswith("flaky grader: 6/6 tasks") for r in report["reasons"])


def test_lenient_grader_is_caught_by_null_and_adversarial_policies():
    envs.register_env(LenientGraderEnv)
    report = _check("broken-lenient-grader", SMALL)
    assert not report["ok"] and report["null_pass_rate"] == 1.0 and report["adversarial_pass_rate"] == 1.0
    assert any(r.startswith("null policy") for r in report["reasons"])
    assert any(r.startswith("adversary 'cheat/echo_prompt' passed 6/6 tasks") for r in report["reasons"])


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


def _refused(cls, kwargs=None, max_tasks=2):
    """Register a broken env, gate it, and return its report after checking it was refused."""
    envs.register_env(cls)
    report = _check(cls.name, SMALL if kwargs is None else kwargs, max_tasks=max_tasks)
    assert not report["ok"] and all("\n" not in r for r in report["reasons"])  # the trainer joins them in one line
    assert report["oracle_pass_rate"] == 1.0 or cls is BrokenHeldoutEnv  # the reference itself is fine
    return report


def _reason(report, start):
    found = [r for r in report["reasons"] if r.startswith(start)]
    assert found, (start, report["reasons"])
    return found[0]


def test_answer_in_an_innocent_sandbox_file_is_found_and_used():
    report = _refused(AnswerInSandboxFileEnv, PROC)
    line = _reason(report, "adversary 'found_answer/sandbox' passed 4/4 tasks")
    assert "/work/.meta/state.json" in line and report["leaks"] == []  # no author probe, no suspicious name
    finding = next(f for f in report["findings"] if f["adversary"] == "found_answer/sandbox")
    transcript = "\n".join(m["content"] for m in finding["transcript"])
    assert "cat '/work/.meta/state.json'" in transcript and finding["task_id"] in line


def test_answer_in_the_tools_environment_variables_is_found_and_used():
    report = _refused(AnswerInToolEnvironmentEnv, PROC)
    _reason(report, "adversary 'tool_abuse/junk_calls' passed 4/4 tasks")
    finding = next(f for f in report["findings"] if f["adversary"] == "tool_abuse/junk_calls")
    assert any("EXPECTED_COUNT=" in m["content"] for m in finding["transcript"] if m["role"] == "tool")


def test_honest_sandboxed_answer_env_passes():
    envs.register_env(WordCountEnv)
    report = _check(WordCountEnv.name, PROC, max_tasks=2)
    assert report["ok"], report["reasons"]
    assert report["adversarial"]["hedge/list"] == 0.0 and report["adversarial"]["near_miss/off_by_one"] == 0.0


def test_a_tool_that_reveals_the_answer_is_caught():
    report = _refused(LeakyCheckToolEnv)
    _reason(report, "adversary 'tool_abuse/junk_calls' passed 4/4")


def test_a_grader_accepting_a_pasted_tool_output_is_caught():
    report = _refused(SubstringLookupEnv)
    _reason(report, "adversary 'found_answer/tool_output_verbatim' passed 4/4")


def test_hedged_answers_are_caught():
    report = _refused(HedgeAcceptingEnv)
    for form in ("list", "or", "lines", "json", "boxed"):
        assert f"candidates, the answer" in _reason(report, f"adversary 'hedge/{form}' passed 4/4")


def test_near_misses_fail_where_one_answer_is_right_and_are_reported_elsewhere():
    report = _refused(ToleranceEnv)
    assert "-> '" in _reason(report, "adversary 'near_miss/off_by_one' passed 4/4")
    envs.register_env(ToleranceManyAnswersEnv)
    lenient = _check(ToleranceManyAnswersEnv.name, SMALL, max_tasks=2)
    assert lenient["ok"], lenient["reasons"]
    assert any(r.startswith("adversary 'near_miss/off_by_one' passed 4/4") and "reported, not failed" in r
               for r in lenient["reported"])


def test_math_read_out_of_prose_passes_the_gate_with_trailing_text_reported():
    # operands from 0: some tasks are "a + 0" or "0 + b", where echoing the question once passed
    report = _check("math", {"answer_style": "last_number", "max_operand": 3, "ops": "+", "n_train": 12,
                             "n_heldout": 4}, max_tasks=8)
    assert report["ok"], report["reasons"]
    assert any(r.startswith("adversary 'near_miss/extra_text' passed") and "answer_in_prose" in r
               for r in report["reported"])
    grader = envs.make("math", answer_style="last_number").grader
    assert grader({"response": "What is 0 + 5?", "gold": "5", "question": "What is 0 + 5?"}).reward == 0.0
    assert grader({"response": "0 + 5 = 5", "gold": "5", "question": "What is 0 + 5?"}).reward == 1.0


@pytest.mark.parametrize("cls, start", [
    (TruncationPassesEnv, "adversary 'tool_abuse/repeated_call' passed 4/4"),
    (UnboundedToolEnv, "unbounded tool output: 4 time(s) (e.g. 'tool_abuse/huge_output' got a 200"),
    (CrashOnMalformedCallEnv, "the environment raised: 4 time(s) (e.g. 'tool_abuse/junk_calls"),
    (RunsToolsAfterFinalEnv, "a turn after the final answer was accepted: 4 time(s) (e.g. 'tool_abuse/call_after_final'"),
])
def test_tool_call_abuse_is_caught(cls, start):
    _reason(_refused(cls), start)


def test_a_grader_that_raises_on_the_null_answer_fails_the_gate():
    report = _refused(RaisesOnNullEnv)
    assert "grader raised ValueError: cannot parse a number" in _reason(report, "grader errors: ")
    assert report["null_pass_rate"] == 0.0  # the old gate saw only this, and passed


def test_a_grader_that_hangs_fails_the_gate_and_stops_it():
    report = _refused(HangsOnNullEnv)
    assert "timed out after 1s" in _reason(report, "grader hung: ") and report["stopped"]


def test_a_grader_with_hidden_state_is_caught_by_regrading():
    report = _refused(NoisyPartialCreditEnv)
    _reason(report, "inconsistent grader: ")


def test_every_split_is_checked_unless_told_otherwise():
    report = _refused(BrokenHeldoutEnv)
    assert "(heldout)" not in _reason(report, "oracle: the reference solution failed on 2/4 tasks")
    assert report["problems"]["oracle"][0].startswith(tuple(envs.make("broken-heldout", **SMALL).dataset("heldout")["task_id"]))
    train_only = check_env("broken-heldout", SMALL, max_tasks=2, grader=LocalGrader(), splits=("train",))
    assert train_only["ok"] and train_only["splits"] == {"train": 2}


def test_an_environment_adds_its_own_adversary():
    report = _refused(OwnAdversaryEnv)
    assert "the debugging shortcut" in _reason(report, "adversary 'magic_word/xyzzy' passed 4/4")
    assert "magic_word" in report["adversaries"] and "near_miss" not in report["adversaries"]


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
    assert spec.last_check is not None and spec.last_check["ok"] is True and spec.last_check["tasks"] == 4


def test_gate_uses_the_ray_grader_pool_when_ray_runs(ray_session):
    report = check_env("math", {}, max_tasks=2)
    assert report["ok"], report["reasons"]


def test_shell_and_code_pass_the_gate_on_docker(docker_image):
    for name in ("shell-fix-test", "code"):
        report = check_env(name, {"sandbox_backend": "docker"}, max_tasks=1, replays=2, grader=LocalGrader())
        assert report["ok"], (name, report["reasons"])
