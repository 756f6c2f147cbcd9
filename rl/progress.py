"""A progress bar per phase (rich), with a free-text status of the latest step's numbers."""
from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StepProgress:
    def __init__(self, title: str, total: int, completed: int = 0, enabled: bool = True, console=None) -> None:
        self.enabled = enabled and total > 0
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            disable=not self.enabled, console=console,  # the run's console: lines said print above the bar
        )
        self._task = self._progress.add_task(title, total=total, completed=completed, status="")

    def __enter__(self) -> "StepProgress":
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def advance(self, status: str) -> None:
        self._progress.update(self._task, advance=1, status=status)
