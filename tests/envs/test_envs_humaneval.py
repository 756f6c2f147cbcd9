"""HumanEval: every one of the 164 canonical solutions passes its tests in the sandbox."""
from __future__ import annotations

import envs
from envs.grades import GradeRequest
from envs.grading import LocalGrader


def _requests(env, solution_for):
    reqs = []
    for split in ("train", "heldout"):
        for task in env.dataset(split):
            payload = env.grade_payload(task, solution_for(task))
            reqs.append(GradeRequest(env=env.name, task_id=task["task_id"], grader=env.grader, payload=payload))
    return reqs


def test_all_164_canonical_solutions_pass_in_the_sandbox():
    env = envs.make("humaneval", sandbox_backend="process")
    reqs = _requests(env, lambda t: env.reference_actions_for(t)[0])
    assert len(reqs) == 164 and len({r.task_id for r in reqs}) == 164
    grades = LocalGrader(timeout_s=60, parallelism=3).grade_many(reqs, use_cache=False)  # 3 sandboxes at a time
    failed = [(r.task_id, g.error, g.details.get("stderr_tail")) for r, g in zip(reqs, grades) if not g.passed]
    assert not failed, failed[:3]


def test_wrong_humaneval_solutions_fail():
    env = envs.make("humaneval", sandbox_backend="process")
    stub = lambda t: f"```python\n{t['prompt']}    return None\n```"  # noqa: E731 - the signature, a wrong body
    reqs = _requests(env, stub)[:12]
    grades = LocalGrader(timeout_s=60, parallelism=3).grade_many(reqs, use_cache=False)
    assert not any(g.passed for g in grades)
