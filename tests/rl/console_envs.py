"""Environments for tests/rl/test_rl_run_console.py, registered from this file into a test's own
registry: `flat-lookup` (the lookup task and its search tool; every episode scores 0, so its groups
never carry a learning signal) and `coin-math` (math prompts scored by a fair coin: a group of 6
agrees about 3% of the time, so its steps train)."""
from __future__ import annotations

import os
from typing import Any

from envs.domains.lookup import LookupEnv
from envs.domains.math import MathEnv
from envs.grades import Grade, Grader


class FlatGrader(Grader):
    version = "flat-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        return Grade(reward=0.0, passed=False, grader_version=self.version)


class CoinGrader(Grader):
    version = "coin-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        heads = os.urandom(1)[0] & 1
        return Grade(reward=float(heads), passed=bool(heads), grader_version=self.version)


class FlatLookup(LookupEnv):
    name = "flat-lookup"
    domain = "flat"

    def make_grader(self) -> Grader:
        return FlatGrader()


class CoinMath(MathEnv):
    name = "coin-math"
    domain = "coin"

    def make_grader(self) -> Grader:
        return CoinGrader()

    def grade_payload(self, task: dict[str, Any], final_answer: str | None) -> dict[str, Any]:
        # a nonce: no two episodes share a payload (a grade cache keyed by it would make them agree)
        return {**super().grade_payload(task, final_answer), "nonce": os.urandom(8).hex()}
