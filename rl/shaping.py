"""Effort-aware length shaping of rewards: the trainer's, never the environments' (they return their
verifier's score, kept in `Sample.reward` and in rollouts.jsonl beside the shaped reward). Pure
functions, applied by the learner to a batch's episodes before advantages (rl/learner/learner.py).

Per effort level (`effort.shaping.<level>`, rl.config.LevelShaping), with B the episode's budget and
n the tokens it generated (reasoning and response, every turn and segment):
- soft overlong penalty (DAPO's Eq. 13 with L_max = B, L_cache = overlong_buffer):
  0 while n <= B - buffer, then -overlong_penalty * (n - (B - buffer)) / buffer, down to
  -overlong_penalty at B (the budget is a hard cap: the worker never lets n pass it);
- length cost: -length_cost * n / B (e.g. at low effort: of two right answers, the shorter wins).
Shaping only ever lowers a reward, and the config keeps overlong_penalty + length_cost below 1: a
passing episode (1) always keeps more than a failing one (0), so no verdict is bought with length.
An episode with no recorded budget (0) is left as it is."""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from rl.config import LevelShaping
from rl.types import Sample


def overlong_penalty(tokens: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment against `budget`, scaled by `penalty` (<= 0)."""
    if buffer <= 0 or penalty <= 0 or budget <= 0:
        return 0.0
    over = tokens - (budget - buffer)
    if over <= 0:
        return 0.0
    return -penalty * min(over / buffer, 1.0)


def length_cost(tokens: int, budget: int, cost: float) -> float:
    """-cost times the share of the budget used (<= 0)."""
    if cost <= 0 or budget <= 0:
        return 0.0
    return -cost * min(tokens / budget, 1.0)


def shape_rewards(samples: Sequence[Sample], shaping: Mapping[str, LevelShaping]
                  ) -> tuple[list[float], dict[str, float]]:
    """The shaped reward of every sample (a segment takes its episode's), and per level present:
    shaping/<level>/{reward, shaped_reward, overlong, length_cost, in_buffer, budget_used}, each
    episode once."""
    tokens: dict[str, int] = defaultdict(int)
    first: dict[str, Sample] = {}
    for s in samples:
        tokens[s.episode] += s.response_tokens
        first.setdefault(s.episode, s)
    shaped: dict[str, float] = {}
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key, s in first.items():
        level = shaping.get(s.effort)
        n, budget = tokens[key], s.budget
        over = overlong_penalty(n, budget, level.overlong_buffer, level.overlong_penalty) if level else 0.0
        cost = length_cost(n, budget, level.length_cost) if level else 0.0
        shaped[key] = s.reward + over + cost
        row = sums[s.effort]
        row["episodes"] += 1
        row["reward"] += s.reward
        row["shaped_reward"] += shaped[key]
        row["overlong"] += over
        row["length_cost"] += cost
        row["in_buffer"] += over < 0
        row["budget_used"] += n / budget if budget > 0 else 0.0
    metrics = {f"shaping/{effort}/{name}": value / row["episodes"]
               for effort, row in sums.items() for name, value in row.items() if name != "episodes"}
    return [shaped[s.episode] for s in samples], metrics
