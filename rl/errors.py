"""Errors the CLI reports as one line (no traceback)."""
from __future__ import annotations


class RunRefused(RuntimeError):
    """The run cannot start as asked (a failing environment, a folder that is not a run); one line."""
