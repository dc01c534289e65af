"""Temporal Clue data files: loading both shapes, choices from prompts, answer sheets."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sleuth.errors import DataError
from sleuth.system.datafiles import data_path
from sleuth.tasks.temporal_clue.dataset import (
    add_choices,
    answer_format,
    answer_sheet,
    load_puzzles,
    parse_choices,
    parse_lists,
)
from sleuth.tasks.temporal_clue.grade import grade

VAL = data_path("temporal_clue_val")


def published() -> list[dict]:
    return load_puzzles(VAL)


def test_published_file_loads() -> None:
    puzzles = published()
    assert len(puzzles) == 64
    assert all(isinstance(p["num_clues"], int) and p["solution"] for p in puzzles)


def test_parse_choices_holds_every_true_answer() -> None:
    for i, puzzle in enumerate(published()):
        choices = parse_choices(puzzle["prompt"])
        assert set(choices) == set(puzzle["solution"]), i
        for letter, answer in puzzle["solution"].items():
            assert answer in choices[letter], (i, letter, answer, choices[letter])
            assert len(choices[letter]) == len(set(choices[letter]))


def test_parse_lists_of_first_published_puzzle() -> None:
    lists = parse_lists(published()[0]["prompt"])
    assert lists["SUSPECT"][:2] == ["Miss Peach", "Monsieur Brunette"] and len(lists["SUSPECT"]) == 10
    assert len(lists["WEAPON"]) == 8 and "Lead Pipe" in lists["WEAPON"]
    assert len(lists["ROOM"]) == 13 and lists["ROOM"][0] == "Studio"  # "01. Studio"
    assert lists["TIME"][0] == "08:00 PM" and len(lists["TIME"]) == 8
    assert len(lists["MOTIVE"]) == 10
    assert answer_format(published()[0]["prompt"])["D"] == "MOTIVE"


def test_motive_counts_are_stripped() -> None:
    prompt = (
        "Each suspect had one of the following possible motives for killing Mr. Boddy:\n\n"
        "• Betrayal (2 suspects)\n• Power (1 suspect)\n\n"
        "Fill out your final answers in the following format:\n\nA. MOTIVE\n"
    )
    assert parse_choices(prompt) == {"A": ["Betrayal", "Power"]}


def test_parse_choices_errors() -> None:
    with pytest.raises(DataError, match="answer-format"):
        parse_choices("no format here")
    with pytest.raises(DataError, match="TIME"):
        parse_choices("Fill out your final answers in the following format:\n\nA. TIME\n")


def test_add_choices_marks_question_lines_only() -> None:
    puzzle = published()[30]
    choices = parse_choices(puzzle["prompt"])
    out = add_choices(puzzle["prompt"], choices)
    assert "A. Who murdered Mr. Boddy? (choose from: Miss Peach, Mrs. White)" in out
    assert "C. Where was Miss Peach? (choose from: Billiard Room, Lounge)" in out
    assert out.count("(choose from:") == len(puzzle["solution"])
    # The answer sheet's placeholders are described, it still parses the same, and adding twice
    # changes nothing.
    sheet = out[out.index("Fill out") :]
    assert "A. <name of the suspect>\nB. <name of the room>\n" in sheet and "SUSPECT" not in sheet
    assert parse_choices(out) == choices
    assert add_choices(out, choices) == out
    # Lines other than the questions and the sheet are unchanged.
    undescribed = out.replace("<name of the suspect>", "SUSPECT").replace("<name of the room>", "ROOM")
    assert undescribed.replace(" (choose from: Miss Peach, Mrs. White)", "").replace(
        " (choose from: Billiard Room, Lounge)", ""
    ) == puzzle["prompt"]


def test_answer_sheet_round_trip() -> None:
    sheet = answer_sheet({"B": "Rope", "A": "Sgt. Gray"})
    assert sheet == "A. Sgt. Gray\nB. Rope"
    assert grade({"B": "Rope", "A": "Sgt. Gray"}, sheet) == 1.0


def test_jsonl_shape_keeps_extra_fields(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"num_clues": 3, "prompt": "P", "solution": {"A": "X"}, "seed": 7, "choices": {"A": ["X", "Y"]}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_puzzles(path) == rows


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"prompt": "P", "solution": {"A": "X"}}, 3]', r"p\.json item 1: expected an object"),
        ('[{"prompt": "P", "solution": {}}]', "item 0: 'solution'"),
        ('[{"prompt": "", "solution": {"A": "X"}}]', "item 0: 'prompt'"),
        ('[{"prompt": "P", "solution": {"A": "X"}, "num_clues": "3"}]', "num_clues"),
        ("[1, 2", "line 1: not valid JSON"),
        ("[]", "holds no puzzles"),
    ],
)
def test_bad_json_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        load_puzzles(path)


def test_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "P", "solution": {"A": "X"}}\n{"prompt": "P"\n')
    with pytest.raises(DataError, match=r"p\.jsonl line 2: not valid JSON"):
        load_puzzles(path)
    path.write_text('{"prompt": "P", "solution": {"A": "X"}}\n{"prompt": "P", "solution": {"A": 1}}\n')
    with pytest.raises(DataError, match="line 2: 'solution'"):
        load_puzzles(path)


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"cannot read puzzle file .*missing\.json"):
        load_puzzles(tmp_path / "missing.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="cannot read puzzle file"):
        load_puzzles(binary)
    with pytest.raises(DataError, match="cannot read"):
        load_puzzles(tmp_path)  # a folder


def test_generated_prompt_choices_match_generator() -> None:
    from sleuth.tasks.temporal_clue.generate import generate_puzzle

    for seed in range(3):
        puzzle = generate_puzzle(seed, 1)
        assert parse_choices(puzzle["prompt"]) == puzzle["choices"]
        listed = generate_puzzle(seed, 1, list_choices=True)  # the same choices, in a shuffled order
        assert {q: sorted(c) for q, c in listed["choices"].items()} == {q: sorted(c) for q, c in puzzle["choices"].items()}
        assert add_choices(puzzle["prompt"], listed["choices"]) == listed["prompt"]


def test_question_kinds_of_the_published_prompts() -> None:
    """Every question of the published set gets a kind, in letter order; the main questions use the
    generator's wording (checked by hand on 2026-12-05: who 63, weapon 46, where 64, when 32, why 50,
    bonus 174 of the 64 puzzles)."""
    from sleuth.tasks.temporal_clue.dataset import question_kinds

    kinds = [question_kinds(p["prompt"]) for p in published()]
    assert all(list(k) == list(p["solution"]) for k, p in zip(kinds, published()))
    counts = Counter(v for k in kinds for v in k.values())
    assert counts["where"] == 64 and counts["when"] == 32 and counts["bonus"] > 100
