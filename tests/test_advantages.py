import math

import pytest

from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.rewards.advantages import ESTIMATORS, compute_advantages


def group(rewards: list[float], name: str = "p") -> Group:
    comps = [Completion([1], [2], [-1.0], "stop", "", reward=r) for r in rewards]
    return Group(Problem(name, [], None), [1], comps)


def test_grpo_normalises_by_group_std() -> None:
    (g,), metrics = compute_advantages([group([1.0, 0.0, 0.0, 1.0])], "grpo")
    assert g.advantages == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert metrics["groups_dropped"] == 0.0
    (g,), _ = compute_advantages([group([3.0, 1.0])], "grpo")
    assert g.advantages == pytest.approx([1.0, -1.0], abs=1e-5)


def test_dr_grpo_only_centres() -> None:
    (g,), _ = compute_advantages([group([3.0, 1.0, 2.0])], "dr_grpo")
    assert g.advantages == pytest.approx([1.0, -1.0, 0.0])


def test_rloo_leave_one_out() -> None:
    (g,), _ = compute_advantages([group([1.0, 0.0, 0.0])], "rloo")
    assert g.advantages == pytest.approx([1.0, -0.5, -0.5])
    # RLOO advantages are the centred rewards scaled by n / (n - 1).
    (g,), _ = compute_advantages([group([4.0, 1.0, 1.0, 2.0])], "rloo")
    assert g.advantages == pytest.approx([(r - 2.0) * 4 / 3 for r in [4.0, 1.0, 1.0, 2.0]])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_constant_groups_are_dropped_and_counted(name: str) -> None:
    groups = [group([1.0, 1.0], "a"), group([0.0, 1.0], "b"), group([0.0, 0.0], "c")]
    kept, metrics = compute_advantages(groups, name, drop_zero=True)
    assert [g.problem.id for g in kept] == ["b"]
    assert metrics["groups_dropped"] == 2.0 and metrics["groups"] == 3.0
    kept, metrics = compute_advantages(groups, name, drop_zero=False)
    assert len(kept) == 3 and metrics["groups_dropped"] == 0.0
    assert kept[0].advantages == [0.0, 0.0]
    assert groups[1].advantages is None  # inputs are not modified


def test_bad_input() -> None:
    with pytest.raises(UserError, match="unknown advantage 'ppo'"):
        compute_advantages([group([1.0])], "ppo")
    with pytest.raises(ValueError, match="has no completions"):
        compute_advantages([group([])], "grpo")
    with pytest.raises(ValueError, match="non-finite reward"):
        compute_advantages([group([1.0, math.nan])], "grpo")
    assert compute_advantages([], "grpo") == ([], {"groups": 0.0, "groups_dropped": 0.0,
                                                   "advantage_abs_mean": 0.0})


@pytest.mark.parametrize("rewards", [[1e154, -1e154, 0.0], [1.7e308, -1.7e308], [1e300, 1e300, 1e299], [0.0, 5e-324]])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_huge_finite_rewards_give_finite_advantages_or_one_clear_error(name, rewards):


    group = Group(Problem("p", [], None), [1], [Completion([1], [2], [-0.1], "stop", "x", reward=r) for r in rewards])
    try:
        (out,), _ = compute_advantages([group], name, drop_zero=False)
    except ValueError as e:  # r - mean itself past the largest float (dr_grpo, rloo): named, never inf
        assert name != "grpo" and "non-finite advantage" in str(e)
        return
    assert all(math.isfinite(a) for a in out.advantages)
    if name == "grpo":  # scale-free: the same advantages as for the rewards scaled down
        scale = max(abs(r) for r in rewards)
        small = [r / scale for r in rewards]
        mean = sum(small) / len(small)
        std = (sum((r - mean) ** 2 for r in small) / len(small)) ** 0.5
        assert out.advantages == pytest.approx([(r - mean) / (std + 1e-6 / scale) for r in small], rel=1e-6)
