"""The Environment API: tool-call parsing, episode flow, errors as observations, splits."""
from __future__ import annotations

import random

import pytest

import envs
from envs.grading import LocalGrader
from envs.toolcall import CLOSE, OPEN, check_arguments, format_tool_call, parse_turn


def test_parse_valid_call_and_plain_text():
    p = parse_turn("let me look " + format_tool_call("search", {"query": "amber-fox"}))
    assert p.call is not None and p.call.name == "search" and p.call.arguments == {"query": "amber-fox"}
    assert p.text == "let me look " and p.error is None
    plain = parse_turn("The answer is 4.")
    assert plain.call is None and plain.error is None and not plain.wants_tool


@pytest.mark.parametrize("text, fragment", [
    (OPEN + "{not json" + CLOSE, "invalid JSON"),
    (OPEN + "[1, 2]" + CLOSE, "JSON object"),
    (OPEN + '{"arguments": {}}' + CLOSE, "'name'"),
    (OPEN + '{"name": "x", "arguments": 3}' + CLOSE, "'arguments' must be"),
    (OPEN + '{"name": "x", "arguments": "{bad"}' + CLOSE, "not JSON"),
    ('{"name": "x"}' + CLOSE, "without"),
])
def test_parse_malformed_calls_give_errors(text, fragment):
    p = parse_turn(text)
    assert p.call is None and p.error is not None and fragment in p.error


def test_arguments_as_json_string_and_missing_close_tag_are_accepted():
    p = parse_turn(OPEN + '{"name": "search", "arguments": "{\\"query\\": \\"a\\"}"}')
    assert p.call is not None and p.call.arguments == {"query": "a"}


def test_parse_never_raises_on_random_text():
    rng = random.Random(0)
    alphabet = list('{}[]":,ab1 ') + [OPEN, CLOSE]
    for _ in range(2000):
        parse_turn("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))))


def test_check_arguments():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "enum": ["a", "b"]}},
              "required": ["n"], "additionalProperties": False}
    assert check_arguments(schema, {"n": 1, "s": "a"}) is None
    assert "missing" in check_arguments(schema, {"s": "a"})
    assert "type integer" in check_arguments(schema, {"n": True})
    assert "one of" in check_arguments(schema, {"n": 1, "s": "c"})
    assert "unexpected" in check_arguments(schema, {"n": 1, "zzz": 2})


def test_tools_are_openai_function_schemas():
    env = envs.make("lookup")
    (tool,) = env.tools
    assert tool["type"] == "function"
    assert tool["function"]["name"] == "search"
    assert tool["function"]["parameters"]["required"] == ["query"]


def test_episode_flow_with_malformed_and_unknown_tool_calls():
    env = envs.make("lookup", max_turns=4)
    obs, info = env.reset(seed=0, options={"effort": "low"})
    assert [m["role"] for m in obs] == ["system", "user"] and info["effort"] == "low"
    o, r, term, trunc, _ = env.step(OPEN + "{oops" + CLOSE)
    assert o.startswith("error: malformed tool call") and not term and not trunc and r == 0.0
    o, *_ = env.step(format_tool_call("nope", {}))
    assert "unknown tool 'nope'" in o
    o, *_ = env.step(format_tool_call("search", {"query": 5}))
    assert "must be of type string" in o
    o, r, term, trunc, _ = env.step(format_tool_call("search", {"query": "x"}))
    assert o is None and trunc and not term  # max_turns reached while still calling tools
    grade = env.grade()
    assert not grade.passed and grade.error is None
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("more")


def test_step_and_grade_before_reset_raise_clearly():
    env = envs.make("math")
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")
    with pytest.raises(RuntimeError, match="needs an episode"):
        env.grade_request()


def test_episode_cut_off_mid_tool_call_is_graded_as_truncated():
    """The token budget ran out inside a tool call: the partial call is an error observation and the
    episode is still running when the rollout worker asks for its grade (issue 9)."""
    env = envs.make("lookup")
    _, info = env.reset(seed=0)
    partial = env.reference_actions(info["task_id"])[0][:25]  # '<|tool_call|>{"name": "se'
    obs, _, terminated, truncated, _ = env.step(partial)
    assert obs.startswith("error: malformed tool call") and not (terminated or truncated) and not env.done
    request = env.grade_request()
    assert env.done and request.payload["truncated"] is True and request.payload["response"] is None
    grade = LocalGrader().grade(request)
    assert grade.error is None and not grade.passed and grade.reward == 0.0


def test_cut_off_shell_episode_is_graded_on_its_partial_state():
    env = envs.make("shell", sandbox_backend="process")
    _, info = env.reset(seed=0)
    task = env.task(info["task_id"])
    env.step(env.reference_actions(info["task_id"])[0])  # the file is written; the budget ends before "Done."
    env.step('<|tool_call|>{"name": "bash", "argu')
    grade = LocalGrader().grade(env.grade_request())
    env.close()
    assert grade.error is None and grade.passed, (task, grade)


def test_effort_is_validated_and_recorded_in_the_grade_request():
    env = envs.make("math")
    with pytest.raises(ValueError, match="unknown effort"):
        env.reset(seed=0, options={"effort": "extreme"})
    _, info = env.reset(seed=0, options={"effort": "high"})
    env.step(env.reference_actions(info["task_id"])[0])
    assert env.grade_request().effort == "high"


def test_same_seed_same_task_and_splits_are_disjoint():
    env = envs.make("math")
    a, ia = env.reset(seed=7)
    b, ib = env.reset(seed=7)
    assert a == b and ia["task_id"] == ib["task_id"]
    train, held = set(env.dataset("train")["task_id"]), set(env.dataset("heldout")["task_id"])
    assert train and held and not train & held
    held_q = set(env.dataset("heldout")["question"])
    assert not held_q & set(env.dataset("train")["question"])
    _, ih = env.reset(seed=1, options={"split": "heldout"})
    assert ih["task_id"] in held
    with pytest.raises(ValueError, match="unknown split"):
        env.dataset("test")
    with pytest.raises(KeyError, match="no task with task_id"):
        env.reset(options={"task_id": "nope"})


def test_grade_request_is_picklable_and_cache_key_is_stable():
    import pickle

    env = envs.make("math")
    _, info = env.reset(seed=3)
    env.step("The answer is 5.")
    req = env.grade_request()
    clone = pickle.loads(pickle.dumps(req))
    assert clone.cache_key() == req.cache_key()
    assert req.grader_version == "envs.domains.math.MathGrader@1"
