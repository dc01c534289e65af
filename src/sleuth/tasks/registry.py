"""The task registry: a task name in the config -> a Task.

Registered tasks are import strings, imported only when chosen, so `sleuth` pays for (and needs
installed) only the task it runs. Each factory is `build(cfg: TaskConfig) -> Task`. A name that
starts with an environment prefix ("verifiers:ENV_ID", "openenv:URL_OR_MODULE") is an environment
from that library (ENVIRONMENTS); any other name with a ":" is a user task, "module:function"
(see sleuth.tasks.user).
"""

from __future__ import annotations

from sleuth.config import TaskConfig
from sleuth.plugins import Registry
from sleuth.tasks.base import Task
from sleuth.tasks.curriculum import parse_level, parse_schedule
from sleuth.tasks.environments import ENVIRONMENTS, environment_prefix

TASKS = Registry("task", 1, "build(cfg: TaskConfig) -> Task", user_specs=False)
"""Registered task name -> its factory (registered lazily, by import string). A name with a ":" is a
user task instead (sleuth.tasks.user)."""
TASKS.lazy("temporal_clue", "sleuth.tasks.temporal_clue.task:build")
TASKS.lazy("math", "sleuth.tasks.math:build")
TASKS.lazy("math_python", "sleuth.tasks.math_python:build")
TASKS.lazy("reasoning_gym", "sleuth.tasks.reasoning_gym:build")
register_task = TASKS.register
"""`@register_task("name")` on a `build(cfg) -> Task` adds a task name."""

def task_names() -> list[str]:
    return sorted(TASKS)


def build_task(cfg: TaskConfig, level: int | None = None) -> Task:
    """The Task that cfg.name names, built from the rest of cfg.

    A difficulty curriculum (sleuth.tasks.curriculum) builds the task at `level`, by default its first;
    the task sees both levels as integers (cfg.temporal_clue.difficulty, and .eval_difficulty for its
    held-out set). Which task.<kind> sections the task may be given is checked by sleuth.loop.checks.
    """
    tc = cfg.temporal_clue
    stages = parse_schedule(tc.difficulty)
    held_out = stages[0].level if tc.eval_difficulty is None else parse_level(tc.eval_difficulty)
    cfg = cfg.model_copy(update={"temporal_clue": tc.model_copy(update={
        "difficulty": stages[0].level if level is None else level, "eval_difficulty": held_out})})
    name = cfg.name.strip()
    prefix = environment_prefix(name)
    if prefix is not None:
        task = ENVIRONMENTS.resolve(prefix)(cfg)
    elif ":" in name:
        from sleuth.tasks.user import build

        return build(cfg)
    else:
        task = TASKS.resolve(name)(cfg)
    if not isinstance(task, Task):
        raise TypeError(f"task factory for {name!r} returned {type(task).__name__}, not a Task")
    return task
