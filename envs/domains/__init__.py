"""Built-in domains: math, code (incl. HumanEval), agentic shell, tool use (lookup)."""
from __future__ import annotations

MAX_TASKS = 1_000_000  # per split: more than any built-in generates, and than a run could use


def check_counts(env: str, n_train: int, n_heldout: int) -> None:
    """A constructor's task counts, refused in one line naming the environment and the argument: every
    environment needs a training task and a held-out one (an empty split fails at its first use)."""
    for arg, n in (("n_train", n_train), ("n_heldout", n_heldout)):
        if not 1 <= n <= MAX_TASKS:
            raise ValueError(f"{env}: {arg} must be between 1 and {MAX_TASKS:,}, got {n}")
