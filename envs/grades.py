"""Grade records and the grader interface shared by environments and the grader service."""
from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Grade:
    """The outcome of grading one episode. `error` is set when the grader itself failed."""

    reward: float
    passed: bool
    grader_version: str
    error: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def failed(cls, grader_version: str, error: str, **details: Any) -> "Grade":
        """A failed grade: the floor reward, never passed, with a one-line reason."""
        return cls(reward=0.0, passed=False, grader_version=grader_version, error=error, details=dict(details))


class Grader:
    """Grades a payload (plain data captured at the end of an episode) into a Grade.

    Subclasses set `version` and implement `score`. Bump `version` whenever scoring changes:
    the grade cache is keyed by it, and every Grade records it.
    Instances are pickled into Ray actors, so keep their state small and picklable.
    """

    version: str = "0"
    timeout_s: float = 30.0  # the grader service gives up on a call after this long

    def score(self, payload: dict[str, Any]) -> Grade:
        raise NotImplementedError(f"{type(self).__name__}.score is not implemented")

    @property
    def full_version(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}@{self.version}"

    def __call__(self, payload: dict[str, Any]) -> Grade:
        """Run `score`, turning any exception into a failed Grade (a grader must not raise)."""
        start = time.perf_counter()
        try:
            grade = self.score(payload)
            if not isinstance(grade, Grade):
                raise TypeError(f"score() returned {type(grade).__name__}, expected Grade")
        except Exception as exc:  # noqa: BLE001 - any grader bug becomes a failed grade record
            tb = traceback.format_exc(limit=3)
            grade = Grade.failed(self.full_version, f"grader raised {type(exc).__name__}: {exc}", traceback=tb)
        grade.grader_version = self.full_version
        grade.details.setdefault("grade_s", round(time.perf_counter() - start, 6))
        return grade


@dataclass
class GradeRequest:
    """Everything needed to grade one finished episode, detached from its sandbox (picklable)."""

    env: str
    task_id: str
    grader: Grader
    payload: dict[str, Any]
    effort: str = "medium"

    @property
    def grader_version(self) -> str:
        return self.grader.full_version

    def cache_key(self) -> str:
        """Stable key over grader version and input: the same answer is never graded twice."""
        blob = json.dumps(
            {"v": self.grader_version, "env": self.env, "task": self.task_id, "payload": self.payload},
            sort_keys=True,
            default=_json_fallback,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


def _json_fallback(obj: Any) -> str:
    if isinstance(obj, (bytes, bytearray)):
        return "sha256:" + hashlib.sha256(bytes(obj)).hexdigest()
    return repr(obj)
