"""The Temporal Clue grader: parsing of answer sheets, robustness, the published data."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sleuth.system.datafiles import data_path
from sleuth.tasks.temporal_clue import grade
from sleuth.tasks.temporal_clue.dataset import answer_sheet, load_puzzles, parse_choices
from sleuth.tasks.temporal_clue.grade import answer_key, answer_matches, extract_answers

SOLUTION = {"A": "Mrs. White", "B": "Lead Pipe", "C": "Drawing Room", "D": "11:45 PM", "E": "Sgt. Gray"}
VAL = data_path("temporal_clue_val")


def test_plain_answer_sheet_scores_one() -> None:
    text = "A. Mrs. White\nB. Lead Pipe\nC. Drawing Room\nD. 11:45 PM\nE. Sgt. Gray"
    assert grade(SOLUTION, text) == 1.0


def test_time_answers_score() -> None:
    # The published grader's character class had no digits: times never scored there.
    assert grade({"A": "11:45 PM"}, "A. 11:45 PM") == 1.0
    assert grade({"A": "11:45 PM"}, "A. 11:45pm") == 1.0
    assert grade({"A": "11:45 PM"}, "A. 11:45 P.M.") == 1.0
    assert grade({"A": "08:00 PM"}, "A. 8:00 PM") == 1.0
    assert grade({"A": "11:45 PM"}, "A. 11:45 AM") == 0.0
    assert grade({"A": "12:00 AM"}, "A. 12:00 PM") == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "**A.** Mrs. White\n**B.** Lead Pipe\n**C.** Drawing Room\n**D.** 11:45 PM\n**E.** Sgt. Gray",
        "A) mrs. white\nB) lead pipe\nC) drawing room\nD) 11:45 pm\nE) sgt. gray",
        "A: Mrs. White\nB: Lead Pipe\nC: Drawing Room\nD: 11:45 PM\nE: Sgt. Gray",
        "A. Mrs. White B. Lead Pipe C. Drawing Room D. 11:45 PM E. Sgt. Gray",
        "A. Mrs. White. B. Lead Pipe. C. Drawing Room. D. 11:45 PM. E. Sgt. Gray.",
        "  - **A.** *Mrs. White*\n  - B. `Lead Pipe`\n  - (C) the Drawing Room\n  - D - 11:45PM\n  - E = Sgt. Gray!",
        "A.   Mrs.   White\nB.\tLEAD PIPE\nC. DrawingRoom\nD. 11 : 45 PM\nE. Sgt Gray",
        'A. "Mrs. White"\nB. [Lead Pipe]\nC. SUSPECT: Drawing Room\nD. When did the murder occur? 11:45 PM\nE. Sgt. Gray (Fear)',
        "a. Mrs. White\nb) Lead Pipe\nc: Drawing Room\nd. 11:45 PM\ne. Sgt. Gray",
        "Final answers:\nA. Mrs. White (she had the Lead Pipe)\nB. Lead Pipe\nC. Drawing Room\nD. 11:45 PM\nE. Sgt. Gray",
        "A．Ｍｒｓ． Ｗｈｉｔｅ\nB. Lead Pipe\nC. Drawing Room\nD. 11:45 PM\nE. Sgt. Gray",
    ],
)
def test_formats_all_score_one(text: str) -> None:
    assert grade(SOLUTION, text) == 1.0, extract_answers(text, set(SOLUTION))


def test_periods_inside_names_do_not_split_answers() -> None:
    sol = {"A": "Mrs. White", "B": "Sgt. Gray", "C": "Mr. Green"}
    assert grade(sol, "A. Mrs. White B. Sgt. Gray C. Mr. Green") == 1.0
    # A name with an initial that is not a question letter: Q is no marker here.
    assert extract_answers("A. Mr. John Q. Boddy", {"A", "B"}) == {"A": " Mr. John Q. Boddy"}


def test_last_answer_for_each_letter_counts() -> None:
    text = "A. Miss Peach\nB. Rope\nWait, let me reconsider.\nA. Mrs. White"
    assert grade({"A": "Mrs. White", "B": "Rope"}, text) == 1.0
    text = "A. Mrs. White\nB. Rope\nActually:\nA. Miss Peach"
    assert grade({"A": "Mrs. White", "B": "Rope"}, text) == 0.5


def test_wrong_and_missing_answers() -> None:
    assert grade(SOLUTION, "") == 0.0
    assert grade(SOLUTION, "A. SUSPECT\nB. WEAPON\nC. ROOM\nD. TIME\nE. SUSPECT") == 0.0
    assert grade(SOLUTION, "A. Mrs. White") == pytest.approx(1 / 5)
    assert grade(SOLUTION, "A. Mrs. Whitehall\nB. Lead") == 0.0
    # Two answers joined: only an unambiguous first answer followed by punctuation counts.
    assert grade({"A": "Mrs. White"}, "A. Mrs. White/Miss Peach") == 0.0
    assert grade({"A": "Mrs. White"}, "A. Mrs. White or Miss Peach") == 0.0
    assert grade({"A": "Mrs. White"}, "A. Miss Peach, Mrs. White") == 0.0
    # Copying the list of choices earns nothing, even with the right one first.
    assert grade({"A": "Mrs. White"}, "A. Mrs. White, Miss Peach, Sgt. Gray") == 0.0
    assert grade({"A": "Mrs. White"}, "A. (choose from: Mrs. White, Miss Peach)") == 0.0
    assert grade({"A": "Mrs. White"}, "A. Who murdered Mr. Boddy? (choose from: Mrs. White, Miss Peach)") == 0.0
    assert grade({}, "A. Mrs. White") == 0.0


def test_lowercase_markers_only_at_line_start() -> None:
    # "a:" inside prose must not override the real answer.
    text = "A. Mrs. White\nThe killer had a: Rope in hand"
    assert grade({"A": "Mrs. White"}, text) == 1.0


def test_am_pm_spelled_out_is_not_a_marker() -> None:
    assert grade({"A": "01:00 AM", "M": "Rope"}, "A. 1:00 A.M.\nM. Rope") == 1.0


def test_answer_key_and_matching() -> None:
    assert answer_key(" Drawing  Room ") == "drawingroom"
    assert answer_key("08:00 PM") == answer_key("8:00pm")
    assert answer_matches(" the Library.", "Library")
    assert not answer_matches(" Library Annex", "Library")
    assert not answer_matches("", "Library")


def test_k_wrong_of_n_scores_fraction() -> None:
    rng = random.Random(0)
    letters = "ABCDEFGH"
    for n in range(1, 9):
        sol = {letters[i]: f"Room {chr(65 + i)}{i}" for i in range(n)}
        for k in range(n + 1):
            wrong = set(rng.sample(list(sol), k))
            sheet = answer_sheet({q: ("Nowhere" if q in wrong else a) for q, a in sol.items()})
            assert grade(sol, sheet) == pytest.approx((n - k) / n)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.dictionaries(st.sampled_from("ABCDEFGH"), st.text(max_size=20), max_size=8))
def test_never_raises_and_stays_in_range(text: str, solution: dict[str, str]) -> None:
    score = grade(solution, text)
    assert 0.0 <= score <= 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["A", "B", ".", ")", ":", " ", "\n", "*", "Mrs", "Sgt.", "(", "-", "é", "11:45", "PM", "A.M."]), max_size=200))
def test_never_raises_on_marker_soup(parts: list[str]) -> None:
    assert 0.0 <= grade(SOLUTION, "".join(parts)) <= 1.0


def test_non_text_completion_scores_zero() -> None:
    assert grade(SOLUTION, None) == 0.0  # type: ignore[arg-type]
    # Odd solutions do not raise either: keys are letters as text, answers compared as text.
    assert grade({1: "x", "B": 5}, "B. 5") == 0.5  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "unit",
    ["A. ", "xB. b. ", "A", "(A)", "\n", " ", "A.M. ", "**", "A. Mrs. White B. ", "{{{{", "é" * 3, "A" * 7 + ". "],
)
def test_100kb_adversarial_input_completes(unit: str) -> None:
    text = (unit * (100_000 // len(unit) + 1))[:100_000] + "\nA. Mrs. White"
    start = time.perf_counter()
    assert grade(SOLUTION, text) == pytest.approx(1 / 5)
    # Not a timing assert (see bench/grade.py): only a guard against super-linear blow-ups.
    assert time.perf_counter() - start < 30


def test_published_puzzles_score_one_against_their_own_answer_sheet() -> None:
    puzzles = load_puzzles(VAL)
    assert len(puzzles) == 64
    rng = random.Random(1)
    for i, puzzle in enumerate(puzzles):
        solution = puzzle["solution"]
        assert grade(solution, answer_sheet(solution)) == 1.0, i
        # k wrong answers (another valid choice) out of n score (n - k) / n.
        choices = parse_choices(puzzle["prompt"])
        n = len(solution)
        k = rng.randint(1, n)
        wrong = set(rng.sample(sorted(solution), k))
        sheet = {
            q: next(c for c in choices[q] if c != a) if q in wrong and len(choices[q]) > 1 else a
            for q, a in solution.items()
        }
        k_effective = sum(sheet[q] != solution[q] for q in solution)
        assert grade(solution, answer_sheet(sheet)) == pytest.approx((n - k_effective) / n), i


def test_block_scan_equals_a_single_full_scan() -> None:
    # extract_answers reads blocks from the end; a marker at any block edge must be read the same
    # as by one scan over the whole text.
    from sleuth.tasks.temporal_clue.grade import _answer_at, _markers

    pieces = ["A. ", "B) ", "c: ", "\n", "\n- d. ", " ", "Mrs. White", "xA.", "**E.** ", "12:00 A.M.", "Lounge", "y" * 50]
    rng = random.Random(7)
    letters = "ABCDE"
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(100, 3000)))
        spans = _markers(text, letters, 0, len(text))
        expected: dict[str, str] = {}
        for start, answer_start in spans:
            expected[text[start].upper()] = _answer_at(text, answer_start, letters)
        assert extract_answers(text, set(letters)) == expected


def test_answer_sheet_key_votes_on_answers_not_formatting() -> None:
    from sleuth.tasks.temporal_clue.grade import answer_sheet_key

    letters = ["A", "B"]
    one = answer_sheet_key(letters, "A. Mrs. White\nB. Rope")
    assert one == (("A", "mrswhite"), ("B", "rope"))
    assert answer_sheet_key(letters, "Thinking...\n**A.** mrs white\nB: the Rope") == one
    assert answer_sheet_key(letters, "A. Mrs. White\nB. Knife") != one
    assert answer_sheet_key(letters, "no answers here") is None
    assert answer_sheet_key(letters, None) is None  # type: ignore[arg-type]


def test_temporal_clue_majority_vote_uses_the_answer_sheet() -> None:
    from sleuth.config import TaskConfig
    from sleuth.eval.evaluate import answer_key_fn
    from sleuth.eval.stats import majority_reward
    from sleuth.tasks.temporal_clue.task import TemporalClueTask

    task = TemporalClueTask(TaskConfig(temporal_clue={"difficulty": 1}, eval_size=1))
    problem = task.eval_problems()[0]
    right = "\n".join(f"{k}. {v}" for k, v in sorted(problem.answer.items()))
    texts = [right, "Here goes:\n" + right.lower(), "A. nobody"]
    key = answer_key_fn(task)
    keys = [key(problem, t) for t in texts]
    assert keys[0] == keys[1] != keys[2]
    rewards = [task.score(problem, t) for t in texts]
    assert majority_reward(rewards, keys) == 1.0


def test_answer_parts_are_the_answers_the_grader_reads():
    from sleuth.tasks.temporal_clue.grade import answer_parts

    solution = {"A": "Mrs. White", "B": "Knife", "C": "Library"}
    sheet = "Notes first.\nA. Miss Scarlet\nA) mrs white\r\nB. Rope\nC. Library"
    parts = answer_parts(solution, sheet)
    assert [(p.key, sheet[p.start:p.end], p.reward) for p in parts] == [
        ("A", "A) mrs white", 1.0), ("B", "B. Rope", 0.0), ("C", "C. Library", 1.0)]
    # With every answer on a line of its own, the parts' rewards average to the grade.
    assert sum(p.reward for p in parts) / len(solution) == grade(solution, sheet)
    # Several answers on one line: no part for them (their tokens keep the completion's advantage).
    inline = "A. Mrs. White B. Knife\nC. Ballroom"
    assert [(p.key, p.reward) for p in answer_parts(solution, inline)] == [("C", 0.0)]
    assert answer_parts(solution, "") == [] and answer_parts({}, "A. x") == []
