"""The sample table: recent rollouts of every run, filtered by run, family, domain, effort and reward."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rl.dashboard.model import RunData
from rl.metrics import family_of
from rl.types import RolloutRecord

MAX_ROWS = 500
GRADE_CHARS = 160
PROMPT_CHARS = 120


class QueryError(ValueError):
    """A filter value that cannot be used, phrased as one line."""


@dataclass(frozen=True)
class SampleQuery:
    run: str = ""  # "" = any
    family: str = ""  # a family's domains (FAMILY:member), or a domain outside any family
    domain: str = ""
    effort: str = ""
    min_reward: float | None = None
    max_reward: float | None = None
    limit: int = 100

    @classmethod
    def parse(cls, params: dict[str, str]) -> "SampleQuery":
        def number(name: str) -> float | None:
            raw = params.get(name, "").strip()
            if not raw:
                return None
            try:
                return float(raw)
            except ValueError:
                raise QueryError(f"{name} must be a number, got {raw!r}") from None
        limit = number("limit")
        if limit is not None and not 1 <= limit <= MAX_ROWS:
            raise QueryError(f"limit must be between 1 and {MAX_ROWS}, got {limit:g}")
        return cls(params.get("run", ""), params.get("family", ""), params.get("domain", ""), params.get("effort", ""),
                   number("min_reward"), number("max_reward"), int(limit or cls.limit))

    def matches(self, run: str, record: RolloutRecord) -> bool:
        reward = record.get("reward")
        reward = reward if isinstance(reward, (int, float)) else None
        return ((not self.run or run == self.run)
                and (not self.family or family_of(str(record.get("domain"))) == self.family)
                and (not self.domain or record.get("domain") == self.domain)
                and (not self.effort or record.get("effort") == self.effort)
                and (self.min_reward is None or (reward is not None and reward >= self.min_reward))
                and (self.max_reward is None or (reward is not None and reward <= self.max_reward)))


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def summary(run: str, record: RolloutRecord) -> dict[str, Any]:
    """One table row: what the sample was asked, how it went, which weights produced it."""
    transcript = record.get("transcript") or []
    prompt = next((m.get("content", "") for m in transcript if isinstance(m, dict) and m.get("role") == "user"), "")
    grade = record.get("grade")
    return {
        "run": run, "step": record.get("step"), "uid": record.get("uid"), "env": record.get("env"),
        "domain": record.get("domain"), "task_id": record.get("task_id"), "effort": record.get("effort"),
        "reward": record.get("reward"), "passed": record.get("passed"), "version": record.get("version"),
        "staleness": record.get("staleness"), "versions": record.get("versions"), "engine": record.get("engine"),
        "tokens": record.get("tokens"), "turns": record.get("turns"),
        "tool_calls": sum(1 for m in transcript if isinstance(m, dict) and m.get("role") == "tool"),
        "truncated": record.get("truncated"), "error": record.get("error"),
        "grade": _short(json.dumps(grade, ensure_ascii=False), GRADE_CHARS) if grade else "",
        "prompt": _short(str(prompt), PROMPT_CHARS),
    }


def find_samples(runs: list[RunData], query: SampleQuery) -> dict[str, Any]:
    """The newest matching samples first, and how many matched in all."""
    matched = [(run.name, rec) for run in runs for rec in run.samples if query.matches(run.name, rec)]
    matched.sort(key=lambda item: item[1].get("step") if isinstance(item[1].get("step"), int) else -1, reverse=True)
    return {"total": len(matched), "rows": [summary(name, rec) for name, rec in matched[: query.limit]]}


def find_sample(runs: list[RunData], run: str, uid: str) -> RolloutRecord | None:
    """A whole sample (transcript, grade details) by run and uid; the newest when a uid repeats."""
    for data in runs:
        if data.name == run:
            return next((rec for rec in reversed(data.samples) if rec.get("uid") == uid), None)
    return None


def filter_options(runs: list[RunData]) -> dict[str, list[str]]:
    from rl.dashboard.model import part_order

    domains = {str(r.get("domain")) for run in runs for r in run.samples if r.get("domain")}
    efforts = {str(r.get("effort")) for run in runs for r in run.samples if r.get("effort")}
    return {"runs": [run.name for run in runs], "families": sorted({family_of(d) for d in domains}),
            "domains": sorted(domains), "efforts": sorted(efforts, key=part_order)}
