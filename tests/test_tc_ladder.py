"""The ladder below difficulty 1: rung puzzles unique, irredundant, solvable by propagation alone at
their rung's depth, short; propagation checked on hand-made cases; listed choices shuffled."""

from __future__ import annotations

from collections import Counter

import pytest

from sleuth.tasks.temporal_clue.clues import At, Clue, Murder, Ref
from sleuth.tasks.temporal_clue.game import Setting, make_layout
from sleuth.tasks.temporal_clue.generate import build_puzzle, generate_puzzle, puzzle_record
from sleuth.tasks.temporal_clue.ladder import RUNG_DEPTH
from sleuth.tasks.temporal_clue.prompt import Question
from sleuth.tasks.temporal_clue.propagate import depths
from test_tc_generate import _fresh_solve, check_rules


@pytest.mark.parametrize("rung", ["lookup", "elim1", "elim2"])
def test_rung_puzzles_are_unique_irredundant_and_solved_by_propagation(rung: str) -> None:
    for seed in range(25):
        puzzle = build_puzzle(seed, rung)
        s, truth, clues, questions = puzzle.setting, puzzle.night, puzzle.clues, puzzle.questions
        answers = [q.atom for q in questions]
        assert check_rules(s, truth) == [] and all(c.holds(s, truth) for c in clues)
        assert s.num_times == 1 and s.num_suspects <= 4 and s.num_rooms <= 4 and len(clues) <= 14
        # Unique: a fresh model with every clue admits no night answering any question differently.
        assert _fresh_solve(puzzle, clues, answers)[0] is False
        # Irredundant: without any one clue, a fresh model finds a rule-abiding night that answers
        # some question differently; the generator's witness says the same in plain Python.
        for clue, witness in zip(puzzle.selection.clues, puzzle.selection.witnesses):
            feasible, night = _fresh_solve(puzzle, [c for c in clues if c is not clue], answers)
            assert feasible and check_rules(s, night) == []  # type: ignore[arg-type]
            assert check_rules(s, witness) == [] and not clue.holds(s, witness)
            assert all(c.holds(s, witness) for c in clues if c is not clue)
        # Propagation alone answers every question, the deepest exactly at the rung's depth.
        found = depths(s, clues, questions)
        assert found is not None and None not in found
        assert max(found) == RUNG_DEPTH[puzzle.difficulty]  # type: ignore[type-var]
        record = puzzle_record(puzzle, list_choices=True)
        assert record["difficulty"] == rung
        assert len(record["prompt"]) < 2400  # a few hundred tokens (difficulty 1: up to ~4000 chars)


def test_lookup_states_every_answer_in_a_clue() -> None:
    for seed in range(10):
        puzzle = build_puzzle(seed, "lookup")
        stated = {c.atoms[0] for c in puzzle.clues if c.form == "fact"}
        for q in puzzle.questions:
            if q.atom.refs() and q.atom.refs()[0].kind == "murderer":  # the murderer's motive, by name
                continue
            assert q.atom in stated


def _setting() -> Setting:
    return Setting(("Miss Scarlet", "Mr. Green"), ("Rope", "Knife"), make_layout(("Hall", "Study", "Lounge")),
                   ("11:00 PM",))


def test_propagation_counts_rounds_of_elimination() -> None:
    s = _setting()
    who = Question("Who murdered Mr. Boddy?", "Mr. Green", "SUSPECT", s.suspects, Murder("murderer", 1))
    where = Question("Where was the murder committed?", "Study", "ROOM", s.layout.rooms, Murder("room", 1))
    weapon = Question("What weapon did the murderer use?", "Knife", "WEAPON", s.weapons, Murder("weapon", 1))
    room_fact = Clue("fact", (Murder("room", 1),))
    scarlet_elsewhere = Clue("fact", (At(Ref("name", 0), 0, 0),))
    rope_not_there = Clue("not", (At(Ref("name", 2), 1, 0),))
    # Looked up (0); Mr. Green is the only suspect who can be in the Study (1); likewise the Knife (1).
    assert depths(s, [room_fact, scarlet_elsewhere, rope_not_there], [where, who, weapon]) == [0, 1, 1]
    # From Mr. Boddy's room: the murder room (1), then the murderer and weapon (2).
    body = Clue("fact", (At(Ref("name", 4), 1, 0),))
    assert depths(s, [body, scarlet_elsewhere, rope_not_there], [where, who, weapon]) == [1, 2, 2]
    # Not enough: who stays open.
    assert depths(s, [room_fact], [who]) == [None]
    # Outside the language: a compound clue, or several times.
    assert depths(s, [Clue("or", (Murder("room", 1), Murder("room", 2)))], [who]) is None
    two_times = Setting(s.suspects, s.weapons, s.layout, ("11:00 PM", "11:30 PM"))
    assert depths(two_times, [room_fact], [who]) is None


def test_listed_choices_are_shuffled_per_question_and_seeded() -> None:
    first_right: Counter[bool] = Counter()
    orders = set()
    for seed in range(40):
        record = generate_puzzle(seed, "elim1", list_choices=True)
        assert record == generate_puzzle(seed, "elim1", list_choices=True)
        plain = generate_puzzle(seed, "elim1")
        assert record["solution"] == plain["solution"]
        for letter, choices in record["choices"].items():
            assert sorted(choices) == sorted(plain["choices"][letter])
            assert f"{letter}. " in record["prompt"] and ", ".join(choices) in record["prompt"]
            orders.add(tuple(choices) == tuple(plain["choices"][letter]))
            first_right[choices[0] == record["solution"][letter]] += 1
    assert orders == {True, False}  # some questions reordered, some not
    # The right answer is listed first about as often as chance says (~1/3 here), not always.
    share = first_right[True] / sum(first_right.values())
    assert 0.2 < share < 0.55


@pytest.mark.parametrize("rung", ["lookup", "elim1", "elim2"])
def test_rung_prompts_are_compact_and_read_like_the_published_form(rung: str) -> None:
    from sleuth.cli.puzzles import puzzle_size
    from sleuth.tasks.temporal_clue.dataset import parse_choices
    from sleuth.tasks.temporal_clue.generate import shuffled_choices
    from sleuth.tasks.temporal_clue.prompt import render_prompt

    for seed in range(1, 21, 2):
        puzzle = build_puzzle(seed, rung)
        questions = shuffled_choices(puzzle)
        compact = puzzle_record(puzzle, list_choices=True)["prompt"]
        full = render_prompt(puzzle.setting, puzzle.clues, questions, list_choices=True)
        assert compact == render_prompt(puzzle.setting, puzzle.clues, questions, list_choices=True, compact=True)
        assert "laid out" not in compact and "Best of luck" not in compact and "Suspects:\n• " in compact
        assert len(compact) < 0.8 * len(full)
        # What the grader, the clue ablation and the deduce form read is the same in both forms.
        assert parse_choices(compact) == parse_choices(full)
        assert {k: sorted(v) for k, v in parse_choices(compact).items()} == {
            chr(ord("A") + i): sorted(q.choices) for i, q in enumerate(questions)}
        s = puzzle.setting
        assert puzzle_size(compact) == puzzle_size(full) == (len(s.suspects), len(s.weapons), s.num_rooms, 1)
        clue_part = compact.split("The available clues are as follows:\n\n")[1].split("\n\nPlease answer")[0]
        assert clue_part.splitlines() == [f"- {c.text(s)}" for c in puzzle.clues]
