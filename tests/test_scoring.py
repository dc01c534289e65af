"""Scoring: verifiers that raise, overrun (sleep, Python loop, C loop) or crash score 0, are
counted, and never stop the run; in worker processes and inline."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import pytest

from sleuth.eval.stats import chance_level, mean_se
from sleuth.records import Completion, Group, Problem
from sleuth.rewards.verifier import ScoreStats, VerifierRunner, call_inline, score_groups
from sleuth.tasks.base import Task

PROBLEM = Problem("p0", [{"role": "user", "content": "q"}], "answer", {})


class BehaviourTask(Task):
    """A verifier whose behaviour the completion text chooses."""

    name = "behaviour"

    def train_problem(self, index: int) -> Problem:
        return PROBLEM

    def eval_problems(self) -> list[Problem]:
        return [PROBLEM]

    def score(self, problem: Problem, completion: str) -> float:
        kind, _, arg = completion.partition(":")
        if kind == "ok":
            return float(arg)
        if kind == "raise":
            raise ValueError("verifier bug")
        if kind == "sleep":
            time.sleep(float(arg))
            return 1.0
        if kind == "loop":
            while True:
                pass
        if kind == "cloop":  # one C call that never checks for signals
            return float(sum(range(10**15)) > 0)
        if kind == "nan":
            return math.nan
        if kind == "str":
            return "1"  # type: ignore[return-value]
        if kind == "exit":
            os._exit(3)
        if kind == "sysexit":
            sys.exit(4)
        if kind == "huge":
            return float(arg)
        if kind == "bigint":
            return 10**400
        if kind == "keyboard":
            raise KeyboardInterrupt
        raise AssertionError(kind)

    def chance_reward(self, problem: Problem) -> float | None:
        return 0.25


class ChildHostileTask(BehaviourTask):
    """Cannot be loaded inside a worker process (as when a module only the parent can import)."""

    def __init__(self) -> None:
        self.state = 1  # pickle calls __setstate__ only for a non-empty state

    def __setstate__(self, state: dict) -> None:
        import multiprocessing

        if multiprocessing.parent_process() is not None:
            raise RuntimeError("not loadable here")
        self.__dict__.update(state)


def groups_of(texts: list[list[str]]) -> list[Group]:
    return [
        Group(PROBLEM, [1], [Completion([1], [2], [0.0], "stop", t) for t in row]) for row in texts
    ]


def test_process_isolation_enforces_every_failure_kind() -> None:
    texts = [["ok:1", "raise", "loop", "ok:0.5"], ["nan", "sleep:30", "ok:0.25", "exit"], ["cloop", "str", "ok:1"]]
    groups = groups_of(texts)
    start = time.monotonic()
    with VerifierRunner(BehaviourTask(), timeout_s=0.5, isolation="process", workers=2) as runner:
        stats = score_groups(runner, groups)
        # The runner keeps working after all that.
        again = score_groups(runner, groups_of([["ok:0.75"]]))
    elapsed = time.monotonic() - start
    rewards = [c.reward for g in groups for c in g.completions]
    assert rewards == [1.0, 0, 0, 0.5, 0, 0, 0.25, 0, 0, 0, 1.0]
    errors = [c.reward_info["verifier_error"] for g in groups for c in g.completions]
    assert errors == [0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0]
    timeouts = [c.reward_info.get("verifier_timeout", 0.0) for g in groups for c in g.completions]
    assert timeouts == [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0]
    assert (stats.completions, stats.verifier_errors, stats.verifier_timeouts) == (11, 7, 3)
    assert stats.reward_mean == pytest.approx(2.75 / 11)
    assert again.reward_mean == 0.75 and again.verifier_errors == 0
    assert elapsed < 60  # the 30 s sleep and the endless loops were cut short
    assert set(stats.as_metrics()) == {"reward_mean", "verifier_errors", "verifier_timeouts", "time_score_s"}


def test_inline_isolation_interrupts_python_loops_and_sleeps() -> None:
    task = BehaviourTask()
    start = time.monotonic()
    outcomes = VerifierRunner(task, timeout_s=0.3, isolation="inline").score(
        [(PROBLEM, t) for t in ["loop", "sleep:30", "raise", "ok:1", "nan", "str"]]
    )
    assert time.monotonic() - start < 10
    assert [(o.reward, o.error, o.timeout) for o in outcomes] == [
        (0.0, True, True), (0.0, True, True), (0.0, True, False), (1.0, False, False),
        (0.0, True, False), (0.0, True, False),
    ]
    assert "ValueError: verifier bug" in outcomes[2].message


def test_inline_off_the_main_thread_detects_overruns_afterwards() -> None:
    result = []
    thread = threading.Thread(target=lambda: result.append(call_inline(BehaviourTask(), PROBLEM, "sleep:0.3", 0.05)))
    thread.start()
    thread.join()
    assert result[0].timeout and result[0].reward == 0.0


def test_unpicklable_task_falls_back_to_inline(capsys: pytest.CaptureFixture[str]) -> None:
    task = BehaviourTask()
    task.hook = lambda: None  # type: ignore[attr-defined]
    runner = VerifierRunner(task, timeout_s=1.0)
    assert runner.isolation == "inline"
    assert "running its verifier inline" in capsys.readouterr().err
    assert runner.score([(PROBLEM, "ok:1")])[0].reward == 1.0


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_that_cannot_load_the_task_falls_back_to_inline(
    capsys: pytest.CaptureFixture[str], workers: int
) -> None:
    with VerifierRunner(ChildHostileTask(), timeout_s=2.0, isolation="process", workers=workers) as runner:
        outcomes = runner.score([(PROBLEM, "ok:1"), (PROBLEM, "raise")])
        assert runner.isolation == "inline"
    assert [(o.reward, o.error) for o in outcomes] == [(1.0, False), (0.0, True)]
    assert "could not load the task (RuntimeError: not loadable here)" in capsys.readouterr().err


def test_score_groups_with_a_task_and_chance_level() -> None:
    groups = groups_of([["ok:1", "raise"]])
    stats = score_groups(BehaviourTask(), groups, timeout_s=5.0)
    assert isinstance(stats, ScoreStats)
    assert [c.reward for c in groups[0].completions] == [1.0, 0.0]
    assert stats.verifier_errors == 1 and stats.verifier_timeouts == 0
    assert chance_level(BehaviourTask(), [PROBLEM, PROBLEM]) == 0.25
    assert chance_level(BehaviourTask(), []) is None


def test_bad_timeout() -> None:
    with pytest.raises(ValueError):
        VerifierRunner(BehaviourTask(), timeout_s=0)


@pytest.mark.parametrize("isolation", ["inline", "process"])
def test_values_that_are_not_rewards_are_errors(isolation: str) -> None:
    """A string, a non-finite or huge number, sys.exit: scored 0 and counted, never an exception."""
    texts = ["str:", "nan:", "huge:1e308", "huge:-1e7", "bigint:", "sysexit:", "ok:1e6", "ok:0.5"]
    with VerifierRunner(BehaviourTask(), timeout_s=5, isolation=isolation) as runner:  # type: ignore[arg-type]
        outcomes = runner.score([(PROBLEM, t) for t in texts])
    assert [o.reward for o in outcomes] == [0.0] * 6 + [1e6, 0.5]
    assert [o.error for o in outcomes] == [True] * 6 + [False, False]
    assert "returned str, not a number" in outcomes[0].message
    assert "outside [-1e+06, 1e+06]" in outcomes[2].message
    assert outcomes[5].message == "verifier called sys.exit(4)"
    groups = groups_of([texts])
    stats = score_groups(BehaviourTask(), groups) if isolation == "process" else None
    if stats is not None:
        assert stats.verifier_errors == 6 and stats.first_error == "verifier returned str, not a number"


def test_all_failed_warning_names_the_first_error() -> None:
    stats = score_groups(VerifierRunner(BehaviourTask(), 5, "inline"), groups_of([["str:", "raise:"]]))
    assert stats.all_failed_warning("iteration 3") == (
        "every verifier call of iteration 3 failed (2 of 2); the first: verifier returned str, not a number")
    ok = score_groups(VerifierRunner(BehaviourTask(), 5, "inline"), groups_of([["str:", "ok:1"]]))
    assert ok.all_failed_warning("iteration 3") is None


def test_inline_keyboard_interrupt_becomes_a_stop_request() -> None:
    """Inline, a verifier's KeyboardInterrupt is scored 0 and delivered again as SIGINT (what makes
    `sleuth train` checkpoint and stop); it does not escape from the scoring call."""
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        outcome = call_inline(BehaviourTask(), PROBLEM, "keyboard:", 5.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcome.error and outcome.message == "verifier raised KeyboardInterrupt"
    assert received == [signal.SIGINT]


@pytest.mark.parametrize("values", [[1e154, -1e154, 3e153], [1e308, -1e308], [1.7e308, 1.7e308, -1.7e308],
                                    [5e-324, 0.0], [1e300] * 5, [-1e200, 1.0, 2.0]])
def test_mean_se_of_huge_finite_values_never_overflows(values):

    mean, se = mean_se(values)
    assert math.isfinite(mean) and math.isfinite(se) and se >= 0
    scale = max(abs(v) for v in values)
    exact_mean = sum(v / scale for v in values) / len(values) * scale
    assert mean == pytest.approx(exact_mean, rel=1e-9, abs=1e-300)


def test_mean_se_unchanged_for_ordinary_rewards():
    assert mean_se([0.0, 1.0, 1.0, 0.0]) == pytest.approx((0.5, (1 / 3) ** 0.5 / 2))
    assert mean_se([]) == (0.0, 0.0) and mean_se([0.0, 0.0]) == (0.0, 0.0) and mean_se([2.5]) == (2.5, 0.0)
