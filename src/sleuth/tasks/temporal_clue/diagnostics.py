"""Held-out diagnostics: the same puzzles changed in one respect, compared per puzzle with the original.

- `ablate_clues`: the clue section removed. A policy that reads the clues must score lower.
- `permute_options`: every question's listed choices rotated by a seeded non-zero offset, so each
  choice moves to another position. A policy that reasons must not move; one that learned an
  answer position must.

Both return a new Problem with the same id, answer and sampling position, so `evaluate` with the
same seed draws the same sampling seeds and the difference can be paired per problem
(`sleuth.eval.evaluate.paired_difference`).
"""

from __future__ import annotations

import random
from dataclasses import replace

from sleuth.errors import UserError
from sleuth.records import Problem
from sleuth.tasks.temporal_clue.dataset import _CHOOSE_FROM, _QUESTION_LINE

CLUES_HEADER = "The available clues are as follows:"
CLUES_END = "Please answer the following question"
DIAGNOSTICS = ("ablate_clues", "permute_options")


def _with_prompt(problem: Problem, prompt: str) -> Problem:
    messages = [*problem.messages[:-1], {**problem.messages[-1], "content": prompt}]
    return replace(problem, messages=messages)  # type: ignore[arg-type]


def ablate_clues(problem: Problem) -> Problem:
    """The problem with its clue section (header and clue lines) removed."""
    prompt = str(problem.messages[-1]["content"])
    start, end = prompt.find(CLUES_HEADER), prompt.find(CLUES_END)
    if start < 0 or end < start:
        raise UserError(f"problem {problem.id} has no clue section ('{CLUES_HEADER}') to remove")
    return _with_prompt(problem, prompt[:start] + prompt[end:])


def permute_options(problem: Problem, seed: int = 0) -> Problem:
    """The problem with each question's listed choices rotated by a seeded offset in 1..n-1 (the
    prompt's `(choose from: ...)` lists and metadata["choices"] alike)."""
    choices: dict[str, list[str]] = problem.metadata.get("choices") or {}
    prompt = str(problem.messages[-1]["content"])
    if _CHOOSE_FROM not in prompt:
        raise UserError(f"problem {problem.id} lists no choices to permute (set task.temporal_clue.list_choices=true)")
    rng = random.Random(f"permute-options:{seed}:{problem.id}")
    moved: dict[str, list[str]] = {}
    for letter, options in choices.items():
        shift = rng.randrange(1, len(options)) if len(options) > 1 else 0
        moved[letter] = options[shift:] + options[:shift]
    lines = []
    for line in prompt.split("\n"):
        m = _QUESTION_LINE.match(line)
        listed = f"{_CHOOSE_FROM}{', '.join(choices.get(m.group(1), []))})" if m else ""
        if m and m.group(1) in moved and line.endswith(listed):
            line = line[: -len(listed)] + f"{_CHOOSE_FROM}{', '.join(moved[m.group(1)])})"
        lines.append(line)
    return replace(_with_prompt(problem, "\n".join(lines)), metadata={**problem.metadata, "choices": moved})


def diagnostic_problems(name: str, problems: list[Problem], seed: int = 0) -> list[Problem]:
    """The held-out problems as diagnostic `name` changes them."""
    if name == "ablate_clues":
        return [ablate_clues(p) for p in problems]
    if name == "permute_options":
        return [permute_options(p, seed) for p in problems]
    raise UserError(f"unknown diagnostic '{name}'; known: {', '.join(DIAGNOSTICS)}")
