"""A wall-clock budget for a whole run: start no iteration that would end past it.

    budget = TimeBudget(minutes=15)
    budget.restore(checkpoint_state.get("budget"))   # a resumed run: the time already spent counts
    budget.reserve_s = 1.15 * eval_seconds          # kept for the final evaluation and export
    while budget.allows_next():
        t = time.perf_counter(); run_iteration(); budget.record(time.perf_counter() - t)

The next iteration's length is estimated as the longest of the last ESTIMATE_WINDOW measured ones:
iterations vary with dynamic sampling, completion length and the machine's load (25-45 s on one
2-core run), and the budget is a promise, so the estimate errs long. With the mean, a 15-minute
default run on a shared CPU started its last iteration on a 37 s estimate, took 49 s and ended at
15:19; the longest of the last 3 would have stopped one iteration earlier (docs/benchmarks.md,
"learning"). A short window still follows the trend.
Before any iteration is measured the first one starts whenever the reserve still fits. The clock
counts everything since the run started (model loading and evaluations included; from the command
line also the interpreter's start-up, `process_age_s`), and a resumed run carries the time its
earlier part spent, so a budget of 15 minutes means 15 minutes in total.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

ESTIMATE_WINDOW = 3
"""Iterations whose longest is the estimate of the next one."""

FINAL_EVAL_MARGIN = 1.15
"""The final evaluation is estimated as this times the measured one before training (completions
may grow with training, and the export follows it), and so is its clue-ablated repeat. Measured in
the main job: the final evaluation took 0.92-1.05 times the first, the clue-ablated repeat
0.78-0.95. The margin also covers the first iteration, which starts unestimated: with the repeat
counted at 0.95 instead, a 15-minute run on a 2-core EPYC started its first RL iteration with 5 s
to spare, took 60 s on it and ended at 15:18 (docs/log.md, 2026-12-07)."""


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere). `sleuth train` re-executes
    itself with its allocator preloaded, which keeps the process and its start time, so this counts
    the interpreter's start-up and imports too: what a user timing the command sees."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class TimeBudget:
    """Elapsed time, measured iteration lengths, and the decision to start another iteration."""

    def __init__(self, minutes: float | None, elapsed_before_s: float = 0.0,
                 iteration_s: list[float] | None = None, reserve_s: float = 0.0) -> None:
        self.limit_s = None if minutes is None else minutes * 60.0
        self.elapsed_before_s = elapsed_before_s
        self.iteration_s = list(iteration_s or [])
        self.reserve_s = reserve_s
        """Seconds kept free for what follows the last iteration (final evaluation, export)."""
        self._start = time.perf_counter()

    def restore(self, saved: dict[str, Any] | None) -> None:
        """Continue from a checkpoint's budget state (the time it had spent is added to the clock)."""
        if saved:
            self.elapsed_before_s += float(saved["elapsed_s"])
            self.iteration_s = [float(s) for s in saved["iteration_s"]]
            self.reserve_s = float(saved["reserve_s"])

    def state(self) -> dict[str, Any]:
        return {"elapsed_s": self.elapsed_s(), "iteration_s": self.iteration_s, "reserve_s": self.reserve_s}

    def elapsed_s(self) -> float:
        return self.elapsed_before_s + time.perf_counter() - self._start

    def record(self, seconds: float) -> None:
        """The measured length of an iteration just finished."""
        self.iteration_s.append(seconds)

    def estimate_s(self) -> float | None:
        """Expected length of the next iteration, erring long (None before any was measured)."""
        recent = self.iteration_s[-ESTIMATE_WINDOW:]
        return max(recent) if recent else None

    def allows_next(self, ahead: int = 0) -> bool:
        """True when the next iteration (and `ahead` more after it) is expected to end, with the
        reserve kept, within the budget."""
        if self.limit_s is None:
            return True
        return self.elapsed_s() + (1 + ahead) * (self.estimate_s() or 0.0) + self.reserve_s <= self.limit_s
