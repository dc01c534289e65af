"""Generated puzzles: unique, irredundant, answerable, well-formed, deterministic."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sleuth.errors import UserError
from sleuth.tasks.temporal_clue.dataset import DESCRIBED, answer_format
from sleuth.tasks.temporal_clue.game import check_rules
from sleuth.tasks.temporal_clue.generate import (
    Puzzle,
    build_puzzle,
    generate_file,
    generate_puzzle,
    puzzle_record,
    puzzle_seed,
    whole_night,
)
from sleuth.tasks.temporal_clue.solver import GameModel

PLACEHOLDERS = {"SUSPECT", "WEAPON", "ROOM", "TIME", "MOTIVE"}


def _fresh_solve(puzzle: Puzzle, clues: list, answers: list) -> tuple[bool, object]:
    """A new model built from scratch: rules + the given clues (as hard constraints) + 'some answer differs'."""
    model = GameModel(puzzle.setting)
    model.require_differs([a.encode(model) for a in answers])
    for clue in clues:
        model.model.add_bool_or([clue.encode(model)])
    feasible, _, night = model.solve([])
    return feasible, night


def check_puzzle(puzzle: Puzzle, resolve_each_clue: bool) -> None:
    s, truth, clues = puzzle.setting, puzzle.night, puzzle.clues
    assert check_rules(s, truth) == []
    assert all(c.holds(s, truth) for c in clues)
    answers = whole_night(s, truth)
    # Unique: no night obeys rules and clues yet differs from the truth anywhere, in particular on
    # any question (so every question is answerable from the clues).
    assert _fresh_solve(puzzle, clues, answers)[0] is False
    assert _fresh_solve(puzzle, clues, [q.atom for q in puzzle.questions])[0] is False
    for q in puzzle.questions:
        assert q.atom.holds(s, truth) and q.answer in q.choices and q.placeholder in PLACEHOLDERS
    # Irredundant: the generator's witness for each clue is checked in plain Python...
    by_clue = dict(zip(puzzle.selection.clues, puzzle.selection.witnesses))
    assert set(by_clue) == set(clues)
    for clue, witness in by_clue.items():
        assert check_rules(s, witness) == []
        assert not clue.holds(s, witness)
        assert all(c.holds(s, witness) for c in clues if c is not clue)
        assert not all(a.holds(s, witness) for a in answers)
    # ...and, independently, a fresh model without the clue finds some other night.
    if resolve_each_clue:
        for clue in clues:
            feasible, night = _fresh_solve(puzzle, [c for c in clues if c is not clue], answers)
            assert feasible and check_rules(s, night) == []  # type: ignore[arg-type]
            assert not clue.holds(s, night)  # type: ignore[arg-type]


@pytest.mark.parametrize(("difficulty", "seeds", "resolve"), [(1, range(150), True), (2, range(60), True),
                                                               (3, range(30), True), (6, range(6), False)])
def test_puzzles_are_unique_irredundant_and_answerable(difficulty: int, seeds: range, resolve: bool) -> None:
    for seed in seeds:
        check_puzzle(build_puzzle(seed, difficulty), resolve_each_clue=resolve)


def _question_lines(prompt: str) -> list[str]:
    return [line for line in prompt.splitlines() if re.match(r"^[A-H]\. .*\?", line)]


@pytest.mark.parametrize("seed", [3, 11, 25])
def test_record_shape_matches_the_published_format(seed: int) -> None:
    record = generate_puzzle(seed, 6)
    assert set(record) == {"num_clues", "prompt", "solution", "seed", "difficulty", "clue_kinds", "choices"}
    prompt = record["prompt"]
    clue_lines = prompt.split("The available clues are as follows:\n\n")[1].split("\n\nPlease answer")[0].splitlines()
    assert len(clue_lines) == record["num_clues"] == sum(record["clue_kinds"].values())
    assert all(line.startswith("- ") for line in clue_lines)
    letters = list(record["solution"])
    assert letters == [chr(ord("A") + i) for i in range(len(letters))] and 4 <= len(letters) <= 8
    assert [line[0] for line in _question_lines(prompt)] == letters
    assert _question_lines(prompt)[0] == "A. Who murdered Mr. Boddy?"
    sheet = prompt.split("Fill out your final answers in the following format:\n\n")[1].split("\n\n")[0]
    assert [line.split(". ")[0] for line in sheet.splitlines()] == letters
    assert {line.split(". ")[1] for line in sheet.splitlines()} <= PLACEHOLDERS
    assert prompt.endswith("Best of luck, detective.")
    for section in ("The rooms are laid out as follows:", "And the following weapons were found on the premises:",
                    "alone in a room with at least one weapon"):
        assert section in prompt
    for letter, answer in record["solution"].items():
        assert answer in record["choices"][letter]
    assert re.search(r"^  N+( N+)*  $", prompt, re.M) and re.search(r"^W [-0-9|]+ E$", prompt, re.M)


def test_times_render_in_published_style_when_asked() -> None:
    record = next(r for seed in range(50) if "D" in (r := generate_puzzle(seed, 4))["solution"]
                  and "When did the murder occur?" in r["prompt"])
    letter = next(line[0] for line in _question_lines(record["prompt"]) if "When did" in line)
    assert re.fullmatch(r"(0[1-9]|1[0-2]):(00|15|30|45) (AM|PM)", record["solution"][letter])


def test_list_choices_appends_the_valid_answers_to_each_question() -> None:
    plain, listed = generate_puzzle(5, 3), generate_puzzle(5, 3, list_choices=True)
    assert plain["solution"] == listed["solution"] and plain["num_clues"] == listed["num_clues"]
    lines = _question_lines(listed["prompt"])
    assert len(lines) == len(listed["solution"])
    for line in lines:
        letter = line[0]
        assert line.endswith(" (choose from: " + ", ".join(listed["choices"][letter]) + ")")
    # The answer sheet says what goes on each line instead of the bare placeholder.
    sheet = listed["prompt"].rpartition("following format:")[2]
    assert "<name of the suspect>" in sheet and "SUSPECT" not in sheet
    undescribed = listed["prompt"]
    for kind, described in DESCRIBED.items():
        undescribed = undescribed.replace(described, kind)
    assert re.sub(r" \(choose from: [^)]*\)", "", undescribed) == plain["prompt"]
    assert answer_format(listed["prompt"]) == answer_format(plain["prompt"])


def test_same_seed_same_record_and_different_seeds_differ() -> None:
    for difficulty in (1, 6):
        assert generate_puzzle(17, difficulty) == generate_puzzle(17, difficulty)
    assert generate_puzzle(17, 2)["prompt"] != generate_puzzle(18, 2)["prompt"]
    assert len({puzzle_seed(0, i) for i in range(1000)}) == 1000
    assert puzzle_seed(1, 0) != puzzle_seed(0, 1)


def test_file_is_identical_whatever_the_worker_count(tmp_path: Path) -> None:
    one = generate_file(5, seed=7, difficulty=2, workers=1, out=tmp_path / "one.jsonl", progress=False)
    two = generate_file(5, seed=7, difficulty=2, workers=2, out=tmp_path / "two.jsonl", progress=False)
    assert one.read_bytes() == two.read_bytes()
    records = [json.loads(line) for line in one.read_text().splitlines()]
    assert [r["seed"] for r in records] == [puzzle_seed(7, i) for i in range(5)]
    assert records[3] == generate_puzzle(puzzle_seed(7, 3), 2)


def test_difficulty_one_puzzles_are_small() -> None:
    for seed in range(40):
        p = build_puzzle(seed, 1)
        assert 2 <= p.setting.num_suspects <= 3 and 2 <= p.setting.num_rooms <= 4 and p.setting.num_times <= 2
        assert 1 <= len(p.clues) <= 12
        assert puzzle_record(p)["difficulty"] == 1


@pytest.mark.parametrize("difficulty", [-3, 7, "lokup", True])
def test_bad_difficulty_is_a_user_error(difficulty: int | str) -> None:
    with pytest.raises(UserError, match="difficulty"):
        generate_puzzle(0, difficulty)


def test_bad_file_arguments_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--n"):
        generate_file(0, 0, 1, 1, tmp_path / "x.jsonl", progress=False)
    with pytest.raises(UserError, match="folder"):
        generate_file(1, 0, 1, 1, tmp_path / "missing" / "x.jsonl", progress=False)
