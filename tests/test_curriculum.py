"""Difficulty schedules: parsing, config validation, and moving on by reward."""

import pytest

from sleuth.config import load_config
from sleuth.curriculum import Curriculum, Stage, parse_schedule
from sleuth.errors import ConfigError
from sleuth.tasks.registry import build_task


def test_parse_schedule():
    assert parse_schedule(3) == [Stage(3, None)]
    assert parse_schedule("1->2 at 0.5 reward") == [Stage(1, None), Stage(2, 0.5)]
    assert parse_schedule(" 1 -> 2 at 0.5 -> 4 at 0.65 ") == [Stage(1, None), Stage(2, 0.5), Stage(4, 0.65)]


@pytest.mark.parametrize(("spec", "fragment"), [
    ("1 -> 2", "'LEVEL at REWARD'"),
    ("1 -> 9 at 0.5", "level 9 is outside 1..6"),
    ("easy -> 2 at 0.5", "'easy' is not a level"),
    ("1 -> 2 at half", "'LEVEL at REWARD'"),
])
def test_bad_schedules_name_the_problem(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_schedule(spec)
    with pytest.raises(ConfigError, match=r"task\.difficulty"):
        load_config(None, [f"task.difficulty={spec}"])


def test_curriculum_moves_one_stage_per_update_at_its_threshold():
    c = Curriculum(parse_schedule("1 -> 2 at 0.5 -> 3 at 0.6"))
    assert c.level == 1
    assert not c.update(0.49) and c.level == 1
    assert c.update(0.9) and c.level == 2  # one stage at a time, even past the next threshold
    assert c.update(0.6) and c.level == 3
    assert not c.update(1.0) and c.level == 3 and c.index == 2
    assert Curriculum(parse_schedule("1 -> 2 at 0.5"), index=1).level == 2  # restored from a checkpoint


def test_tasks_are_built_at_the_schedule_levels():
    cfg = load_config(None, ["task.difficulty=1 -> 3 at 0.5"])
    first, third = build_task(cfg.task), build_task(cfg.task, level=3)
    assert first.train_problem(0).id.startswith("tc-d1-")
    assert third.train_problem(0).id.startswith("tc-d3-")
    assert [p.id for p in first.eval_problems()][:2] == [p.id for p in build_task(cfg.task).eval_problems()][:2]
