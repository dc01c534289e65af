"""The task registry: a task name in the config -> a Task.

Registered tasks are import strings, imported only when chosen, so `sleuth` pays for (and needs
installed) only the task it runs. Each factory is `build(cfg: TaskConfig) -> Task`. A name with
a ":" is a user task, "module:function" (see sleuth.tasks.user).
"""

from __future__ import annotations

import difflib
import importlib

from sleuth.config import TaskConfig
from sleuth.curriculum import parse_schedule
from sleuth.errors import ConfigError
from sleuth.tasks.base import Task

TASKS: dict[str, str] = {
    "temporal_clue": "sleuth.tasks.temporal_clue.task:build",
    "math": "sleuth.tasks.math:build",
    "math_python": "sleuth.tasks.math_python:build",
    "reasoning_gym": "sleuth.tasks.reasoning_gym:build",
}
"""Registered task name -> "module:factory"."""


def task_names() -> list[str]:
    return sorted(TASKS)


def build_task(cfg: TaskConfig, level: int | None = None) -> Task:
    """The Task that cfg.name names, built from the rest of cfg.

    A difficulty curriculum (sleuth.curriculum) builds the task at `level`, by default its first.
    """
    stages = parse_schedule(cfg.difficulty)
    cfg = cfg.model_copy(update={"difficulty": stages[0].level if level is None else level})
    name = cfg.name.strip()
    if ":" in name:
        from sleuth.tasks.user import build

        return build(cfg)
    target = TASKS.get(name)
    if target is None:
        near = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.0)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(
            f"unknown task '{name}'{hint}; registered: {', '.join(task_names())}, or a user task module:function"
        )
    module_name, _, factory_name = target.partition(":")
    module = importlib.import_module(module_name)
    task = getattr(module, factory_name)(cfg)
    if not isinstance(task, Task):
        raise TypeError(f"task factory {target} returned {type(task).__name__}, not a Task")
    return task
