"""The solver-written deductions: every cited clue set forces its answer (re-checked on a fresh
model), every stated fact is true and forced, lines cite clues by their prompt number, and the text
is the same for the same seed."""

from __future__ import annotations

import re

import pytest

from sleuth.tasks.temporal_clue.deduce import ANSWERS_HEADER, DEDUCTIONS_HEADER, deduce, solution_text
from sleuth.tasks.temporal_clue.generate import build_puzzle
from sleuth.tasks.temporal_clue.solver import GameModel

_CITED = re.compile(r"\bclues? ([\d, ]+)")


def _forces(puzzle, clue_numbers: list[int], atom) -> bool:
    """A fresh model: do these clues (1-based) and the rules alone force `atom`?"""
    model = GameModel(puzzle.setting)
    lits = [puzzle.clues[n - 1].encode(model) for n in clue_numbers]
    feasible, _, _ = model.solve([*lits, ~atom.encode(model)])
    return not feasible


@pytest.mark.parametrize(("seed", "difficulty"), [(0, 1), (1, 1), (2, 1), (5, 1), (3, 2), (1, 3), (2, 6)])
def test_cited_clues_force_each_answer_and_every_stated_fact(seed: int, difficulty: int) -> None:
    puzzle = build_puzzle(seed, difficulty)
    deductions = deduce(puzzle)
    assert [d.question for d in deductions] == puzzle.questions
    cited_so_far: list[int] = []
    for d in deductions:
        line = d.text(puzzle.setting)
        assert line.startswith(f"{d.letter}: ") and line.endswith(f" => {d.question.answer}")
        numbers = [int(n) for group in _CITED.findall(line) for n in group.replace(",", " ").split()]
        assert numbers == [i + 1 for i in d.cited]  # the text cites exactly the steps' clues
        for step in d.steps:
            cited_so_far += [i + 1 for i in step.clues]
            for fact in step.facts:
                assert fact.holds(puzzle.setting, puzzle.night)
                assert _forces(puzzle, cited_so_far, fact), (line, fact)
        assert _forces(puzzle, sorted(set(cited_so_far)), d.question.atom), line
        if all(not step.facts for step in d.steps):  # a short line: its own clues suffice
            assert _forces(puzzle, numbers, d.question.atom), line
            # and none of them can be left out
            for n in numbers:
                assert not _forces(puzzle, [m for m in numbers if m != n], d.question.atom), line


def test_no_clue_no_deduction() -> None:
    """Without the cited clues the answer is not forced: the check above can fail."""
    puzzle = build_puzzle(0, 1)
    first = deduce(puzzle)[0]
    assert not _forces(puzzle, [], first.question.atom)
    assert not _forces(puzzle, [first.cited[0] + 1], first.question.atom) or len(first.cited) == 1


def test_solution_text_is_deterministic_and_ends_with_the_sheet() -> None:
    text = solution_text(build_puzzle(4, 1))
    assert text == solution_text(build_puzzle(4, 1))
    lines = text.splitlines()
    assert lines[0] == DEDUCTIONS_HEADER
    puzzle = build_puzzle(4, 1)
    sheet = lines[lines.index(ANSWERS_HEADER) + 1:]
    assert sheet == [f"{chr(ord('A') + i)}. {q.answer}" for i, q in enumerate(puzzle.questions)]
    # a few short lines: one per question, well under the prompt's length
    assert len(lines) == 2 + 2 * len(puzzle.questions)
