"""Held-out diagnostics and per-kind accuracy on real generated puzzles: clues removed, options
moved, question kinds read from prompts, the per-kind table and the paired difference."""

from __future__ import annotations

import pytest

from sleuth.config import load_config
from sleuth.errors import UserError
from sleuth.eval.evaluate import EvalResult, kind_lines, paired_difference
from sleuth.eval.stats import kind_table
from sleuth.records import Completion, Group
from sleuth.tasks.registry import build_task
from sleuth.tasks.temporal_clue.dataset import question_kinds
from sleuth.tasks.temporal_clue.diagnostics import ablate_clues, diagnostic_problems, permute_options


@pytest.fixture(scope="module")
def task():
    return build_task(load_config(None, ["task.temporal_clue.eval_difficulty=elim2", "task.eval_size=12"]).task)


def _prompt(problem) -> str:
    return problem.messages[-1]["content"]


def test_ablating_removes_exactly_the_clue_section(task) -> None:
    for p in task.eval_problems():
        cut = ablate_clues(p)
        before, after = _prompt(p), _prompt(cut)
        assert "- " in before.split("clues are as follows:")[1].split("Please answer")[0]
        assert "clues are as follows" not in after and "\n- " not in after
        assert after.endswith(before[before.index("Please answer"):])
        assert cut.id == p.id and cut.answer == p.answer and cut.metadata == p.metadata


def test_permuting_moves_every_listed_choice_and_keeps_the_answers(task) -> None:
    for p in task.eval_problems():
        moved = permute_options(p, seed=3)
        assert moved.answer == p.answer and moved.id == p.id
        new, old = moved.metadata["choices"], p.metadata["choices"]
        for letter, options in old.items():
            assert sorted(new[letter]) == sorted(options)
            if len(options) > 1:  # a rotation by 1..n-1: every choice changes position
                assert all(a != b for a, b in zip(new[letter], options))
            assert f"(choose from: {', '.join(new[letter])})" in _prompt(moved)
        assert permute_options(p, seed=3) == moved and task.constant_rewards(moved) is not None
        stripped = [line.split(" (choose from")[0] for line in _prompt(moved).splitlines()]
        assert stripped == [line.split(" (choose from")[0] for line in _prompt(p).splitlines()]
    assert diagnostic_problems("ablate_clues", task.eval_problems()[:1])[0] == ablate_clues(task.eval_problems()[0])
    with pytest.raises(UserError, match="unknown diagnostic 'shuffle'"):
        diagnostic_problems("shuffle", [])
    plain = build_task(load_config(None, ["task.temporal_clue.list_choices=false"]).task).eval_problems()[0]
    with pytest.raises(UserError, match="lists no choices"):
        permute_options(plain)


def test_question_kinds_come_from_the_question_lines(task) -> None:
    for p in task.eval_problems():
        kinds = question_kinds(_prompt(p))
        assert list(kinds) == list(p.answer)
        assert kinds["A"] == "who" and kinds["B"] == "weapon" and kinds["C"] == "where"
        assert set(kinds.values()) <= {"who", "weapon", "where", "why", "bonus"}
    difficulty_4 = build_task(load_config(None, ["task.temporal_clue.difficulty=4", "task.eval_size=30"]).task)
    seen = {k for p in difficulty_4.eval_problems() for k in question_kinds(_prompt(p)).values()}
    assert seen == {"who", "weapon", "where", "when", "why", "bonus"}


def _completion(text: str) -> Completion:
    return Completion([0], [0], [0.0], "stop", text)


def test_kind_table_scores_each_kind_over_the_problems_asking_it(task) -> None:
    problems = task.eval_problems()[:4]
    groups = []
    for i, p in enumerate(problems):
        right = "\n".join(f"{q}. {a}" for q, a in p.answer.items())
        # Problem i: one sample all right, one with question A wrong (another listed suspect) when i is odd.
        wrong_who = next(c for c in p.metadata["choices"]["A"] if c != p.answer["A"])
        second = right.replace(f"A. {p.answer['A']}", f"A. {wrong_who}") if i % 2 else right
        groups.append(Group(p, [0], [_completion(right), _completion(second)]))
    table = kind_table(task, groups)
    assert table["who"]["mean"] == pytest.approx(0.75) and table["who"]["problems"] == 4
    assert table["weapon"]["mean"] == 1.0 and table["weapon"]["se"] == 0.0
    chance = sum(1 / len(p.metadata["choices"]["A"]) for p in problems) / 4
    assert table["who"]["chance"] == pytest.approx(chance)
    lines = kind_lines(table, table)
    assert lines[0].split()[:4] == ["question", "kind", "problems", "chance"] and len(lines) == 1 + len(table)
    assert lines[1].split()[:2] == ["who", "4"] and lines[1].count("0.750") == 2


def test_paired_difference_is_per_problem() -> None:
    def result(values: list[float]) -> EvalResult:
        return EvalResult(1, len(values), 0, 0, 0, 0, 0, 0, 0, None, per_problem=values)

    diff, se = paired_difference(result([0.5, 1.0, 0.0]), result([0.0, 1.0, 0.0]))
    # differences -0.5, 0, 0: mean -1/6, sample std sqrt(1/12), standard error sqrt(1/36) = 1/6
    assert diff == pytest.approx(-1 / 6) and se == pytest.approx(1 / 6)
    with pytest.raises(ValueError):
        paired_difference(result([0.5]), result([0.5, 1.0]))


def test_first_choice_share_counts_answers_naming_the_first_listed_choice(task) -> None:
    from sleuth.eval.stats import first_choice_level

    p = task.eval_problems()[0]
    choices = p.metadata["choices"]
    first = "\n".join(f"{q}. {choices[q][0]}" for q in p.answer)
    last = "\n".join(f"{q}. {choices[q][-1]}" for q in p.answer)
    assert task.first_choice_share(p, first) == 1.0 and task.first_choice_share(p, last) == 0.0
    half = first.split("\n")[:2] + last.split("\n")[2:]
    assert task.first_choice_share(p, "\n".join(half)) == pytest.approx(2 / len(p.answer))
    groups = [Group(p, [0], [_completion(first), _completion(last)])]
    assert first_choice_level(task, groups) == pytest.approx(0.5)
