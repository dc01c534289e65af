"""The wall-clock budget's decision, on a clock the test moves by hand."""

import pytest

import sleuth.budget as budget_module
from sleuth.budget import TimeBudget


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
    clock[0] += 20.0  # elapsed 52, estimate mean(12, 20) = 16
    assert b.estimate_s() == pytest.approx(16.0)
    assert not b.allows_next()


def test_estimate_follows_the_last_iterations(clock):
    b = TimeBudget(minutes=10)
    for s in (100.0, 1.0, 2.0, 3.0):
        b.record(s)
    assert b.estimate_s() == pytest.approx(2.0)  # the window of the last 3


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
