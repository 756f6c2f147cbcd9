"""Graders that misbehave on purpose (importable by Ray workers through this module)."""
from __future__ import annotations

import os
import time
from typing import Any

from envs.grades import Grade, Grader


class SleepyGrader(Grader):
    """Hangs far longer than its timeout."""

    version = "sleepy-1"
    timeout_s = 1.0

    def score(self, payload: dict[str, Any]) -> Grade:
        time.sleep(payload.get("sleep", 120))
        return Grade(reward=1.0, passed=True, grader_version="")


class CrashingGrader(Grader):
    """Kills its own process, as a segfaulting native grader would."""

    version = "crash-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        os._exit(13)


class RaisingGrader(Grader):
    version = "raise-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        raise ValueError("the grader has a bug")


class CountingGrader(Grader):
    """Passes when payload['x'] is even; reports the process id so tests can see where it ran."""

    version = "count-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        ok = payload["x"] % 2 == 0
        return Grade(reward=float(ok), passed=ok, grader_version="", details={"pid": os.getpid()})


class ExitingGrader(Grader):
    version = "exit-1"

    def score(self, payload: dict[str, Any]) -> Grade:
        raise SystemExit(3)
