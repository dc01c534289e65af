"""The Temporal Clue task adapter: problem streams, held-out sets, scoring, chance level."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace
from pathlib import Path

import pytest

from sleuth.config import TaskConfig
from sleuth.eval.stats import constant_level
from sleuth.system.datafiles import data_path
from sleuth.tasks.temporal_clue.dataset import answer_sheet
from sleuth.tasks.temporal_clue.task import (
    TemporalClueTask,
    eval_seed,
    expected_random_reward,
    train_seed,
)

VAL = data_path("temporal_clue_val")


def val_path() -> str:
    return str(VAL)


def test_file_stream_visits_every_puzzle_each_epoch_in_seeded_order() -> None:
    task = TemporalClueTask(TaskConfig(train_path=val_path(), eval_path=val_path(), eval_size=4, seed=3))
    first = [task.train_problem(i).id for i in range(64)]
    second = [task.train_problem(i).id for i in range(64, 128)]
    assert len(set(first)) == 64 and set(first) == set(second) and first != second
    again = TemporalClueTask(TaskConfig(train_path=val_path(), seed=3))
    assert [again.train_problem(i).id for i in range(64)] == first
    other = TemporalClueTask(TaskConfig(train_path=val_path(), seed=4))
    assert [other.train_problem(i).id for i in range(64)] != first


def test_file_problems_carry_prompt_choices_and_answer() -> None:
    cfg = TaskConfig(train_path=val_path(), eval_path=val_path(), eval_size=5, temporal_clue={"list_choices": True})
    task = TemporalClueTask(cfg)
    evals = task.eval_problems()
    assert [p.id for p in evals] == [f"{val_path()}#{j}" for j in range(5)]
    p = evals[0]
    assert p.messages == [{"role": "user", "content": p.messages[0]["content"]}]
    assert "A. Who murdered Mr. Boddy? (choose from: Miss Peach, Monsieur Brunette" in p.messages[0]["content"]
    assert p.answer["A"] == "Monsieur Brunette" and p.metadata["num_clues"] == 72
    assert all(p.answer[q] in p.metadata["choices"][q] for q in p.answer)
    assert task.score(p, answer_sheet(p.answer)) == 1.0
    assert task.score(p, "A. Monsieur Brunette") == pytest.approx(1 / 8)
    plain = TemporalClueTask(cfg.model_copy(update={"temporal_clue": cfg.temporal_clue.model_copy(update={"list_choices": False}),
                                                  "system_prompt": "Be brief."}))
    q = plain.eval_problems()[0]
    assert "(choose from:" not in q.messages[-1]["content"]
    assert q.messages[0] == {"role": "system", "content": "Be brief."}


def test_generated_stream_is_deterministic_and_disjoint_from_held_out() -> None:
    cfg = TaskConfig(temporal_clue={"difficulty": 1, "list_choices": True}, eval_size=3, seed=0)
    task = TemporalClueTask(cfg)
    a = task.train_problem(5)
    assert TemporalClueTask(cfg).train_problem(5) == a
    assert a.metadata["seed"] == train_seed(0, 5) and a.metadata["seed"] % 2 == 0
    assert "(choose from:" in a.messages[-1]["content"]
    evals = task.eval_problems()
    assert [p.metadata["seed"] for p in evals] == [eval_seed(j) for j in range(3)] == [1, 3, 5]
    # Held-out seeds are odd and training seeds even, whatever the training seed.
    assert all(train_seed(s, i) % 2 == 0 for s in range(3) for i in range(200))
    assert len({train_seed(0, i) for i in range(1000)}) == 1000
    for p in [a, *evals]:
        assert task.score(p, answer_sheet(p.answer)) == 1.0
        assert 0 < task.chance_reward(p) < 1


def test_chance_reward_matches_random_valid_answers() -> None:
    task = TemporalClueTask(TaskConfig(eval_path=val_path(), eval_size=6))
    problems = task.eval_problems()
    rng = random.Random(0)
    trials = 400
    simulated = 0.0
    for p in problems:
        for _ in range(trials):
            guess = {q: rng.choice(p.metadata["choices"][q]) for q in p.answer}
            simulated += task.score(p, answer_sheet(guess))
    simulated /= trials * len(problems)
    exact = expected_random_reward(problems)
    assert exact == pytest.approx(sum(task.chance_reward(p) for p in problems) / len(problems))
    # Standard error of the simulation is below 0.01 here.
    assert simulated == pytest.approx(exact, abs=0.03)
    p = problems[0]
    assert task.chance_reward(p) == pytest.approx(
        sum(1 / len(p.metadata["choices"][q]) for q in p.answer) / len(p.answer)
    )


def test_format_score_counts_listed_choices_right_or_wrong() -> None:
    task = TemporalClueTask(TaskConfig(temporal_clue={"difficulty": 1, "list_choices": True}, eval_size=1))
    p = task.eval_problems()[0]
    choices, letters = p.metadata["choices"], sorted(p.answer)
    wrong = {q: next(c for c in choices[q] if c != p.answer[q]) for q in letters}
    assert task.score(p, answer_sheet(wrong)) == 0.0
    assert task.format_score(p, answer_sheet(wrong)) == 1.0  # every line a listed choice, all wrong
    assert task.format_score(p, answer_sheet(p.answer)) == 1.0
    half = {q: (wrong[q] if i % 2 else "Nobody at all") for i, q in enumerate(letters)}
    assert task.format_score(p, answer_sheet(half)) == pytest.approx(sum(i % 2 for i in range(len(letters))) / len(letters))
    # The same room on every line (the collapse the format reward is for): only room questions count.
    room = choices["C"][0]
    rooms = {q for q in letters if room in choices[q]}
    assert task.format_score(p, answer_sheet({q: room for q in letters})) == pytest.approx(len(rooms) / len(letters))
    # Copying a question's whole list is no answer.
    assert task.format_score(p, answer_sheet({q: ", ".join(choices[q]) for q in letters})) == 0.0
    assert task.format_score(p, "") == 0.0


def test_task_survives_pickling() -> None:
    task = TemporalClueTask(TaskConfig(train_path=val_path(), eval_size=2))
    copy = pickle.loads(pickle.dumps(task))
    assert copy.train_problem(7) == task.train_problem(7)
    p = copy.eval_problems()[0]
    assert copy.score(p, answer_sheet(p.answer)) == 1.0


def test_file_without_answer_format_fails_at_start(tmp_path: Path) -> None:
    from sleuth.errors import DataError

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "Who did it?", "solution": {"A": "Mrs. White"}}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl item 0: puzzle prompt has no answer-format"):
        TemporalClueTask(TaskConfig(train_path=str(path)))
    path.write_text('{"prompt": "Who?", "solution": {"A": "X", "B": "Y"}, "choices": {"A": ["X"]}}\n')
    with pytest.raises(DataError, match="no choices for question"):
        TemporalClueTask(TaskConfig(eval_path=str(path)))


def test_constant_rewards_score_one_listed_position_on_every_line() -> None:
    task = TemporalClueTask(TaskConfig(eval_path=val_path(), eval_size=6))
    problems = task.eval_problems()
    for p in problems:
        choices = p.metadata["choices"]
        rewards = task.constant_rewards(p)
        assert rewards == {
            "first": task.score(p, answer_sheet({q: choices[q][0] for q in p.answer})),
            "second": task.score(p, answer_sheet({q: choices[q][min(1, len(choices[q]) - 1)] for q in p.answer})),
            "last": task.score(p, answer_sheet({q: choices[q][-1] for q in p.answer})),
        }
        # Each constant sheet is right on the lines whose answer sits at that position.
        assert rewards["first"] == pytest.approx(sum(choices[q][0] == p.answer[q] for q in p.answer) / len(p.answer))
    best = max(sum(task.constant_rewards(p)[n] for p in problems) / len(problems) for n in ("first", "second", "last"))
    assert constant_level(task, problems) == pytest.approx(best)
    bare = replace(problems[0], metadata={k: v for k, v in problems[0].metadata.items() if k != "choices"})
    assert task.constant_rewards(bare) is None and constant_level(task, [problems[0], bare]) is None

