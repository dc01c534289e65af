"""Progress bars on stderr (rich), so stdout stays clean for results that scripts read.

    with Progress() as progress:
        bar = progress.bar("iterations", total=20)
        progress.advance(bar)
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as _RichProgress


class Progress:
    """A thin wrapper: named bars with ETA, drawn only when stderr is a terminal."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.console = Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self._rich = _RichProgress(
            TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=self.console, transient=False, disable=not self.enabled,
        )

    def __enter__(self) -> Progress:
        self._rich.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rich.stop()

    def bar(self, description: str, total: float | None, completed: float = 0) -> TaskID:
        return self._rich.add_task(description, total=total, completed=completed)

    def reset(self, bar: TaskID, total: float | None) -> None:
        self._rich.reset(bar, total=total)

    def update(self, bar: TaskID, completed: float, total: float | None = None) -> None:
        self._rich.update(bar, completed=completed, total=total)

    def advance(self, bar: TaskID, amount: float = 1) -> None:
        self._rich.advance(bar, amount)

    def remove(self, bar: TaskID) -> None:
        self._rich.remove_task(bar)

    def log(self, message: str) -> None:
        """A status line on stderr that does not disturb the bars."""
        self.console.print(message, markup=False, highlight=False)
