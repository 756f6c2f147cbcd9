"""Deliberately broken environments: each must be caught by the quality gate for its own reason."""
from __future__ import annotations

import json
import random
from typing import Any

from envs.domains.math import MathEnv, MathGrader
from envs.domains.shell import ShellEnv
from envs.grades import Grade, Grader

SMALL = {"n_train": 12, "n_heldout": 4}


class WrongReferenceEnv(MathEnv):
    name = "broken-wrong-reference"

    def reference_actions_for(self, task: dict[str, Any]) -> list[str]:
        return [f"The answer is {int(task['answer']) + 1}."]


class AlternatingGrader(MathGrader):
    """Fails every second call: identical replays get different grades."""

    version = "flaky-1"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def score(self, payload: dict[str, Any]) -> Grade:
        self.calls += 1
        grade = super().score(payload)
        if self.calls % 2 == 0:
            return Grade(reward=0.0, passed=False, grader_version="", details={"flaked": True})
        return grade


class FlakyGraderEnv(MathEnv):
    name = "broken-flaky-grader"

    def make_grader(self) -> Grader:
        return AlternatingGrader()


class AcceptAllGrader(Grader):
    version = "lenient-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        return Grade(reward=1.0, passed=True, grader_version="")


class LenientGraderEnv(MathEnv):
    name = "broken-lenient-grader"

    def make_grader(self) -> Grader:
        return AcceptAllGrader()


class NondeterministicEnv(MathEnv):
    name = "broken-nondeterministic"

    def prompt(self, task: dict[str, Any]) -> str:
        return f"(ticket {random.randint(0, 10**9)}) {task['question']}"


class LeakedHiddenTestsEnv(ShellEnv):
    """Copies the hidden tests into the episode sandbox: the classic leak."""

    name = "broken-leaked-tests"

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        super().setup(task, sandbox)
        sandbox.write_file("hidden_tests.py", task["hidden_tests"])


class LeakedAnswerFileEnv(ShellEnv):
    """Leaves the expected answer in a file the policy can read."""

    name = "broken-leaked-answer"

    def setup(self, task: dict[str, Any], sandbox: Any) -> None:
        super().setup(task, sandbox)
        sandbox.write_file(".cache_data/answer_key.json", json.dumps({"answer": task["expect"]}))
