"""Structured output: completions constrained to a task's answer pattern.

With `rollout.structured_output` every request carries `SamplingParams.regex`, the task's
`answer_pattern(problem)`; the engine masks each token that would leave the pattern and ends the
completion once the pattern is complete (vLLM's structured outputs; TRL ships the same lever as
its guided-decoding regex). A small model then spends its samples on *which* answer to give, not
on learning the answer's format (docs/benchmarks.md, "learning").

The trainer still scores the raw model (engine logprobs are raw, rollout/base.py): the constraint
changes the behaviour distribution only by renormalizing over the allowed tokens, which the group
baseline and the truncated IS weight absorb, as in the published guided-decoding RL recipes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

from sleuth.errors import ConfigError
from sleuth.records import Problem, SamplingParams

if TYPE_CHECKING:
    from sleuth.config import Config
    from sleuth.tasks.base import Task

_SPECIAL = frozenset("\\.^$*+?{}[]|()")
"""Characters with a meaning in the regular expressions engines accept (Python re, xgrammar, Outlines)."""


def regex_literal(text: str) -> str:
    """`text` matched literally. Unlike re.escape, spaces and other plain characters stay as they
    are: xgrammar, vLLM's default structured-output backend, warns on escapes it does not know."""
    return "".join("\\" + ch if ch in _SPECIAL else ch for ch in text)


def one_of(options: Iterable[str]) -> str:
    """A group matching exactly one of `options`, each literally."""
    options = list(options)
    if not options:
        raise ValueError("one_of: no options")
    return "(" + "|".join(regex_literal(o) for o in options) + ")"


def check_structured_output(cfg: Config, task: Task, engine_kind: str) -> None:
    """rollout.structured_output needs a task with an answer pattern and the vLLM engine: a
    one-line error at start-up (and in --dry-run) instead of free text or a failure mid-run."""
    from sleuth.tasks.base import Task

    if not cfg.rollout.structured_output:
        return
    if type(task).answer_pattern is Task.answer_pattern:
        raise ConfigError(f"rollout.structured_output: task {cfg.task.name!r} has no answer pattern "
                          "(Task.answer_pattern); set rollout.structured_output=false")
    if engine_kind != "vllm":
        raise ConfigError("rollout.structured_output needs rollout.engine=vllm (vLLM's structured outputs); "
                          f"the {engine_kind} engine samples free text only")


def constrained(sampling: SamplingParams, task: Task, problem: Problem, enabled: bool) -> SamplingParams:
    """`sampling` with the problem's answer pattern as its regex when structured output is on."""
    if not enabled:
        return sampling
    pattern = task.answer_pattern(problem)
    if not pattern:
        raise ConfigError(f"rollout.structured_output: task {task.name!r} gave no answer pattern for "
                          f"problem {problem.id!r}")
    return replace(sampling, regex=pattern)
