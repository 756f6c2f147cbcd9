"""Built-in domains: the reference passes and the null answer fails; toy sizes; data loading; verifier."""
from __future__ import annotations

import json

import datasets
import pytest

import envs
from envs.domains.mathcheck import equivalent, extract_answer
from envs.adversaries import NULL_ANSWER
from envs.gate_episodes import reference_policy, run_episode

PROC = {"sandbox_backend": "process"}
BUILTINS = [
    ("math", {}), ("math-word", {}), ("math", {"kind": "fractions", "max_operand": 9}),
    ("lookup", {}), ("lookup-docs", {}), ("lookup", {"values_per_key": 3}),
    ("multihop", {}), ("multihop", {"paths_per_start": 3}),
    ("code", PROC), ("code-generated", PROC), ("humaneval", PROC),
    ("shell", PROC), ("shell-fix-test", PROC), ("shell-sqlite", PROC),
]


def _play(env, task_id, actions):
    ep = run_episode(env, task_id, reference_policy(actions) if isinstance(actions, list) else actions)
    assert ep.error is None, ep.error
    return env.grader(ep.request.payload)


def _builtin_id(name: str, kwargs: dict) -> str:
    """The name, its kind and the other knobs it sets."""
    knobs = [k for k in kwargs if k not in ("kind", "sandbox_backend")]
    return "-".join([name, kwargs.get("kind", ""), *knobs])


@pytest.mark.parametrize("name, kwargs", BUILTINS, ids=[_builtin_id(n, k) for n, k in BUILTINS])
def test_reference_passes_and_null_fails(name, kwargs):
    env = envs.make(name, **kwargs)
    try:
        for task_id in env.dataset("train")["task_id"][:3] + env.dataset("heldout")["task_id"][:1]:
            good = _play(env, task_id, env.reference_actions(task_id))
            assert good.passed and good.reward == 1.0 and good.error is None, (task_id, good)
            bad = _play(env, task_id, lambda v: NULL_ANSWER)
            assert not bad.passed and bad.reward == 0.0, (task_id, bad)
    finally:
        env.close()


@pytest.mark.parametrize("name, kwargs", [("math", {}), ("lookup", {}), ("shell", PROC), ("code", PROC)])
def test_toy_defaults_are_big_enough_and_references_short(name, kwargs):
    env = envs.make(name, **kwargs)
    assert len(env.dataset("train")) >= 300 and len(env.dataset("heldout")) >= 50
    for task_id in env.dataset("train")["task_id"][:50]:
        for turn in env.reference_actions(task_id):
            assert len(turn) <= 110, turn  # roughly <= 40 BPE tokens for a small tokenizer


def test_a_key_with_several_values_is_answered_from_each_tasks_own():
    """values_per_key: one prompt, several answers (so none can be learned by heart); the search tool
    answers from the episode's task, and held-out keys are never trained on."""
    env = envs.make("lookup", values_per_key=3, n_train=60, n_heldout=12)
    train, held = env.dataset("train"), env.dataset("heldout")
    assert len(train) == 60 and len(held) == 12 and not set(train["key"]) & set(held["key"])
    by_key: dict[str, list[dict]] = {}
    for row in train:
        by_key.setdefault(row["key"], []).append(row)
    a, b = next(rows for rows in by_key.values() if len(rows) >= 2)[:2]
    assert a["question"] == b["question"] and a["answer"] != b["answer"]
    for task in (a, b):
        env.reset(seed=0, options={"task_id": task["task_id"]})
        assert env.search(task["key"]) == f"{task['key']}: {task['answer']}"
    # the other task's answer is wrong here
    assert not _play(env, a["task_id"], env.reference_actions(b["task_id"])).passed
    assert _play(env, a["task_id"], env.reference_actions(a["task_id"])).passed


def test_a_start_key_leads_along_each_tasks_own_path():
    env = envs.make("multihop", max_hops=3, paths_per_start=2, n_train=200, n_heldout=12)
    train = env.dataset("train")
    starts: dict[str, list[dict]] = {}
    for row in train:
        starts.setdefault(row["start"], []).append(row)
    a, b = next(rows for rows in starts.values() if len(rows) == 2 and rows[0]["path"] != rows[1]["path"])
    for task in (a, b):
        env.reset(seed=0, options={"task_id": task["task_id"]})
        hop = env.search(task["start"])
        want = f"go to {task['path'][1]}" if task["hops"] > 1 else task["answer"]
        assert hop == f"{task['start']}: {want}"
        assert _play(env, task["task_id"], env.reference_actions(task["task_id"])).passed


@pytest.mark.parametrize("name, kwargs, what", [
    ("lookup", {"values_per_key": 0}, "values_per_key"), ("lookup", {"values_per_key": 9}, "values_per_key"),
    ("lookup-docs", {"values_per_key": 2}, "values_per_key"), ("multihop", {"paths_per_start": 0}, "paths_per_start"),
])
def test_bad_repetition_knobs_fail_with_one_line(name, kwargs, what):
    with pytest.raises(ValueError, match=what) as e:
        envs.make(name, **kwargs)
    assert "\n" not in str(e.value)


def test_datasets_are_deterministic_from_the_seed():
    for name in ("math", "lookup", "shell", "code", "shell-sqlite", "shell-fix-test"):
        a, b = envs.make(name), envs.make(name)
        assert a.dataset("train")["task_id"] == b.dataset("train")["task_id"]
        assert a.dataset("train")[0] == b.dataset("train")[0]
    assert envs.make("math", seed=1).dataset("train")["question"] != envs.make("math").dataset("train")["question"]


def test_math_difficulty_knobs():
    env = envs.make("math", max_operand=5, ops="+", n_train=20, n_heldout=5)
    for row in env.dataset("train"):
        a, b = row["question"][len("What is "):-1].split(" + ")
        assert 0 <= int(a) <= 5 and 0 <= int(b) <= 5 and int(row["answer"]) == int(a) + int(b)
    with pytest.raises(ValueError, match="ops"):
        envs.make("math", ops="/")


@pytest.mark.parametrize("pred, gold, ok", [
    ("17", "17", True), ("17.0", "17", True), ("34/2", "17", True), (r"\frac{34}{2}", "17", True),
    ("+17", "17", True), ("1,000", "1000", True), ("0.5", "1/2", True), (r"\dfrac{2}{4}", "1/2", True),
    ("16", "17", False), ("8 - 4", "4", False), ("", "1", False), ("seventeen", "17", False),
])
def test_math_equivalence(pred, gold, ok):
    assert equivalent(pred, gold) is ok


def test_math_expressions_only_when_allowed_and_never_evaluated_as_code():
    assert equivalent("sqrt(2)/2", "1/sqrt(2)", allow_expressions=True)
    assert not equivalent("sqrt(2)/2", "1/sqrt(2)")
    assert not equivalent("__import__('os').getcwd()", "1", allow_expressions=True)
    assert not equivalent("2**10**10", "1", allow_expressions=True)


def test_answer_extraction():
    assert extract_answer("so... The answer is 17.") == "17"
    assert extract_answer(r"thus \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer("Answer: 4") == "4"
    assert extract_answer("") is None


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_tasks_from_local_files_through_datasets(tmp_path, fmt):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    path = tmp_path / f"tasks.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        ds = datasets.Dataset.from_list(rows)
        ds.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    env = envs.make("math", data_files=str(path))
    train, held = env.dataset("train"), env.dataset("heldout")
    assert len(train) + len(held) == 40 and len(held) > 0
    _, info = env.reset(seed=0)
    env.step(env.reference_actions(info["task_id"])[0])
    assert env.grade().passed


def test_missing_task_file_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="task file not found"):
        envs.make("math", data_files="./nope.jsonl").dataset("train")


def test_shell_state_persists_across_turns_and_grading_reads_final_state():
    env = envs.make("shell", **PROC)
    try:
        task_id = env.dataset("train")["task_id"][0]
        task = env.task(task_id)
        env.reset(seed=0, options={"task_id": task_id})
        env.step(envs.format_tool_call("bash", {"command": f"echo wrong > {task['path']}"}))
        obs, *_ = env.step(envs.format_tool_call("bash", {"command": f"cat {task['path']}"}))
        assert obs.startswith("wrong")  # the sandbox kept the file between turns
        env.step("Done.")
        assert not env.grade().passed
    finally:
        env.close()


def test_fix_test_hidden_tests_never_enter_the_policy_sandbox():
    env = envs.make("shell-fix-test", **PROC)
    try:
        task_id = env.dataset("train")["task_id"][0]
        task = env.task(task_id)
        env.reset(seed=0, options={"task_id": task_id})
        listing = env.sandbox.exec("ls -a; cat *", timeout=10).stdout
        assert "hidden" not in listing and task["hidden_tests"] not in listing
        for line in task["probe"].splitlines():
            assert line not in listing
    finally:
        env.close()


def test_code_exit_early_and_missing_function_fail():
    env = envs.make("code", **PROC)
    task_id = env.dataset("train")["task_id"][0]
    for attempt in ("```python\nimport sys\nsys.exit(0)\n```", "```python\nprint('hi')\n```", ""):
        assert not _play(env, task_id, [attempt]).passed
