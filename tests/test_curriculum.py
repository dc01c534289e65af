"""Difficulty schedules: parsing, config validation, and moving on by reward."""

import pytest

from sleuth.config import load_config
from sleuth.errors import ConfigError
from sleuth.loop.checks import check_names
from sleuth.tasks.curriculum import Curriculum, Stage, level_name, parse_level, parse_schedule
from sleuth.tasks.registry import build_task


def test_parse_schedule():
    assert parse_schedule(3) == [Stage(3, None)]
    assert parse_schedule("lookup") == [Stage(-2, None)] and parse_schedule(0) == [Stage(0, None)]
    assert parse_schedule("lookup -> elim1 at 0.8 -> elim2 at 0.8 -> 1 at 0.6") == [
        Stage(-2, None), Stage(-1, 0.8), Stage(0, 0.8), Stage(1, 0.6)]
    assert parse_schedule("1->2 at 0.5 reward") == [Stage(1, None), Stage(2, 0.5)]
    assert parse_schedule(" 1 -> 2 at 0.5 -> 4 at 0.65 ") == [Stage(1, None), Stage(2, 0.5), Stage(4, 0.65)]


@pytest.mark.parametrize(("spec", "fragment"), [
    ("1 -> 2", "'LEVEL at REWARD'"),
    ("1 -> 9 at 0.5", "level 9 is outside -2..6"),
    ("easy -> 2 at 0.5", "'easy' is not a level"),
    ("lokup -> 1 at 0.5", "did you mean 'lookup'"),
    ("-3", "outside -2..6"),
    ("1 -> 2 at half", "'LEVEL at REWARD'"),
])
def test_bad_schedules_name_the_problem(spec, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_schedule(spec)
    with pytest.raises(ConfigError, match=r"task\.temporal_clue\.difficulty"):
        check_names(load_config(None, [f"task.temporal_clue.difficulty={spec}"]))


def test_curriculum_moves_one_stage_per_update_at_its_threshold():
    c = Curriculum(parse_schedule("1 -> 2 at 0.5 -> 3 at 0.6"))
    assert c.level == 1
    assert not c.update(0.49) and c.level == 1
    assert c.update(0.9) and c.level == 2  # one stage at a time, even past the next threshold
    assert c.update(0.6) and c.level == 3
    assert not c.update(1.0) and c.level == 3 and c.index == 2
    assert Curriculum(parse_schedule("1 -> 2 at 0.5"), index=1).level == 2  # restored from a checkpoint


def test_tasks_are_built_at_the_schedule_levels():
    cfg = load_config(None, ["task.temporal_clue.difficulty=1 -> 3 at 0.5"])
    first, third = build_task(cfg.task), build_task(cfg.task, level=3)
    assert first.train_problem(0).id.startswith("tc-d1-")
    assert third.train_problem(0).id.startswith("tc-d3-")
    assert [p.id for p in first.eval_problems()][:2] == [p.id for p in build_task(cfg.task).eval_problems()][:2]


def test_level_names_round_trip():
    assert [level_name(parse_level(n)) for n in ("lookup", "elim1", "elim2", "1", 6)] == [
        "lookup", "elim1", "elim2", "1", "6"]
    for bad, fragment in ((True, "must be a level"), ("x", "not a level"), (7, "outside")):
        with pytest.raises(ConfigError, match=fragment):
            parse_level(bad)
    with pytest.raises(ConfigError, match=r"task\.temporal_clue\.eval_difficulty"):
        check_names(load_config(None, ["task.temporal_clue.eval_difficulty=elim9"]))
    cfg = load_config(None, ["task.temporal_clue.difficulty=lookup -> 1 at 0.5", "task.temporal_clue.eval_difficulty=elim2"])
    task = build_task(cfg.task)
    assert task.train_problem(0).id.startswith("tc-dlookup-")
    assert task.eval_problems()[0].id.startswith("tc-delim2-")


def test_fading_keeps_a_falling_share_of_the_previous_level():
    c = Curriculum(parse_schedule("lookup -> elim1 at 0.5"), fade=4)
    assert c.fade_share(1) == 0 and c.level_for(1) == -2
    assert not c.update(0.9, iteration=3, level=-1)  # a batch of another level never counts
    assert c.update(0.9, iteration=3, level=-2) and c.level == -1 and c.since == 3
    assert [c.fade_share(it) for it in range(3, 9)] == [0.0, 0.5, 0.375, 0.25, 0.125, 0.0]
    levels = [c.level_for(it, seed=s) for s in range(200) for it in (4, 8)]
    old_at_4 = sum(lv == -2 for lv in levels[0::2]) / 200
    assert 0.35 < old_at_4 < 0.65 and set(levels[1::2]) == {-1}
    assert [c.level_for(4, seed=7)] * 2 == [c.level_for(4, seed=7), c.level_for(4, seed=7)]
    restored = Curriculum(parse_schedule("lookup -> elim1 at 0.5"), index=1, fade=4, since=3)
    assert [restored.level_for(it, seed=1) for it in range(4, 9)] == [c.level_for(it, seed=1) for it in range(4, 9)]
