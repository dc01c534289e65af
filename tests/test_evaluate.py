import itertools
import math
import random

import pytest

from sleuth.eval.evaluate import summarize
from sleuth.eval.stats import majority_reward, mean_se, pass_at_k


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(1 for s in subsets if any(samples[i] for i in s)) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200, 1, 200) == 1.0
    assert 0 < pass_at_k(1000, 1, 10) < 1
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_majority_reward():
    assert majority_reward([1.0, 0.0, 0.0], ["a", "b", "b"]) == 0.0
    assert majority_reward([1.0, 0.0, 1.0], ["a", "b", "a"]) == 1.0
    # tie: the key seen first wins
    assert majority_reward([0.5, 1.0], ["x", "y"]) == 0.5
    # no extractable answers score 0; None never wins a vote
    assert majority_reward([1.0, 1.0], [None, None]) == 0.0
    assert majority_reward([0.0, 0.0, 1.0], [None, None, "z"]) == 1.0


def test_mean_se():
    assert mean_se([]) == (0.0, 0.0)
    assert mean_se([0.7]) == (0.7, 0.0)
    values = [0.0, 1.0, 1.0, 0.0]
    mean, se = mean_se(values)
    assert mean == 0.5
    assert se == pytest.approx(math.sqrt((4 * 0.25 / 3) / 4))


def test_summarize_hand_computed():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.25, 1.0], [0.0, 0.0, 0.0, 0.0]]
    keys = [["a", "b", "b", "c"], ["p", "p", "q", "r"], [None, "x", "y", "x"]]
    tokens = [[10, 20, 30, 40], [5, 5, 5, 5], [1, 1, 1, 1]]
    res = summarize(rewards, keys, k=4, completion_tokens=tokens, chance=0.1)
    avgs = [0.25, 0.5625, 0.0]
    assert res.avg == pytest.approx(sum(avgs) / 3)
    assert res.avg_se == pytest.approx(mean_se(avgs)[1])
    assert res.pass_k == pytest.approx(2 / 3)  # problems 0 and 1 have a reward-1 sample
    assert res.maj == pytest.approx((0.0 + 0.5 + 0.0) / 3)
    assert res.mean_completion_tokens == pytest.approx(sum(map(sum, tokens)) / 12)
    assert res.chance == 0.1
    assert res.problems == 3
    assert res.line() == f"avg@4={res.avg:.4f} pass@4={res.pass_k:.4f} maj@4={res.maj:.4f}"
    assert "records" not in res.summary()


def test_summarize_pass_at_k_with_more_samples_than_k():
    rng = random.Random(0)
    rewards = [[float(rng.random() < 0.3) for _ in range(8)] for _ in range(20)]
    keys = [[str(r) for r in row] for row in rewards]
    res = summarize(rewards, keys, k=2)
    expected = sum(pass_at_k(8, int(sum(r)), 2) for r in rewards) / 20
    assert res.pass_k == pytest.approx(expected)
    with pytest.raises(ValueError, match="fewer than k"):
        summarize([[1.0]], [["a"]], k=2)
