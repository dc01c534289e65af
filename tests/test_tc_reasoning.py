"""task.temporal_clue.reasoning: deduce: numbered clues, a deduction before the sheet, only the sheet graded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError
from sleuth.tasks.temporal_clue.dataset import answer_format, parse_choices
from sleuth.tasks.temporal_clue.deduce import solution_text
from sleuth.tasks.temporal_clue.generate import build_puzzle, puzzle_record
from sleuth.tasks.temporal_clue.reasoning import deduce_prompt, number_clues, sheet_part
from sleuth.tasks.temporal_clue.task import TemporalClueTask, train_seed


def test_clues_are_numbered_in_prompt_order_and_the_sheet_is_still_parsed() -> None:
    puzzle = build_puzzle(1, 1)
    prompt = puzzle_record(puzzle, list_choices=True)["prompt"]
    numbered = deduce_prompt(prompt)
    for i, clue in enumerate(puzzle.clues):
        assert f"\n{i + 1}. {clue.text(puzzle.setting)}\n" in numbered
    assert "\n- " not in numbered.partition("The available clues")[2]
    assert "Deductions:" in numbered and "Answers:" in numbered
    assert answer_format(numbered) == answer_format(prompt)
    assert parse_choices(numbered) == parse_choices(prompt)
    assert number_clues(number_clues(prompt)) == number_clues(prompt)  # idempotent


def _task(stop_after_sheet: bool = False, **kw) -> TemporalClueTask:
    return TemporalClueTask(TaskConfig(temporal_clue={"reasoning": "deduce", "stop_after_sheet": stop_after_sheet}, **kw))


def test_the_solver_written_solution_scores_full_marks() -> None:
    task = _task()
    seed = train_seed(0, 0)
    problem = task.train_problem(0)
    puzzle = build_puzzle(seed, 1)
    assert problem.answer == puzzle_record(puzzle)["solution"]
    assert "1. " in problem.messages[-1]["content"]
    assert task.score(problem, solution_text(puzzle)) == 1.0
    assert task.format_score(problem, solution_text(puzzle)) == 1.0
    text = solution_text(puzzle)
    parts = task.answer_parts(problem, text)
    assert parts is not None and all(p.reward == 1.0 for p in parts)
    # spans are positions in the whole completion: the sheet's lines, not the deduction's
    sheet = text.split("Answers:\n")[1].splitlines()
    assert [text[p.start:p.end] for p in parts] == sheet
    assert all(text[p.value_start:p.end].strip() == problem.answer[p.key] for p in parts)


def test_answers_inside_the_deduction_do_not_count() -> None:
    task = _task()
    problem = task.train_problem(0)
    right = "\n".join(f"{q}. {a}" for q, a in problem.answer.items())
    wrong = "\n".join(f"{q}. nobody" for q in problem.answer)
    assert task.score(problem, f"Deductions:\n{right}") == 0.0  # no sheet
    assert task.score(problem, right) == 0.0  # a bare sheet is not the asked format
    assert task.score(problem, f"Deductions:\n{right}\nAnswers:\n{wrong}") == 0.0
    assert task.score(problem, f"Deductions:\n{wrong}\nAnswers:\n{right}") == 1.0
    assert task.score(problem, f"Deductions:\nA: clue 1 => x\n**Answers:**\n{right}") == 1.0
    assert task.answer_key(problem, f"{right}\nAnswers:\n{wrong}") == task.answer_key(problem, f"Answers:\n{wrong}")
    # the direct mode still reads the whole completion
    assert TemporalClueTask(TaskConfig()).score(problem, right) == 1.0


def test_sheet_part_takes_the_last_answers_line() -> None:
    assert sheet_part("Answers:\nA. x\nAnswers:\nA. y") == "\nA. y"
    assert sheet_part("I have no Answers: here") == ""


def test_stop_strings_constant_answers_and_no_guided_pattern() -> None:
    task = _task(stop_after_sheet=True)
    problem = task.train_problem(0)
    last = max(problem.answer)
    assert task.stop_strings(problem) == [f"\n{chr(ord(last) + 1)}."]
    assert task.answer_pattern(problem) is None
    assert TemporalClueTask(TaskConfig()).answer_pattern(problem) is not None
    constant = task.constant_rewards(problem)
    direct = TemporalClueTask(TaskConfig()).constant_rewards(TemporalClueTask(TaskConfig()).train_problem(0))
    assert constant == direct


def test_puzzle_files_get_the_deduce_prompt(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(puzzle_record(build_puzzle(3, 1))) + "\n")
    task = _task(train_path=str(path), eval_path=str(path), eval_size=1)
    prompt = task.eval_problems()[0].messages[-1]["content"]
    assert "\n1. " in prompt.partition("The available clues")[2] and "Answers:" in prompt


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises((ConfigError, ValueError)):
        TaskConfig(temporal_clue={"reasoning": "think"})


def test_a_deduce_run_without_room_is_told_so() -> None:
    from sleuth.config import load_config
    from sleuth.tasks.temporal_clue.reasoning import room_note

    assert room_note(load_config(None, ["task.temporal_clue.reasoning=deduce", "rollout.max_tokens=64"])) is not None
    assert room_note(load_config(None, ["task.temporal_clue.reasoning=deduce", "rollout.max_tokens=512"])) is None
    assert room_note(load_config(None, ["rollout.max_tokens=64"])) is None
    rung = ["task.temporal_clue.reasoning=deduce", "task.temporal_clue.difficulty=elim1"]  # ~130 tokens on the rungs
    assert room_note(load_config(None, [*rung, "rollout.max_tokens=200"])) is None
    assert "~130 tokens" in room_note(load_config(None, [*rung, "rollout.max_tokens=150"]))
    assert "~190 tokens" in room_note(load_config(None, [*rung, "rollout.max_tokens=200", "task.temporal_clue.eval_difficulty=1"]))
