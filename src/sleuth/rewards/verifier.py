"""Scoring: run a task's verifier on every completion, under a time limit that really holds.

    with VerifierRunner(task, timeout_s=5.0) as runner:
        stats = score_groups(runner, groups)      # fills completion.reward / reward_info

A verifier call that raises (sys.exit included), returns a non-number, a non-finite number or one
outside [-1e6, 1e6], or takes longer than the limit scores 0, is
flagged in `completion.reward_info` ({"verifier_error": 1.0}, plus "verifier_timeout": 1.0 when
it overran) and counted in the returned ScoreStats; the run goes on.

Why a worker process: a pure-Python verifier stuck in a loop cannot be stopped from another
thread, and one stuck in C code (a huge integer power inside sympy, a pathological regex) cannot
even be stopped by a signal. In "process" isolation (the default) verifiers run in spawned worker
processes that receive the task once (pickled) and then one (problem, text) per call; a call that
overruns gets its worker killed and replaced, so the limit holds for any verifier. The worker's
own start-up is not charged to any call. "inline" isolation calls the verifier in this process,
limited by a SIGALRM interval timer when called from the main thread (pure-Python code only, and
not for verifiers that use SIGALRM themselves); elsewhere an overrun is only detected afterwards.
A task that cannot be pickled falls back to inline, with a warning.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import numbers
import pickle
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from sleuth.records import MAX_ABS_REWARD, Group, Problem
from sleuth.tasks.base import Task

Isolation = Literal["process", "inline"]
STARTUP_TIMEOUT_S = 120.0
"""How long a worker may take to start (spawn, imports, unpickling the task)."""


@dataclass
class VerifierOutcome:
    reward: float
    error: bool = False
    """The verifier raised, returned a non-number, overran, or its worker died."""
    timeout: bool = False
    """The verifier overran its time limit (also an error)."""
    message: str = ""


@dataclass
class ScoreStats:
    completions: int = 0
    verifier_errors: int = 0
    """Completions whose verifier failed (raised, bad value, timeout, crash): scored 0."""
    verifier_timeouts: int = 0
    """Of those, the ones that overran the time limit."""
    reward_mean: float = 0.0
    time_s: float = 0.0
    first_error: str = ""
    """The message of the first failed call (what a user needs to see when all of them fail)."""

    def all_failed_warning(self, what: str) -> str | None:
        """A line to show when every verifier call of `what` failed (None otherwise)."""
        if not self.completions or self.verifier_errors < self.completions:
            return None
        return (f"every verifier call of {what} failed ({self.verifier_errors} of {self.completions}); "
                f"the first: {self.first_error}")

    def as_metrics(self) -> dict[str, float]:
        return {
            "reward_mean": self.reward_mean,
            "verifier_errors": float(self.verifier_errors),
            "verifier_timeouts": float(self.verifier_timeouts),
            "time_score_s": self.time_s,
        }


class _VerifierTimeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so a verifier's `except Exception` cannot
    swallow it."""


def _checked(value: Any) -> VerifierOutcome:
    if not isinstance(value, numbers.Real):  # True/False are Reals; "1" and None are not
        return VerifierOutcome(0.0, error=True, message=f"verifier returned {type(value).__name__}, not a number")
    try:
        reward = float(value)
    except (OverflowError, ValueError):  # an int too large for a float
        return VerifierOutcome(0.0, error=True, message="verifier returned a number too large for a float")
    if not math.isfinite(reward) or abs(reward) > MAX_ABS_REWARD:
        return VerifierOutcome(0.0, error=True, message=f"verifier returned {reward:g}, outside "
                                                       f"[-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]")
    return VerifierOutcome(reward)


def _call(task: Task, problem: Problem, text: str) -> VerifierOutcome:
    """Call the verifier and check its value; what it raises, sys.exit included, scores 0."""
    try:
        return _checked(task.score(problem, text))
    except Exception as e:
        return VerifierOutcome(0.0, error=True, message=f"verifier raised {type(e).__name__}: {e}"[:500])
    except SystemExit as e:  # a verifier must not end the run (os._exit cannot be caught: see docs)
        return VerifierOutcome(0.0, error=True, message=f"verifier called sys.exit({e.code!r})")


def _timed_out(timeout_s: float) -> VerifierOutcome:
    return VerifierOutcome(0.0, error=True, timeout=True, message=f"verifier exceeded {timeout_s:g} s")


def call_inline(task: Task, problem: Problem, text: str, timeout_s: float) -> VerifierOutcome:
    """One verifier call in this process (see the module docstring for what limits it)."""
    use_alarm = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous: Any = None

    def on_alarm(signum: int, frame: Any) -> None:
        raise _VerifierTimeout

    start = time.perf_counter()
    try:
        try:
            if use_alarm:
                previous = signal.signal(signal.SIGALRM, on_alarm)
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            outcome = _call(task, problem, text)
        finally:
            if use_alarm:
                # The alarm may fire right here, before it is disarmed: the outer handler
                # catches that too.
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
    except _VerifierTimeout:
        return _timed_out(timeout_s)
    except KeyboardInterrupt:
        # From the verifier's own code, or a Ctrl-C while it ran: either way the user's stop
        # request. Delivered again as SIGINT once the verifier is gone, so `sleuth train` checkpoints
        # and stops (its handler) and other commands stop as on Ctrl-C.
        print("sleuth: KeyboardInterrupt inside the verifier; stopping as for Ctrl-C", file=sys.stderr)
        signal.raise_signal(signal.SIGINT)
        return VerifierOutcome(0.0, error=True, message="verifier raised KeyboardInterrupt")
    if time.perf_counter() - start > timeout_s:
        return _timed_out(timeout_s)
    return outcome


def _worker_main(conn: Connection, task_bytes: bytes) -> None:
    """A verifier worker: receive (problem, text), answer (status, reward, message, seconds)."""
    # Ctrl-C is the parent's business: it stops the run and this process dies with its pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        task = pickle.loads(task_bytes)
    except BaseException as e:
        conn.send(("startup_error", 0.0, f"{type(e).__name__}: {e}", 0.0))
        return
    conn.send(("ready", 0.0, "", 0.0))
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        problem, text = item
        start = time.perf_counter()
        outcome = _call(task, problem, text)
        status = "error" if outcome.error else "ok"
        conn.send((status, outcome.reward, outcome.message, time.perf_counter() - start))


class _Worker:
    def __init__(self, ctx: Any, task_bytes: bytes) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, task_bytes), daemon=True)
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.process.join(timeout=2)
        self.kill()


class VerifierRunner:
    """Runs one task's verifier on many (problem, text) pairs with a per-call time limit."""

    def __init__(
        self, task: Task, timeout_s: float = 5.0, isolation: Isolation = "process", workers: int = 1
    ) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.task = task
        self.timeout_s = timeout_s
        self.isolation: Isolation = isolation
        self.n_workers = max(1, workers)
        self._workers: list[_Worker] = []
        self._task_bytes: bytes | None = None
        if isolation == "process":
            try:
                self._task_bytes = pickle.dumps(task)
            except Exception as e:
                print(
                    f"sleuth: warning: task {getattr(task, 'name', task)!r} cannot be sent to a verifier "
                    f"process ({type(e).__name__}); running its verifier inline",
                    file=sys.stderr,
                )
                self.isolation = "inline"
        self._ctx = mp.get_context("spawn")

    @classmethod
    def from_config(cls, task: Task, cfg: Any) -> VerifierRunner:
        """From a TaskConfig: verifier_timeout_s, verifier_isolation, verifier_workers."""
        return cls(task, cfg.verifier_timeout_s, cfg.verifier_isolation, cfg.verifier_workers)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> VerifierRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def __del__(self) -> None:
        for w in getattr(self, "_workers", []):
            if w.process.is_alive():
                w.process.kill()

    # ------------------------------------------------------------ scoring

    def score(self, items: Sequence[tuple[Problem, str]]) -> list[VerifierOutcome]:
        """One outcome per (problem, completion text), in order."""
        if self.isolation == "inline" or not items:
            return [call_inline(self.task, p, t, self.timeout_s) for p, t in items]
        return self._score_in_workers(items)

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        assert self._task_bytes is not None
        fresh = _Worker(self._ctx, self._task_bytes)
        self._workers[self._workers.index(w)] = fresh
        return fresh

    def _score_in_workers(self, items: Sequence[tuple[Problem, str]]) -> list[VerifierOutcome]:
        assert self._task_bytes is not None
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx, self._task_bytes))
        results: list[VerifierOutcome | None] = [None] * len(items)
        pending = deque(range(len(items)))
        while pending or any(w.item is not None for w in self._workers):
            for w in list(self._workers):
                if w.ready and w.item is None and pending:
                    self._dispatch(w, pending.popleft(), items, results)
            now = time.monotonic()
            deadlines = [
                w.deadline if w.ready else w.started + STARTUP_TIMEOUT_S
                for w in self._workers
                if w.item is not None or not w.ready
            ]
            timeout = max(0.0, min(deadlines) - now) if deadlines else 0.0
            ready_conns = wait([w.conn for w in self._workers], timeout=timeout)
            for w in list(self._workers):
                if self.isolation == "inline":  # gave up on workers: the rest runs inline
                    break
                if w.conn in ready_conns:
                    self._receive(w, results)
            now = time.monotonic()
            for w in list(self._workers):
                if w.ready and w.item is not None and now > w.deadline and not w.conn.poll():
                    results[w.item] = _timed_out(self.timeout_s)
                    self._replace(w)
                elif not w.ready and now > w.started + STARTUP_TIMEOUT_S:
                    self._give_up_on_workers(f"a verifier worker did not start within {STARTUP_TIMEOUT_S:g} s")
                    return self._finish_inline(items, results)
            if self.isolation == "inline":  # a worker could not load the task
                return self._finish_inline(items, results)
        return [r if r is not None else VerifierOutcome(0.0, error=True, message="lost") for r in results]

    def _dispatch(
        self, w: _Worker, i: int, items: Sequence[tuple[Problem, str]], results: list[VerifierOutcome | None]
    ) -> None:
        try:
            payload = pickle.dumps(items[i])
        except Exception:
            # An answer the pipe cannot carry: this one call runs inline instead.
            problem, text = items[i]
            results[i] = call_inline(self.task, problem, text, self.timeout_s)
            return
        try:
            w.conn.send_bytes(payload)
        except OSError:
            results[i] = VerifierOutcome(0.0, error=True, message="verifier process died")
            self._replace(w)
            return
        w.item, w.deadline = i, time.monotonic() + self.timeout_s

    def _receive(self, w: _Worker, results: list[VerifierOutcome | None]) -> None:
        try:
            status, reward, message, seconds = w.conn.recv()
        except (EOFError, OSError):
            # The worker died (crash, out of memory): its call scores 0, a fresh worker continues.
            if not w.ready:  # died while starting: restarting would only loop
                self._give_up_on_workers("a verifier worker died while starting")
                return
            if w.item is not None:
                results[w.item] = VerifierOutcome(0.0, error=True, message="verifier process died")
            self._replace(w)
            return
        if status == "ready":
            w.ready = True
            return
        if status == "startup_error":
            self._give_up_on_workers(f"a verifier worker could not load the task ({message})")
            return
        assert w.item is not None
        if seconds > self.timeout_s:
            results[w.item] = _timed_out(self.timeout_s)
        elif status == "ok":
            results[w.item] = VerifierOutcome(float(reward))
        else:
            results[w.item] = VerifierOutcome(0.0, error=True, message=message)
        w.item = None

    def _give_up_on_workers(self, why: str) -> None:
        print(f"sleuth: warning: {why}; running the verifier inline", file=sys.stderr)
        for w in self._workers:
            w.kill()
        self._workers = []
        self.isolation = "inline"

    def _finish_inline(
        self, items: Sequence[tuple[Problem, str]], results: list[VerifierOutcome | None]
    ) -> list[VerifierOutcome]:
        return [
            r if r is not None else call_inline(self.task, p, t, self.timeout_s)
            for r, (p, t) in zip(results, items)
        ]


def score_groups(
    scorer: VerifierRunner | Task, groups: Sequence[Group], timeout_s: float = 5.0
) -> ScoreStats:
    """Score every completion of every group in place; return the counts and mean reward.

    `scorer` is a VerifierRunner (reused across iterations: its workers stay warm) or a Task, for
    which a process-isolated runner is made for this call only.
    """
    if isinstance(scorer, Task):
        with VerifierRunner(scorer, timeout_s) as runner:
            return score_groups(runner, groups)
    start = time.perf_counter()
    items = [(g.problem, c.text) for g in groups for c in g.completions]
    outcomes = scorer.score(items)
    stats = ScoreStats(completions=len(items))
    completions = [c for g in groups for c in g.completions]
    for completion, outcome in zip(completions, outcomes):
        completion.reward = outcome.reward
        completion.reward_info["verifier_error"] = 1.0 if outcome.error else 0.0
        if outcome.timeout:
            completion.reward_info["verifier_timeout"] = 1.0
        stats.verifier_errors += outcome.error
        if outcome.error and not stats.first_error:
            stats.first_error = outcome.message
        stats.verifier_timeouts += outcome.timeout
    stats.reward_mean = sum(o.reward for o in outcomes) / len(outcomes) if outcomes else 0.0
    stats.time_s = time.perf_counter() - start
    return stats


