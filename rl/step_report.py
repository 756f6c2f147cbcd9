"""What a GRPO step says on the console: one plain line per step where the console is not a
terminal (output to a file or a pipe; a terminal gets the progress bars), one line for each step
the learner skipped and why, and the run's end-of-training summary, whose rates leave out the
skipped steps (a step with nothing to train is all rollout and no learner: its rates say nothing
about training speed)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rl.metrics import family_member

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

