"""The math task: answer extraction, integer and symbolic comparison, data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, DataError
from sleuth.system.datafiles import data_path
from sleuth.tasks.math import INSTRUCTION, MathTask, answers_equal, extract_answer, load_math_problems

AIME = data_path("aime2024")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{25}.", "25"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{x^{2} + {y}}", "x^{2} + {y}"),
        ("\\boxed{24} wait, no.\nAnswer: 25", "25"),
        ("Answer: \\boxed{7}", "7"),
        ("**Final Answer:** $204$.", "204"),
        ("The answer is: 12", "12"),
        ("\\boxed{3} and an unclosed \\boxed{4", "3"),
        ("\\fbox{9}", "9"),
        ("no final answer here", None),
        ("", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_extraction_of_huge_unbalanced_input_is_bounded() -> None:
    assert extract_answer("\\boxed{" * 20_000) is None
    assert extract_answer("{" * 100_000 + "\\boxed{5}") == "5"


@pytest.mark.parametrize(
    ("gold", "given", "equal"),
    [
        ("025", "25", True),
        ("25", "025", True),
        ("1000", "1,000", True),
        ("0", "-0", True),
        ("204", "204.0", True),
        ("25", "\\frac{50}{2}", True),
        ("25", "26", False),
        ("-3", "3", False),
        ("\\frac{1}{2}", "0.5", True),
        ("\\sqrt{2}", "2^{1/2}", True),
        ("x^2+1", "1+x^2", True),
        ("x^2+1", "x^2-1", False),
        ("25", "twenty five", False),
    ],
)
def test_answers_equal(gold: str, given: str, equal: bool) -> None:
    assert answers_equal(gold, given) is equal


def test_huge_integer_answers_compare_without_int_conversion() -> None:
    assert answers_equal("7", "0" * 10_000 + "7")
    assert not answers_equal("7", "9" * 10_000)


def test_task_on_aime_file() -> None:
    task = MathTask(TaskConfig(name="math", train_path=str(AIME), eval_size=30, seed=1))
    evals = task.eval_problems()
    assert len(evals) == 30 and len({p.id for p in evals}) == 30
    p = evals[0]
    assert p.messages[-1]["content"].endswith(INSTRUCTION)
    assert task.score(p, f"... so \\boxed{{{int(p.answer)}}}") == 1.0
    assert task.score(p, f"Answer: {int(p.answer) + 1}") == 0.0
    assert task.score(p, "I don't know") == 0.0
    assert task.chance_reward(p) is None
    epoch = [task.train_problem(i).id for i in range(30)]
    assert sorted(epoch) == sorted(q.id for q in evals)
    leading_zero = [q for q in evals if q.answer.startswith("0")]
    for q in leading_zero:  # "025" equals 25
        assert task.score(q, f"\\boxed{{{int(q.answer)}}}") == 1.0


def test_eval_path_and_system_prompt(tmp_path: Path) -> None:
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(json.dumps({"problem": "1+1?", "answer": 2}) + "\n")
    held.write_text("".join(json.dumps({"id": f"e{i}", "problem": f"{i}+0?", "answer": str(i)}) + "\n" for i in range(5)))
    task = MathTask(TaskConfig(name="math", train_path=str(train), eval_path=str(held), eval_size=3, system_prompt="S"))
    assert [p.id for p in task.eval_problems()] == ["e0", "e1", "e2"]
    p = task.train_problem(3)
    assert p.answer == "2" and p.messages[0] == {"role": "system", "content": "S"}
    assert task.score(p, "\\boxed{2}") == 1.0


def test_bad_data_and_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs task\.train_path"):
        MathTask(TaskConfig(name="math"))
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "x", "answer": "1"}\n{"problem": "y"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: needs an 'answer'"):
        load_math_problems(path)
    path.write_text('{"problem": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        load_math_problems(path)
    path.write_text('{"question": "x", "answer": "1"}\n')
    with pytest.raises(DataError, match="line 1: needs a string 'problem'"):
        load_math_problems(path)
    with pytest.raises(DataError, match="cannot read math problem file"):
        load_math_problems(tmp_path / "missing.jsonl")


def test_symbolic_answers_through_a_verifier_worker(tmp_path: Path) -> None:
    # math-verify times itself with SIGALRM: this checks it works inside the worker process.
    from sleuth.records import Completion, Group
    from sleuth.rewards.verifier import VerifierRunner, score_groups

    data = tmp_path / "m.jsonl"
    data.write_text(json.dumps({"problem": "Half?", "answer": "\\frac{1}{2}"}) + "\n")
    task = MathTask(TaskConfig(name="math", train_path=str(data)))
    p = task.train_problem(0)
    texts = ["\\boxed{0.5}", "\\boxed{\\dfrac{2}{4}}", "\\boxed{1/3}", "nothing"]
    group = Group(p, [1], [Completion([1], [2], [0.0], "stop", t) for t in texts])
    with VerifierRunner(task, timeout_s=20, isolation="process") as runner:
        stats = score_groups(runner, [group])
    assert group.rewards == [1.0, 1.0, 0.0, 0.0] and stats.verifier_errors == 0
