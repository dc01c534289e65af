"""Stop signals: Ctrl-C (SIGINT) and SIGTERM set a flag the loops check between steps; they then
checkpoint and stop. A second signal interrupts at once."""

from __future__ import annotations

import signal
import sys
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Ctrl-C, and what schedulers and `docker stop` send: both checkpoint, then stop."""


class InterruptFlag:
    """SIGINT or SIGTERM sets a flag the loop checks between steps (it then checkpoints and stops);
    a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> InterruptFlag:
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                break
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        name = signal.Signals(signum).name
        self.signum = signum
        print(f"sleuth: {name} received, saving a checkpoint after this step "
              "(send it again to stop at once)", file=sys.stderr)

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
