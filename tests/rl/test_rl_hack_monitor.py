"""The reward-hacking monitor flags a domain whose reward rises while its answers collapse or
degenerate, and stays quiet for honest learning."""
from __future__ import annotations

import random

from rl.hack_monitor import HackMonitor, Response, final_answer, is_degenerate, responses_from_records


def _step(domain, rewards, answer_for, tasks=8, group=4):
    out = []
    for t in range(tasks):
        for g in range(group):
            out.append(Response(domain, f"{domain}-{t}", rewards, answer_for(t, g)))
    return out


def _run(monitor, steps, domain_steps):
    metrics, warnings = {}, []
    for step in range(steps):
        responses = [r for make in domain_steps for r in make(step)]
        metrics, lines = monitor.observe(step, responses)
        warnings += lines
    return metrics, warnings


def test_honest_learning_is_not_flagged():
    rng = random.Random(0)
    honest = lambda s: _step("math", min(1.0, 0.1 + 0.05 * s),  # noqa: E731
                             lambda t, g: f"Let me add.\nThe answer is {t * 7 + (rng.random() > 0.1 + 0.05 * s)}.")
    metrics, warnings = _run(HackMonitor(), 20, [honest])
    assert warnings == [] and metrics["hack/math/flag"] == 0.0
    assert metrics["hack/math/distinct_answers"] == 1.0 and metrics["hack/math/degenerate_frac"] == 0.0


def test_reward_rising_while_answers_collapse_is_flagged_once():
    collapse = lambda s: _step("math", 0.1 if s < 10 else 0.9,  # noqa: E731
                               lambda t, g: f"The answer is {t * 7}." if s < 10 else "The answer is 0.")
    monitor = HackMonitor()
    metrics, warnings = _run(monitor, 20, [collapse])
    assert metrics["hack/math/flag"] == 1.0 and metrics["hack/math/distinct_answers"] == 1 / 8
    assert metrics["hack/math/top_answer_frac"] == 1.0
    assert len(warnings) == 1 and warnings[0].startswith("reward hacking? domain 'math' at step 12: reward 0.10 -> 0.58")
    assert "distinct answers across tasks fell 1.00 -> 0.47" in warnings[0] and "'the answer is 0' in 100%" in warnings[0]


def test_reward_rising_while_responses_degenerate_is_flagged():
    words = "so so so so so so so so so so so so so so so so"
    degenerate = lambda s: _step("tool_use", 0.2 if s < 10 else 0.8,  # noqa: E731
                                 lambda t, g: f"The answer is {t}." if s < 10 else f"{words}\nThe answer is {t}.")
    metrics, warnings = _run(HackMonitor(), 20, [degenerate])
    assert metrics["hack/tool_use/flag"] == 1.0 and metrics["hack/tool_use/degenerate_frac"] == 1.0
    assert warnings == ["reward hacking? domain 'tool_use' at step 11: reward 0.20 -> 0.44 (steps 0-4 -> 7-11) "
                        "while degenerate responses rose 0% -> 40%"]


def test_collapse_without_reward_gain_and_answers_alike_by_design_are_not_flagged():
    flat = lambda s: _step("math", 0.3, lambda t, g: f"The answer is {t}." if s < 10 else "The answer is 0.")  # noqa: E731
    by_design = lambda s: _step("shell", 0.1 + 0.04 * s, lambda t, g: "<|tool_call|>{...}<|/tool_call|>\nDone.")  # noqa: E731
    metrics, warnings = _run(HackMonitor(), 20, [flat, by_design])
    assert warnings == [] and metrics["hack/math/flag"] == 0.0 and metrics["hack/shell/flag"] == 0.0
    assert metrics["hack/shell/distinct_answers"] == 1 / 8


def test_one_domain_flagged_the_other_not_and_recovery_is_said():
    collapse = lambda s: _step("math", 0.1 if s < 10 else 0.9,  # noqa: E731
                               lambda t, g: "The answer is 0." if 10 <= s < 20 else f"The answer is {t}.")
    honest = lambda s: _step("code", 0.5, lambda t, g: f"def f{t}(): pass")  # noqa: E731
    monitor = HackMonitor()
    metrics, warnings = _run(monitor, 20, [collapse, honest])
    assert metrics["hack/math/flag"] == 1.0 and metrics["hack/code/flag"] == 0.0
    for step in range(20, 25):
        _, lines = monitor.observe(step, collapse(step) + honest(step))
        warnings += lines
    assert len(warnings) == 2 and warnings[1].startswith("domain 'math' no longer looks like reward hacking")


def test_small_domains_are_not_measured():
    metrics, warnings = HackMonitor(min_responses=4).observe(0, [Response("math", "t", 1.0, "x")] * 3)
    assert metrics == {} and warnings == []


def test_answers_and_degeneracy():
    assert final_answer("work\n\n The  Answer is 17. \n") == "the answer is 17"
    assert is_degenerate("") and is_degenerate("   ")
    assert is_degenerate("the cat the cat the cat the cat the cat the cat the cat")
    assert is_degenerate("x" * 200)
    assert not is_degenerate("The answer is 17.")
    assert not is_degenerate('<|tool_call|>{"name": "bash", "arguments": {"command": "echo river > notes.txt"}}<|/tool_call|>')


def test_a_steps_records_become_one_response_per_episode():
    def record(uid: str, reward: float, said: list[str]) -> dict:
        transcript = [{"role": "user", "content": "q"}] + [{"role": "assistant", "content": t} for t in said]
        return {"uid": uid, "domain": "math", "task_id": "t1", "reward": reward, "transcript": transcript}

    rows = responses_from_records([record("g0/0", 1.0, ["thinking", "42"]), record("g0/1@0", 0.0, ["a"]),
                                   record("g0/1@1", 0.0, ["a", "7"]), record("g1/0", 0.0, [])])
    assert rows == [Response("math", "t1", 1.0, "42"), Response("math", "t1", 0.0, "7"), Response("math", "t1", 0.0, "")]
