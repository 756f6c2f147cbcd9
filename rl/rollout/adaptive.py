"""Adaptive domain weights (`rollout.adaptive`, off by default): draw more from domains whose training
pass rate sits in a useful band, less from solved or hopeless ones, never less than `floor` times the
configured weight.

A domain's pass rate is a decayed mean over the batches that held it (every sample reported, the
groups dynamic sampling dropped included: all-pass and all-fail groups are the evidence of a solved or
hopeless domain). Its weight is the configured one times a factor: 1 inside [low, high], falling
linearly to `floor` at a pass rate of 0 or 1; a domain seen fewer than `min_samples` times keeps 1.
So no domain's share of the draws falls below `floor` times its configured share. The state is part
of a checkpoint (scheduler.json), so a resumed run draws as the uninterrupted one would."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from rl.config import AdaptiveSamplingConfig
from rl.types import Sample


def distribution(weights: dict[str, float]) -> tuple[list[str], np.ndarray]:
    """Names with a positive weight, sorted, and their cumulative probabilities, as numpy's
    Generator.choice computes them from p (what SamplingPlan draws from: the same draws, without
    computing them again for every group)."""
    names = sorted(name for name, w in weights.items() if w > 0)
    p = np.array([weights[name] for name in names], dtype=float)
    cdf = (p / p.sum()).cumsum()
    cdf /= cdf[-1]
    return names, cdf


def draw(rng: np.random.Generator, cdf: np.ndarray) -> int:
    """rng.choice(len(cdf), p=p) for the p whose cdf this is: one uniform, searched."""
    return int(cdf.searchsorted(rng.random(), side="right"))


class AdaptiveWeights:
    def __init__(self, base: dict[str, float], cfg: AdaptiveSamplingConfig) -> None:
        self.base = dict(base)
        self.low, self.high, self.floor, self.min_samples, self.decay = cfg.low, cfg.high, cfg.floor, \
            cfg.min_samples, cfg.decay
        self.seen: dict[str, list[float]] = {}  # domain (the config entry) -> [decayed samples, decayed passes]
        self._set_weights()

    def factor(self, domain: str) -> float:
        """The multiplier on a domain's configured weight, in [floor, 1]."""
        n, passed = self.seen.get(domain, (0.0, 0.0))
        if n < self.min_samples:
            return 1.0
        rate = passed / n
        if rate < self.low:
            off = (self.low - rate) / self.low
        elif rate > self.high:
            off = (rate - self.high) / (1.0 - self.high)
        else:
            return 1.0
        return 1.0 - (1.0 - self.floor) * off

    def observe(self, samples: Iterable[Sample]) -> None:
        """One batch's samples: each domain in it decays its history once, then adds the batch's."""
        counts: dict[str, list[float]] = {}
        for s in samples:
            if s.segment == 0:  # an episode once, however many segments it trained as
                c = counts.setdefault(s.env, [0.0, 0.0])
                c[0] += 1.0
                c[1] += float(s.passed)
        for env, (n, passed) in counts.items():
            if env not in self.base:
                continue
            old = self.seen.get(env, [0.0, 0.0])
            self.seen[env] = [self.decay * old[0] + n, self.decay * old[1] + passed]
        self._set_weights()

    def _set_weights(self) -> None:
        self._weights = {env: w * self.factor(env) for env, w in self.base.items()}
        self._distribution = distribution(self._weights)  # computed once a batch, drawn from many times

    def weights(self) -> dict[str, float]:
        return self._weights

    def distribution(self) -> tuple[list[str], np.ndarray]:
        return self._distribution

    def metrics(self) -> dict[str, float]:
        """How many domains are drawn below their configured weight, and the configured share moved."""
        factors = {env: self.factor(env) for env in self.base}
        total, moved = sum(self.base.values()), sum(self._weights.values())
        return {"sampling/domains_down": float(sum(f < 1.0 for f in factors.values())),
                "sampling/domains_measured": float(sum(self.seen.get(e, (0.0,))[0] >= self.min_samples
                                                       for e in self.base)),
                "sampling/weight_kept": moved / total if total else 1.0}

    def to_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def restore(self, data: dict[str, Any]) -> None:
        self.seen = {env: [float(n), float(p)] for env, (n, p) in data.get("seen", {}).items()}
        self._set_weights()
