"""The episode watchdog: episode code that holds the event loop cannot escape task.episode.timeout_s.

An episode is the user's async code, and its synchronous parts (a `time.sleep`, a CPU-bound loop,
a blocking library call) run on the event loop that also serves the gateway: while they run no
other episode advances and `asyncio.wait_for` cannot fire. A thread watches the loop's heartbeat
(a callback every HEARTBEAT_S); when the loop has been held for STALL_S while an episode that is
past its deadline is the running task, the thread raises `EpisodeOverrun` inside that episode's
code (`PyThreadState_SetAsyncExc`, delivered at its next bytecode: a `while True: pass` stops at
once, a blocking C call such as `time.sleep` when it returns). The episode then scores 0 and is
counted as a timeout, and the run goes on. Code that swallows even that (`except BaseException`
in a loop) is asked again every ESCALATE_S; after MAX_TRIES the process can no longer be run
safely: one line on stderr, then exit 3 (checkpoints already written stay intact; `--resume`
continues from the last one).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

HEARTBEAT_S = 0.05
STALL_S = 0.5
"""How long the loop must have been held before the watchdog acts (never for a normal step)."""
ESCALATE_S = 2.0
MAX_TRIES = 5
EXIT_STUCK = 3


class EpisodeOverrun(BaseException):  # not an Exception: `except Exception` in user code must not swallow it
    """Raised inside an episode's code that held the event loop past its deadline."""


class LoopWatchdog:
    """Watches one event loop while `watching()` runs; episodes register with `episode(deadline)`."""

    def __init__(self) -> None:
        self._deadlines: dict[asyncio.Task, float] = {}
        self._pending: set[asyncio.Task] = set()
        self._lock = threading.Lock()
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id = 0

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[LoopWatchdog]:
        self._loop, self._thread_id = asyncio.get_running_loop(), threading.get_ident()
        self._beat = time.monotonic()
        self._stop.clear()
        handle = self._loop.call_later(HEARTBEAT_S, self._heartbeat)
        thread = threading.Thread(target=self._watch, name="sleuth-episode-watchdog", daemon=True)
        previous_hook = sys.unraisablehook

        def quiet_overrun(unraisable: Any) -> None:
            # Delivered inside a destructor the episode's code triggered (garbage collection), the
            # exception is dropped there; the episode is asked again, so there is nothing to report.
            if not isinstance(unraisable.exc_value, EpisodeOverrun):
                previous_hook(unraisable)

        sys.unraisablehook = quiet_overrun
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            handle.cancel()
            thread.join()
            sys.unraisablehook = previous_hook

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()
        if not self._stop.is_set():
            assert self._loop is not None
            self._loop.call_later(HEARTBEAT_S, self._heartbeat)

    @contextlib.contextmanager
    def episode(self, timeout_s: float) -> Iterator[None]:
        """Register the running task (the one running the episode's code) until the block ends."""
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            self._deadlines[task] = time.monotonic() + timeout_s
        try:
            yield
        finally:
            with self._lock:
                self._deadlines.pop(task, None)
                if task in self._pending:  # asked to stop but ended on its own: take the request back
                    self._pending.discard(task)
                    _set_async_exc(self._thread_id, None)

    def delivered(self) -> None:
        """The running episode caught its EpisodeOverrun."""
        with self._lock:
            self._pending.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _watch(self) -> None:
        tries, last_try = 0, 0.0
        while not self._stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            if now - self._beat < STALL_S:
                tries = 0
                continue
            task = asyncio.current_task(self._loop)
            with self._lock:
                deadline = self._deadlines.get(task) if task is not None else None  # type: ignore[arg-type]
                if deadline is None or now < deadline or now - last_try < (ESCALATE_S if tries else 0):
                    continue
                if tries >= MAX_TRIES:
                    print(f"sleuth: error: episode code has held the event loop for {now - self._beat:.0f} s and "
                          "ignores being stopped (it catches BaseException); exiting. Checkpoints already "
                          "written are intact: continue with sleuth train --resume RUN_DIR", file=sys.stderr,
                          flush=True)
                    os._exit(EXIT_STUCK)
                self._pending.add(task)  # type: ignore[arg-type]
                _set_async_exc(self._thread_id, EpisodeOverrun)
            tries, last_try = tries + 1, now


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)
