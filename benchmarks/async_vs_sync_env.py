"""The benchmark's workload: the `lookup` domain with a realistic long tail of tool and grader
latency (a Pareto-distributed `search` delay and a fixed grading delay), the same for every run
since each delay is a pure function of (task, turn). Registered by benchmarks/async_vs_sync.py."""
from __future__ import annotations

import random
import time
import zlib
from typing import Any

from envs.domains.lookup import LookupEnv, LookupGrader
from envs.grades import Grade, Grader


def delay_s(key: str, median_s: float, alpha: float, cap_s: float) -> float:
    """Pareto(alpha) scaled to the given median, capped: most calls are quick, a few very slow."""
    u = random.Random(zlib.crc32(key.encode())).random()
    scale = median_s * 0.5 ** (1 / alpha)  # Pareto's median is scale * 2^(1/alpha)
    return min(cap_s, scale * (1 - u) ** (-1 / alpha))


class SlowLookupGrader(LookupGrader):
    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    def score(self, payload: dict[str, Any]) -> Grade:
        time.sleep(self.latency_s)
        return super().score(payload)


class SlowLookupEnv(LookupEnv):
    """lookup, with `search` taking tool_median_s (Pareto tail alpha, capped) and grading grade_s."""

    name = "lookup-slow"

    def __init__(self, tool_median_s: float = 0.3, tool_alpha: float = 1.2, tool_cap_s: float = 8.0,
                 grade_s: float = 0.2, **kwargs: Any) -> None:
        self.tool_median_s, self.tool_alpha, self.tool_cap_s, self.grade_s = tool_median_s, tool_alpha, tool_cap_s, grade_s
        super().__init__(**kwargs)

    def make_grader(self) -> Grader:
        return SlowLookupGrader(self.grade_s)

    def search(self, query: str) -> str:
        key = f"{self._task['task_id'] if self._task else ''}/{self._seed}/{query}"
        time.sleep(delay_s(key, self.tool_median_s, self.tool_alpha, self.tool_cap_s))
        return super().search(query)
