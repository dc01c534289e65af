"""The task registry: names to tasks, user tasks, helpful errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError
from sleuth.system.datafiles import data_path
from sleuth.tasks import registry
from sleuth.tasks.math import MathTask
from sleuth.tasks.registry import TASKS, build_task
from sleuth.tasks.temporal_clue.task import TemporalClueTask

AIME = data_path("aime2024")


def test_builds_registered_tasks(tmp_path: Path) -> None:
    assert isinstance(build_task(TaskConfig(name="temporal_clue")), TemporalClueTask)
    data = tmp_path / "m.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    assert isinstance(build_task(TaskConfig(name="math", train_path=str(data))), MathTask)


def test_every_registered_factory_is_importable() -> None:

    for name in list(TASKS):
        assert callable(TASKS.resolve(name)), name


def test_unknown_name_suggests_nearest() -> None:
    with pytest.raises(ConfigError, match="unknown task 'temporal-clue' \\(did you mean 'temporal_clue'\\?\\)"):
        build_task(TaskConfig(name="temporal-clue"))
    with pytest.raises(ConfigError, match="did you mean 'math'"):
        build_task(TaskConfig(name="maths"))


def test_name_with_colon_is_a_user_task(tmp_path: Path) -> None:
    module = tmp_path / "reg_user_task.py"
    module.write_text(
        "def problems(cfg):\n    return [{'prompt': 'say hi', 'answer': 'hi'}]\n"
        "def verify(answer, text):\n    return float(answer in text)\n"
    )
    task = build_task(TaskConfig(name=f"{module}:problems"))
    p = task.train_problem(0)
    assert task.score(p, "hi there") == 1.0 and task.score(p, "bye") == 0.0


def test_factory_must_return_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.TASKS, "broken", "sleuth.tasks.order:derive_seed")
    with pytest.raises(TypeError, match="not a Task"):
        build_task(TaskConfig(name="broken"))
