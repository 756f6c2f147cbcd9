"""Errors the CLI reports as one line (no traceback)."""
from __future__ import annotations


class RunRefused(RuntimeError):
    """The run cannot start as asked (a failing environment, a folder that is not a run); one line."""


class RunStopped(RuntimeError):
    """The run stopped before its end (a signal, an actor that died for good, a full disk). The
    message is the one line to print (rl.faults.stop_line); exit_code the process's."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
