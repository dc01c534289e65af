"""The wall-clock budget's decision, on a clock the test moves by hand."""

import pytest

import sleuth.loop.budget as budget_module
from sleuth.loop.budget import TimeBudget


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: now[0])
    return now


def test_no_budget_always_allows(clock):
    b = TimeBudget(None)
    clock[0] += 1e9
    assert b.allows_next() and b.allows_next(ahead=100)


def test_starts_only_iterations_expected_to_end_within_budget(clock):
    b = TimeBudget(minutes=1.0, reserve_s=10.0)  # 60 s, 10 s kept for the final evaluation
    clock[0] += 20.0
    assert b.allows_next()  # nothing measured yet: 20 + 0 + 10 <= 60
    b.record(12.0)
    clock[0] += 12.0  # elapsed 32: 32 + 12 + 10 = 54 <= 60
    assert b.allows_next()
    assert not b.allows_next(ahead=1)  # 32 + 24 + 10 = 66 > 60
    b.record(20.0)
    clock[0] += 20.0  # elapsed 52: 52 + 20 + 10 = 82 > 60
    assert b.estimate_s() == pytest.approx(20.0)
    assert not b.allows_next()


def test_estimate_errs_long_on_uneven_iterations(clock):
    b = TimeBudget(minutes=1.0, reserve_s=10.0)
    b.record(12.0)
    b.record(20.0)
    clock[0] += 34.0  # the mean (16) would start one more: 34 + 16 + 10 = 60; the longest (20) not
    assert b.estimate_s() == pytest.approx(20.0)
    assert not b.allows_next()
    clock[0] -= 4.0  # elapsed 30: 30 + 20 + 10 = 60
    assert b.allows_next()


def test_estimate_follows_the_last_iterations(clock):
    b = TimeBudget(minutes=10)
    for s in (100.0, 1.0, 3.0, 2.0):
        b.record(s)
    assert b.estimate_s() == pytest.approx(3.0)  # the longest of the last 3 (100 has left the window)


def test_resumed_budget_counts_the_time_already_spent(clock):
    first = TimeBudget(minutes=1.0, reserve_s=5.0)
    first.record(10.0)
    clock[0] += 40.0
    saved = first.state()
    assert saved["elapsed_s"] == pytest.approx(40.0)

    clock[0] += 500.0  # the process was down for a while: downtime does not count
    resumed = TimeBudget(minutes=1.0)
    clock[0] += 3.0  # setup of the resumed process counts
    resumed.restore(saved)
    assert resumed.elapsed_s() == pytest.approx(43.0)
    assert resumed.reserve_s == 5.0 and resumed.estimate_s() == pytest.approx(10.0)
    assert resumed.allows_next()  # 43 + 10 + 5 = 58
    clock[0] += 3.0
    assert not resumed.allows_next()  # 46 + 10 + 5 = 61
    resumed.restore(None)  # a fresh run: nothing restored
    assert resumed.elapsed_s() == pytest.approx(46.0)


def test_process_age_counts_from_the_process_start():
    import subprocess
    import sys

    code = "import time; time.sleep(1.5); from sleuth.loop.budget import process_age_s; print(process_age_s())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               timeout=120).stdout)
    assert 1.5 <= age < 60  # the sleep and the interpreter's start-up, not the machine's uptime


def test_time_spent_before_the_loop_counts_against_the_budget(tiny_model_dir, lowercase_task, tmp_path):
    from io import StringIO

    from sleuth.config import load_config
    from sleuth.loop.train import train
    from test_loop import overrides

    out = StringIO()
    args = [*overrides(tiny_model_dir, lowercase_task, iterations=3), "loop.time_budget_min=1"]
    result = train(load_config(None, args), tmp_path / "run", out=out, elapsed_before_s=61.0)
    assert result.iterations_done == 0
    assert "reached iteration 0 of 3 in 1.0 minutes of the 1-minute budget: no iteration fitted" in out.getvalue()
    assert "raise loop.time_budget_min" in out.getvalue()  # what to change, on the same line
