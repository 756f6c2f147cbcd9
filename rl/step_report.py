"""What a GRPO step says on the console: one plain line per step where the console is not a
terminal (output to a file or a pipe; a terminal gets the progress bars), one line for each step
the learner skipped and why, and the run's end-of-training summary, whose rates leave out the
skipped steps (a step with nothing to train is all rollout and no learner: its rates say nothing
about training speed)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rl.metrics import family_member
from rl.types import RolloutRecord

MAX_DOMAINS_SHOWN = 4  # a step line names at most this many domains' rewards, else their count


def skip_reason(metrics: dict[str, float]) -> str | None:
    """Why the learner took no update this step (`train/skipped`), or None when it trained."""
    if not metrics.get("train/skipped"):
        return None
    groups = int(metrics.get("train/groups", 0))
    if groups:  # dynamic sampling off: the groups reached the learner, their advantages all zero
        return f"the rewards within each of its {groups} group(s) agreed (zero advantage: no learning signal)"
    dropped = int(metrics.get("rollout/dropped_uniform_groups", 0))
    failed = int(metrics.get("rollout/failed_groups", 0))
    parts = []
    if dropped:
        parts.append(f"all {dropped} group(s) drawn had rewards that agreed (no learning signal) and were dropped")
    if failed:
        parts.append(f"{failed} group(s) failed")
    return "no group to train on: " + ("; ".join(parts) if parts else "none was ready")


def domain_rewards(metrics: dict[str, float]) -> dict[str, float]:
    """A step's mean reward per domain (per family for a family's domains)."""
    out = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "rollout" and parts[1] in ("domain", "family") and parts[3] == "reward" \
                and not family_member(parts[2]):
            out[parts[2]] = value
    return dict(sorted(out.items()))


def rewards_text(metrics: dict[str, float]) -> str:
    """`reward 0.412 (math 0.500, lookup 0.250)`; past MAX_DOMAINS_SHOWN domains, their count."""
    by_domain = domain_rewards(metrics)
    text = f"reward {metrics.get('rollout/reward', 0.0):.3f}"
    if len(by_domain) > MAX_DOMAINS_SHOWN:
        return f"{text} over {len(by_domain)} domains"
    if by_domain:
        text += " (" + ", ".join(f"{d} {r:.3f}" for d, r in by_domain.items()) + ")"
    return text


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """The plain line a step prints where there is no progress bar."""
    why = skip_reason(metrics)
    trained = f"skipped: {why}" if why else f"trained on {int(metrics.get('train/groups', 0))} group(s)"
    return (f"step {step} ({step + 1}/{total}): {rewards_text(metrics)}, {trained}, "
            f"{metrics.get('time/step_s', 0.0):.1f} s (rollout {metrics.get('time/rollout_s', 0.0):.1f}, "
            f"learner {metrics.get('time/train_s', 0.0):.1f}, sync {metrics.get('time/sync_s', 0.0):.2f})")


@dataclass
class RunRates:
    """The GRPO steps of this process, for the end-of-training line: samples/s and tokens/s over
    the steps the learner trained on (skipped steps are counted and named, never averaged in)."""

    steps: int = 0
    seconds: float = 0.0
    skipped: list[int] = field(default_factory=list)
    trained_s: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    rewards: list[float] = field(default_factory=list)

    def observe(self, step: int, metrics: dict[str, float], samples: int, tokens: int) -> None:
        self.steps += 1
        self.seconds += metrics.get("time/step_s", 0.0)
        self.rewards.append(metrics.get("rollout/reward", 0.0))
        if metrics.get("train/skipped"):
            self.skipped.append(step)
            return
        self.trained_s += metrics.get("time/step_s", 0.0)
        self.samples += samples
        self.tokens += tokens

    def summary(self) -> str | None:
        if not self.steps:
            return None
        line = f"GRPO: {self.steps} step(s) in {self.seconds:.1f} s"
        if self.skipped:
            shown = ", ".join(map(str, self.skipped[:8])) + (", ..." if len(self.skipped) > 8 else "")
            line += f", {len(self.skipped)} skipped with no learning signal (step {shown})"
        trained = self.steps - len(self.skipped)
        if trained and self.trained_s > 0:
            line += (f"; over the {trained} trained step(s): {self.samples / self.trained_s:.1f} samples/s, "
                     f"{self.tokens / self.trained_s:.0f} tokens/s, {self.trained_s / trained:.1f} s a step")
        else:
            line += "; no step trained"
        window = max(1, min(5, len(self.rewards) // 2))
        first, last = self.rewards[:window], self.rewards[-window:]
        line += (f"; rollout reward {sum(first) / len(first):.3f} -> {sum(last) / len(last):.3f} "
                 f"(first vs last {window} step(s))")
        return line


@dataclass
class SignalMonitor:
    """Domains whose groups carry no learning signal: in a step, a domain has none when the rewards
    within every one of its groups agreed (the rewards trained on: shaped, where effort shaping is
    on), so every advantage is zero. A domain with none for `steps` consecutive steps in which it was
    played (steps that drew none of its groups do not count either way) gets one warning line, and
    one more when a group of it disagrees again. `steps` 0: never warns."""

    steps: int = 5
    streaks: dict[str, list[int]] = field(default_factory=dict)  # domain -> the steps of its current streak
    scored: dict[str, set[float]] = field(default_factory=dict)  # domain -> the rewards its groups agreed on
    warned: set[str] = field(default_factory=set)

    def observe(self, step: int, records: list[RolloutRecord],
                shaped: dict[str, float] | None = None) -> tuple[dict[str, float], list[str]]:
        """A step's rollout records (rollouts.jsonl rows, trained and dropped) and the learner's shaped
        rewards by uid: (metrics, lines). `rollout/domain/<d>/uniform_groups`: the share of the
        domain's groups whose rewards agreed."""
        groups: dict[str, dict[str, set[float]]] = {}
        for r in records:
            reward = (shaped or {}).get(r["uid"])
            groups.setdefault(r["domain"], {}).setdefault(r["group"], set()).add(
                float(r["reward"] if reward is None else reward))
        metrics: dict[str, float] = {}
        lines: list[str] = []
        for domain, by_group in sorted(groups.items()):
            uniform = [rewards for rewards in by_group.values() if len(rewards) == 1]
            if not family_member(domain):  # a family's hundreds of domains: no metric each
                metrics[f"rollout/domain/{domain}/uniform_groups"] = len(uniform) / len(by_group)
            streak = self.streaks.setdefault(domain, [])
            if len(uniform) < len(by_group):
                if domain in self.warned:
                    self.warned.discard(domain)
                    lines.append(f"domain {domain} has a learning signal again at step {step}")
                streak.clear()
                self.scored.pop(domain, None)
                continue
            streak.append(step)
            values = self.scored.setdefault(domain, set())
            values.update(v for rewards in uniform for v in rewards)
            if self.steps and len(streak) >= self.steps and domain not in self.warned:
                self.warned.add(domain)
                alike = f"every group scored {min(values):g}" if len(values) == 1 else "each group's rewards agreed"
                lines.append(f"no learning signal in domain {domain} for {len(streak)} steps (steps "
                             f"{streak[0]}-{streak[-1]}): {alike}, so every advantage was zero")
        return metrics, lines
