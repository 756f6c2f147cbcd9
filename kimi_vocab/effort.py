"""Reasoning-effort levels: the one definition the tokenizer, the environments and the trainer share."""
from __future__ import annotations

EFFORT_LEVELS: tuple[str, ...] = ("low", "medium", "high", "max")


def effort_order(level: str) -> int:
    """Sort key: the levels in order of effort, unknown names last."""
    return EFFORT_LEVELS.index(level) if level in EFFORT_LEVELS else len(EFFORT_LEVELS)
