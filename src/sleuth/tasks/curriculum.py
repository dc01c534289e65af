"""A difficulty curriculum: `task.temporal_clue.difficulty` as a schedule the run moves along as it learns.

    schedule = parse_schedule("1 -> 2 at 0.5 -> 3 at 0.6")   # [Stage(1, None), Stage(2, 0.5), Stage(3, 0.6)]
    curriculum = Curriculum(schedule)
    curriculum.level                  # 1
    curriculum.update(0.55)           # an iteration's mean rollout reward -> True: moved on to level 2

A plain level is a schedule of one stage. The run starts at the first stage and moves to the next
once one iteration's mean rollout reward reaches that stage's threshold (one stage per iteration at
most, so a lucky batch cannot skip a level). The stage index is checkpointed.

Levels: the integers 1..6 (Temporal Clue's difficulties) and, below them, the ladder's named rungs
`lookup` (each answer stated by one clue), `elim1` (one step of elimination) and `elim2` (two),
which are levels -2, -1 and 0 wherever a number is needed (`rollout/difficulty`). A schedule may
mix them: "lookup -> elim1 at 0.8 -> elim2 at 0.8 -> 1 at 0.6".

Fading (task.temporal_clue.curriculum_fade = N): after each climb, the previous stage's level keeps a share of
the iterations that falls linearly from 1/2 to 0 over N iterations (an iteration on the old level
is chosen by a seeded draw), so the easy rungs fade out instead of vanishing; only iterations at
the current level count towards the next threshold.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from sleuth.errors import ConfigError
from sleuth.plugins import did_you_mean

MIN_LEVEL, MAX_LEVEL = 1, 6
RUNGS = {"lookup": -2, "elim1": -1, "elim2": 0}
"""The ladder's rungs below level 1, by name -> the level number they stand for."""
LOWEST_LEVEL = min(RUNGS.values())
_STAGE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s+at\s+(-?[0-9.]+(?:e-?\d+)?)\s*(?:reward)?\s*$")


@dataclass(frozen=True)
class Stage:
    level: int
    threshold: float | None
    """Mean rollout reward that moves the run to this stage (None for the first stage)."""


def level_name(level: int) -> str:
    """How a level is written: a rung's name below 1 ("lookup"), else the integer ("3")."""
    return next((name for name, value in RUNGS.items() if value == level), str(level))


def parse_level(text: str | int, what: str = "difficulty") -> int:
    """A level from its name or number ("lookup", "elim2", "3", -1); ConfigError naming `what` otherwise."""
    names = f"{', '.join(RUNGS)} or {MIN_LEVEL}..{MAX_LEVEL}"
    if isinstance(text, bool):
        raise ConfigError(f"{what} must be a level ({names}), got {text!r}")
    if isinstance(text, str) and text.strip() in RUNGS:
        return RUNGS[text.strip()]
    try:
        level = int(text)
    except ValueError:
        hint = did_you_mean(str(text).strip(), RUNGS, n=1, cutoff=0.6)
        raise ConfigError(f"{what} '{text}' is not a level{hint}: use {names}") from None
    if not LOWEST_LEVEL <= level <= MAX_LEVEL:
        raise ConfigError(f"{what} {level} is outside {LOWEST_LEVEL}..{MAX_LEVEL} (rungs {names})")
    return level


def _level(text: str, spec: str) -> int:
    return parse_level(text, f"task.temporal_clue.difficulty '{spec}': level")


def parse_schedule(spec: int | str) -> list[Stage]:
    """`3` or `"1 -> 2 at 0.5 -> 3 at 0.6"` as stages; a ConfigError names what is malformed."""
    if isinstance(spec, bool):
        raise ConfigError(f"task.temporal_clue.difficulty must be a level or a schedule, got {spec!r}")
    if isinstance(spec, int):
        return [Stage(_level(str(spec), str(spec)), None)]
    if not isinstance(spec, str):
        raise ConfigError(f"task.temporal_clue.difficulty must be a level or a schedule, got {spec!r}")
    parts = [p.strip() for p in spec.split("->")]
    stages = [Stage(_level(parts[0], spec), None)]
    for part in parts[1:]:
        match = _STAGE.match(part)
        if match is None:
            raise ConfigError(f"task.temporal_clue.difficulty '{spec}': stage '{part}' is not of the form "
                              f"'LEVEL at REWARD' (e.g. '1 -> 2 at 0.5')")
        threshold = float(match.group(2))
        stages.append(Stage(_level(match.group(1), spec), threshold))
    return stages


class Curriculum:
    """The current stage of a schedule, moved on by each iteration's mean rollout reward.

    `fade` (task.temporal_clue.curriculum_fade): iterations over which the previous stage's level fades out after
    a climb; `since` is the iteration of the last climb (checkpointed with the index)."""

    def __init__(self, stages: list[Stage], index: int = 0, fade: int = 0, since: int = 0) -> None:
        self.stages = stages
        self.index = min(index, len(stages) - 1)
        self.fade, self.since = fade, since

    @property
    def level(self) -> int:
        return self.stages[self.index].level

    def fade_share(self, iteration: int) -> float:
        """The previous stage's share of iteration `iteration`: 1/2 right after a climb, then
        falling linearly to 0 over `fade` iterations (0 without a climb or without fading)."""
        if self.index == 0 or self.fade <= 0:
            return 0.0
        age = iteration - self.since - 1
        return max(0.0, 0.5 * (1 - age / self.fade)) if age >= 0 else 0.0

    def level_for(self, iteration: int, seed: int = 0) -> int:
        """The level iteration `iteration` trains on: the current one, or while fading the previous
        one with probability `fade_share` (a draw seeded by seed and iteration)."""
        share = self.fade_share(iteration)
        if share and random.Random(f"curriculum:{seed}:{iteration}").random() < share:
            return self.stages[self.index - 1].level
        return self.level

    def update(self, reward_mean: float, iteration: int = 0, level: int | None = None) -> bool:
        """Move to the next stage when `reward_mean` (of a batch at `level`, by default the current
        one) reaches its threshold; True when it moved. A batch of an older, fading level never counts."""
        if self.index + 1 >= len(self.stages) or (level is not None and level != self.level):
            return False
        threshold = self.stages[self.index + 1].threshold
        if threshold is not None and reward_mean >= threshold:
            self.index += 1
            self.since = iteration
            return True
        return False
