"""Group-relative advantages: a registry of estimators over one group's rewards.

    groups, metrics = compute_advantages(groups, "grpo", drop_zero=True)

Each estimator maps the rewards of one group (n completions of one prompt) to one advantage per
completion: `fn(rewards: Sequence[float]) -> list[float]`. Add one with `@register_advantage("name")`
in code that imports sleuth, or name it in the config as "module:function" / "path/file.py:function"
(checked when the config loads: importable, callable, one positional argument). Groups whose advantages are all zero (every completion scored the same) carry no
policy gradient; with drop_zero they are removed before packing and counted in the metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from sleuth.plugins import Registry
from sleuth.records import Group

STD_EPS = 1e-6
"""Added to the group's standard deviation so a near-constant group does not blow up."""

ZERO_TOL = 1e-12
"""Advantages smaller than this in magnitude count as zero when deciding to drop a group."""

Estimator = Callable[[Sequence[float]], list[float]]

SIGNATURE = "fn(rewards: Sequence[float]) -> list[float]"
"""The documented signature of an advantage estimator (built-in, registered or user)."""

ESTIMATORS = Registry("advantage", 1, SIGNATURE)
"""Registered estimator name -> function (the built-ins below, plus @register_advantage ones)."""

register_advantage = ESTIMATORS.register
"""Decorator: @register_advantage("name") makes a function the estimator algorithm.advantage=name."""

get_advantage = ESTIMATORS.resolve
"""The estimator a config names: a registered name or a user "module:function"."""


@register_advantage("grpo")
def grpo(rewards: Sequence[float]) -> list[float]:
    """(r - mean) / (std + eps), with the population std of the group (GRPO). Computed on rewards
    scaled by the largest magnitude (the ratio is the same), so finite rewards never overflow."""
    n = len(rewards)
    scale = max(abs(r) for r in rewards)
    if scale == 0:
        return [0.0] * n
    scaled = [r / scale for r in rewards]
    mean = math.fsum(scaled) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in scaled) / n)
    return [(r - mean) / (std + STD_EPS / scale) for r in scaled]


@register_advantage("dr_grpo")
def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """r - mean: Dr.GRPO drops the std division, which over-weights easy and hard groups."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


@register_advantage("rloo")
def rloo(rewards: Sequence[float]) -> list[float]:
    """Leave-one-out baseline: r_i - mean of the other n-1 rewards (zero for a group of one)."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def compute_advantages(
    groups: list[Group], estimator: str, drop_zero: bool = True
) -> tuple[list[Group], dict[str, float]]:
    """Groups with `advantages` filled (new Group objects; the inputs are not modified).

    Metrics: groups (in), groups_dropped (all-zero advantages, removed when drop_zero),
    advantage_abs_mean over the kept completions.
    """
    fn = get_advantage(estimator)
    out: list[Group] = []
    dropped = 0
    abs_sum = 0.0
    count = 0
    for i, group in enumerate(groups):
        if not group.completions:
            raise ValueError(f"group {i} ({group.problem.id}) has no completions")
        # Episode tasks: one reward per episode; each sequence takes its episode's advantage.
        rewards = group.rewards if group.episode_rewards is None else group.episode_rewards
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"group {i} ({group.problem.id}) has a non-finite reward: {rewards}")
        advantages = [float(a) for a in fn(rewards)]
        if not all(math.isfinite(a) for a in advantages):
            raise ValueError(f"advantage '{estimator}' gave a non-finite advantage for group {i} "
                             f"({group.problem.id}), rewards {rewards}")
        if len(advantages) != len(rewards):
            raise ValueError(f"advantage '{estimator}' returned {len(advantages)} values for a group of "
                             f"{len(rewards)} (it must return one per completion)")
        if group.episode_index is not None:
            advantages = [advantages[e] for e in group.episode_index]
        if drop_zero and all(abs(a) < ZERO_TOL for a in advantages):
            dropped += 1
            continue
        out.append(replace(group, advantages=advantages))
        abs_sum += sum(abs(a) for a in advantages)
        count += len(advantages)
    metrics = {
        "groups": float(len(groups)),
        "groups_dropped": float(dropped),
        "advantage_abs_mean": abs_sum / count if count else 0.0,
    }
    return out, metrics
