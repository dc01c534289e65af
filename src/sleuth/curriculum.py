"""A difficulty curriculum: `task.difficulty` as a schedule the run moves along as it learns.

    schedule = parse_schedule("1 -> 2 at 0.5 -> 3 at 0.6")   # [Stage(1, None), Stage(2, 0.5), Stage(3, 0.6)]
    curriculum = Curriculum(schedule)
    curriculum.level                  # 1
    curriculum.update(0.55)           # an iteration's mean rollout reward -> True: moved on to level 2

A plain integer is a schedule of one stage. The run starts at the first stage and moves to the next
once one iteration's mean rollout reward reaches that stage's threshold (one stage per iteration at
most, so a lucky batch cannot skip a level). The stage index is checkpointed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sleuth.errors import ConfigError

MIN_LEVEL, MAX_LEVEL = 1, 6
_STAGE = re.compile(r"^\s*(\d+)\s+at\s+(-?[0-9.]+(?:e-?\d+)?)\s*(?:reward)?\s*$")


@dataclass(frozen=True)
class Stage:
    level: int
    threshold: float | None
    """Mean rollout reward that moves the run to this stage (None for the first stage)."""


def _level(text: str, spec: str) -> int:
    try:
        level = int(text)
    except ValueError:
        raise ConfigError(f"task.difficulty '{spec}': '{text}' is not a level (an integer)") from None
    if not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ConfigError(f"task.difficulty '{spec}': level {level} is outside {MIN_LEVEL}..{MAX_LEVEL}")
    return level


def parse_schedule(spec: int | str) -> list[Stage]:
    """`3` or `"1 -> 2 at 0.5 -> 3 at 0.6"` as stages; a ConfigError names what is malformed."""
    if isinstance(spec, bool):
        raise ConfigError(f"task.difficulty must be a level or a schedule, got {spec!r}")
    if isinstance(spec, int):
        return [Stage(_level(str(spec), str(spec)), None)]
    parts = [p.strip() for p in spec.split("->")]
    stages = [Stage(_level(parts[0], spec), None)]
    for part in parts[1:]:
        match = _STAGE.match(part)
        if match is None:
            raise ConfigError(f"task.difficulty '{spec}': stage '{part}' is not of the form "
                              f"'LEVEL at REWARD' (e.g. '1 -> 2 at 0.5')")
        threshold = float(match.group(2))
        stages.append(Stage(_level(match.group(1), spec), threshold))
    return stages


class Curriculum:
    """The current stage of a schedule, moved on by each iteration's mean rollout reward."""

    def __init__(self, stages: list[Stage], index: int = 0) -> None:
        self.stages = stages
        self.index = min(index, len(stages) - 1)

    @property
    def level(self) -> int:
        return self.stages[self.index].level

    def update(self, reward_mean: float) -> bool:
        """Move to the next stage when `reward_mean` reaches its threshold; True when it moved."""
        if self.index + 1 >= len(self.stages):
            return False
        threshold = self.stages[self.index + 1].threshold
        if threshold is not None and reward_mean >= threshold:
            self.index += 1
            return True
        return False
