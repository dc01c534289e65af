import math

import pytest

from sleuth.errors import UserError
from sleuth.records import Completion, Group, Problem
from sleuth.train.advantages import ESTIMATORS, compute_advantages


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
