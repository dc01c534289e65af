"""The statistics of an evaluation: mean and standard error, pass@k and maj@k, the chance level and
the best constant answer's level, accuracy per question kind, the first-listed-choice share."""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

from sleuth.records import Problem
from sleuth.tasks.base import Task


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n)); the error is 0 for fewer than 2 values.
    Computed on values scaled by the largest magnitude, so finite values never overflow (the
    error saturates at the largest float)."""
    n = len(values)
    if n == 0:
        return 0.0, 0.0
    scale = max(abs(v) for v in values)
    if scale == 0 or not math.isfinite(scale):
        return (math.fsum(values) / n if scale else 0.0), (0.0 if scale == 0 else math.nan)
    scaled = [v / scale for v in values]
    mean = math.fsum(scaled) / n
    if n < 2:
        return mean * scale, 0.0
    var = math.fsum((v - mean) ** 2 for v in scaled) / (n - 1)
    return mean * scale, min(math.sqrt(var / n) * scale, sys.float_info.max)

def constant_level(task: Task, problems: Sequence[Problem]) -> float | None:
    """The best mean reward over problems of one fixed answer that ignores them (Task.constant_rewards:
    the same strategy on every problem), when the task has one for every problem (None otherwise)."""
    per_problem = [r for r in (task.constant_rewards(p) for p in problems) if r]
    if not per_problem or len(per_problem) < len(problems):
        return None
    names = set.intersection(*(set(r) for r in per_problem))
    return max((sum(r[n] for r in per_problem) / len(per_problem) for n in names), default=None)

def chance_level(task: Task, problems: Sequence[Problem]) -> float | None:
    """Mean expected reward of uniformly random valid answers over problems, when the task knows
    it for every problem (None otherwise)."""
    values = [task.chance_reward(p) for p in problems]
    if not values or any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None) / len(values)

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # The product form avoids huge binomials: C(n-c,k)/C(n,k) = prod_{i=n-c+1}^{n} (1 - k/i).
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))

def majority_reward(rewards: Sequence[float], keys: Sequence[Hashable | None]) -> float:
    """Reward of the most common answer key; ties go to the key seen first; no answer scores 0."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == top)
    return rewards[list(keys).index(winner)]

def kind_table(task: Task, groups: Sequence[Any]) -> dict[str, dict[str, float]]:
    """EvalResult.per_kind from scored groups: each problem's accuracy on a kind is the mean over
    its samples; mean and standard error are over the problems that ask that kind."""
    per_problem: dict[str, list[float]] = {}
    chance: dict[str, list[float]] = {}
    for g in groups:
        scores = [task.kind_scores(g.problem, c.text) for c in g.completions]
        if not scores or any(x is None for x in scores):
            return {}
        for kind, (_, level) in scores[0].items():  # type: ignore[union-attr]
            per_problem.setdefault(kind, []).append(sum(x[kind][0] for x in scores) / len(scores))  # type: ignore[index]
            chance.setdefault(kind, []).append(level)
    out = {}
    for kind, values in per_problem.items():
        mean, se = mean_se(values)
        out[kind] = {"mean": mean, "se": se, "chance": sum(chance[kind]) / len(chance[kind]),
                     "problems": float(len(values))}
    return out

def first_choice_level(task: Task, groups: Sequence[Any]) -> float | None:
    """EvalResult.first_choice from scored groups (None when some problem lists no choices)."""
    per_problem = []
    for g in groups:
        shares = [task.first_choice_share(g.problem, c.text) for c in g.completions]
        if not shares or any(x is None for x in shares):
            return None
        per_problem.append(sum(x for x in shares if x is not None) / len(shares))
    return sum(per_problem) / len(per_problem) if per_problem else None


def constant_margin(task: Task, problems: Sequence[Problem], per_problem: Sequence[float]) -> tuple[str, float, float] | None:
    """Per-problem rewards against the best constant answer on the same problems, paired: (the
    constant's name, mean difference, its standard error); None without constants for every problem."""
    per = [task.constant_rewards(p) for p in problems]
    if not per or len(per) != len(per_problem) or any(not r for r in per):
        return None
    names = set.intersection(*(set(r) for r in per if r))
    if not names:
        return None
    best = max(sorted(names), key=lambda n: sum(r[n] for r in per if r))
    diff, se = mean_se([v - r[best] for v, r in zip(per_problem, per, strict=True) if r])
    return best, diff, se
