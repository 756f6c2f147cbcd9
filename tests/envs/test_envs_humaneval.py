"""HumanEval: all 164 problems pass the quality gate (canonical solutions pass in the sandbox, cheats do not)."""
from __future__ import annotations

import envs
from envs.grades import GradeRequest
from envs.grading import LocalGrader
from envs.quality import check_env


def _requests(env, solution_for):
    reqs = []
    for split in ("train", "heldout"):
        for task in env.dataset(split):
            payload = env.grade_payload(task, solution_for(task))
            reqs.append(GradeRequest(env=env.name, task_id=task["task_id"], grader=env.grader, payload=payload))
    return reqs


def test_humaneval_passes_the_gate_on_all_164_problems():
    """Every split, every problem: the canonical solutions pass, no adversary does (one replay each:
    the graders' consistency is still checked by regrading)."""
    report = check_env("humaneval", {"sandbox_backend": "process"}, replays=1, record=False,
                       grader=LocalGrader(timeout_s=60, parallelism=3))  # 3 sandboxes at a time
    assert report["ok"], report["reasons"]
    assert report["tasks"] == 164 and sum(report["splits"].values()) == 164 and report["oracle_pass_rate"] == 1.0
    assert report["consistency"]["regraded"] > 0 and report["adversarial_pass_rate"] == 0.0


def test_wrong_humaneval_solutions_fail():
    env = envs.make("humaneval", sandbox_backend="process")
    stub = lambda t: f"```python\n{t['prompt']}    return None\n```"  # noqa: E731 - the signature, a wrong body
    reqs = _requests(env, stub)[:12]
    grades = LocalGrader(timeout_s=60, parallelism=3).grade_many(reqs, use_cache=False)
    assert not any(g.passed for g in grades)
