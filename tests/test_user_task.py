"""User tasks: "module:function" problems with a verifier, including the README example."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, DataError
from sleuth.tasks.registry import build_task
from sleuth.tasks.user import UserTask, load_object

REPO = Path(__file__).parents[1]


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root with sys.path restored afterwards (the CLI's situation)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(REPO))])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def test_readme_example_task(in_repo: None) -> None:
    task = build_task(TaskConfig(name="examples.my_task:problems", eval_size=8))
    evals = task.eval_problems()
    assert [p.id for p in evals] == [f"add-{i}" for i in range(8)]
    p = evals[0]
    assert p.messages == [{"role": "user", "content": p.messages[0]["content"]}]
    assert "Reply with the number only." in p.messages[0]["content"]
    assert task.score(p, f"Let me add: {p.answer}") == 1.0
    assert task.score(p, f"{p.answer}, no wait, {p.answer + 1}") == 0.0
    assert task.score(p, "no idea") == 0.0
    train_ids = {task.train_problem(i).id for i in range(180)}
    assert len(train_ids) == 180 and not train_ids & {f"add-{i}" for i in range(20)}


def test_explicit_verifier_and_file_path_modules(tmp_path: Path) -> None:
    tasks = write(tmp_path, "ut_items", "def items(cfg):\n    return [{'messages': [{'role': 'user', 'content': 'q'}], 'answer': 3}]\n")
    checks = write(tmp_path, "ut_checks", "def close_enough(answer, text):\n    return abs(float(text) - answer) < 0.5\n")
    cfg = TaskConfig(name=f"{tasks}:items", verifier=f"{checks}:close_enough", system_prompt="sys")
    task = build_task(cfg)
    p = task.train_problem(0)
    assert p.messages[0] == {"role": "system", "content": "sys"} and p.messages[1]["content"] == "q"
    assert task.score(p, "3.2") == 1.0 and task.score(p, "4") == 0.0
    # Held out: no "eval" split given, so the first train problems.
    assert task.eval_problems() == [p]


def test_pickled_user_task_reloads_its_verifier(tmp_path: Path) -> None:
    mod = write(tmp_path, "ut_pickle", "def p(cfg):\n    return [{'prompt': 'x', 'answer': 'y'}]\ndef verify(a, t):\n    return a == t\n")
    task = build_task(TaskConfig(name=f"{mod}:p"))
    copy = pickle.loads(pickle.dumps(task))
    assert isinstance(copy, UserTask) and copy._verifier is None
    assert copy.score(copy.train_problem(0), "y") == 1.0


def test_function_may_return_a_task(tmp_path: Path) -> None:
    mod = write(
        tmp_path,
        "ut_returns_task",
        "from sleuth.config import TaskConfig\n"
        "from sleuth.tasks.math import MathTask\n"
        "def make(cfg):\n"
        f"    return MathTask(TaskConfig(name='math', train_path={str(tmp_path / 'm.jsonl')!r}))\n",
    )
    (tmp_path / "m.jsonl").write_text('{"problem": "2+2?", "answer": "4"}\n')
    task = build_task(TaskConfig(name=f"{mod}:make"))
    assert task.score(task.train_problem(0), "\\boxed{4}") == 1.0


@pytest.mark.parametrize(
    ("source", "error", "message"),
    [
        ("def p(cfg):\n    return [{'prompt': 'x', 'answer': 1}]\n", ConfigError, "needs a verifier"),
        ("p = 3\n", ConfigError, "is not a function"),
        ("def p(cfg):\n    return 5\ndef verify(a, t):\n    return 1.0\n", ConfigError, "must return a Task or an iterable"),
        ("def p(cfg):\n    return ['x']\ndef verify(a, t):\n    return 1.0\n", DataError, "problem 0: expected a dict"),
        ("def p(cfg):\n    return [{'prompt': 'x'}]\ndef verify(a, t):\n    return 1.0\n", DataError, "has no 'answer'"),
        ("def p(cfg):\n    return [{'answer': 1}]\ndef verify(a, t):\n    return 1.0\n", DataError, "needs a string 'prompt'"),
        ("def p(cfg):\n    return [{'prompt': 'x', 'answer': 1, 'split': 'test'}]\ndef verify(a, t):\n    return 1.0\n", DataError, "'split' must be"),
        ("def p(cfg):\n    return []\ndef verify(a, t):\n    return 1.0\n", DataError, "returned no problems"),
        ("def p(cfg):\n    return [{'prompt': 'x', 'answer': 1}]\nverify = 2\n", ConfigError, "is not a function"),
    ],
)
def test_bad_user_tasks(tmp_path: Path, source: str, error: type[Exception], message: str) -> None:
    mod = write(tmp_path, f"ut_bad_{abs(hash(source))}", source)
    with pytest.raises(error, match=message):
        build_task(TaskConfig(name=f"{mod}:p"))


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot import user task module 'no_such_module_xyz'"):
        load_object("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="has no 'nope'"):
        load_object("sleuth.tasks.order:nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_object(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(ConfigError, match="not of the form module:function"):
        load_object(":f")


def test_readme_code_matches_the_example_module(in_repo: None) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own task", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    problems, verify = load_object("examples.my_task:problems"), load_object("examples.my_task:verify")
    cfg = TaskConfig(name="examples.my_task:problems")
    assert list(namespace["problems"](cfg)) == list(problems(cfg))
    for text in ["5", "120\n121", "none", "-121"]:
        assert namespace["verify"](121, text) == verify(121, text)
    assert "sleuth train task.name=examples.my_task:problems" in section


@pytest.mark.parametrize("source, message", [
    ("def problems(cfg):\n    x = = 1\n", "syntax error at {file}:2"),
    ("import json\nraise RuntimeError('broken at import')\n", "RuntimeError: broken at import (at {file}:2)"),
    ("def problems(cfg):\n    return [1][5]\ndef verify(a, t):\n    return 1\n",
     "raised: IndexError: list index out of range (at {file}:2)"),
    ("def problems(cfg):\n    yield {'prompt': 'p', 'answer': 1}\n    raise ValueError('no more')\n"
     "def verify(a, t):\n    return 1\n",
     "failed while yielding problem 1: ValueError: no more (at {file}:3)"),
])
def test_user_code_errors_name_the_users_file_and_line(tmp_path: Path, source: str, message: str) -> None:
    from sleuth.errors import UserError

    path = write(tmp_path, "broken_task", source)
    with pytest.raises(UserError) as err:
        build_task(TaskConfig(name=f"{path}:problems"))  # the import fails when the config loads
    text = str(err.value)
    assert message.format(file=path) in text and "\n" not in text, text


def test_cli_reports_a_broken_task_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sleuth.cli import main

    path = write(tmp_path, "broken_task", "def problems(cfg):\n    return [\n")
    assert main(["train", "--dry-run", f"task.name={path}:problems"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sleuth: error: cannot import user task file {path}: "
                                                f"syntax error at {path}:2"), err


def test_endless_problems_are_taken_lazily(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    import sleuth.tasks.user as user

    monkeypatch.setattr(user, "LAZY_AFTER", 50)  # the real threshold is 100,000 problems
    path = write(tmp_path, "endless", (
        "import itertools\n"
        "def problems(cfg):\n"
        "    for i in itertools.count():\n"
        "        yield {'id': f'p{i}', 'prompt': str(i), 'answer': i, 'split': 'eval' if i % 10 == 0 else 'train'}\n"
        "def verify(answer, text):\n    return float(text == str(answer))\n"))
    task = build_task(TaskConfig(name=f"{path}:problems", eval_size=3))
    assert task.lazy and "yields more than 50 problems" in capsys.readouterr().err
    assert [p.id for p in task.eval_problems()] == ["p0", "p10", "p20"]
    assert [task.train_problem(i).id for i in (0, 1, 8, 9)] == ["p1", "p2", "p9", "p11"]
    assert task.train_problem(500).id == "p556"  # read on demand, in the order given
