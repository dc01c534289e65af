"""sleuth.loop.checks: each task kind's config section is refused on a task that does not read it."""

import pytest

from sleuth.config import dump_config, load_config
from sleuth.errors import ConfigError
from sleuth.loop.checks import check_run

MATH = ["task.name=math", "task.train_path=aime2024", "rollout.engine=hf"]
TC = ["rollout.engine=hf"]

USER_TASK = '''
def problems(cfg):
    return [{"prompt": "Say 4.", "answer": 4, "split": "eval"}, {"prompt": "Say 5.", "answer": 5}]

def verify(answer, text):
    return float(str(answer) in text)
'''
EPISODE = '''
async def rollout(client, problem):
    return 1.0
'''


@pytest.mark.parametrize(("overrides", "message"), [
    ([*MATH, "task.temporal_clue.difficulty=3"], "task.temporal_clue.difficulty is a temporal_clue setting; task.name is math"),
    ([*MATH, "task.temporal_clue.reasoning=deduce"], "task.temporal_clue.reasoning is a temporal_clue setting"),
    ([*TC, "task.reasoning_gym.dataset=knights_knaves"], "task.reasoning_gym.dataset is a reasoning_gym setting; "
                                                         "task.name is temporal_clue"),
    ([*TC, "task.episode.max_turns=3"], "task.episode.max_turns is a setting of episode tasks"),
    ([*MATH, "task.sandbox.isolation=warn"], "task.sandbox.isolation is a setting of tasks that run code in the sandbox"),
    ([*TC, "task.environment.args={num_tasks: 3}"], "task.environment.args is an environment setting"),
])
def test_a_section_the_task_does_not_read_is_refused(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_run(load_config(None, overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_task_takes_its_own_sections():
    cfg, task = check_run(load_config(None, [*TC, "task.temporal_clue.difficulty=lookup -> 1 at 0.5",
                                             "task.temporal_clue.list_choices=false"]))
    assert cfg.task.temporal_clue.list_choices is False and task.eval_problems()
    cfg, _ = check_run(load_config(None, ["task.name=math_python", "task.train_path=aime2024", "rollout.engine=hf",
                                          "task.episode.max_turns=3", "task.sandbox.isolation=warn"]))
    assert (cfg.task.episode.max_turns, cfg.task.sandbox.isolation) == (3, "warn")


def test_episode_settings_follow_the_episode_function(tmp_path):
    (tmp_path / "plain.py").write_text(USER_TASK)
    (tmp_path / "agent.py").write_text(USER_TASK + EPISODE)
    plain = [f"task.name={tmp_path / 'plain.py'}:problems", "rollout.engine=hf", "task.episode.timeout_s=9"]
    with pytest.raises(ConfigError, match=r"task\.episode\.timeout_s is a setting of episode tasks"):
        check_run(load_config(None, plain))
    # The same single-turn task with an episode function named, and a module with its own rollout.
    cfg, _ = check_run(load_config(None, [*plain, f"task.episode.rollout={tmp_path / 'agent.py'}:rollout"]))
    assert cfg.task.episode.timeout_s == 9
    check_run(load_config(None, [f"task.name={tmp_path / 'agent.py'}:problems", "rollout.engine=hf",
                                 "task.episode.max_turns=2"]))


def test_sections_at_their_defaults_are_no_error(tmp_path):
    """A run directory's config.yaml writes every section out; reloading a math run's must pass."""
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(load_config(None, MATH)))
    assert "temporal_clue:" in saved.read_text()
    cfg, _ = check_run(load_config(saved))
    assert cfg.task.name == "math"
    assert load_config(None, [*MATH, "task.temporal_clue.difficulty=1"]).task.changed_sections() == {}


@pytest.mark.parametrize(("old", "new"), [
    ("task.difficulty=2", "task.temporal_clue.difficulty"), ("task.list_choices=false", "task.temporal_clue.list_choices"),
    ("task.dataset=x", "task.reasoning_gym.dataset"), ("task.rollout=m:f", "task.episode.rollout"),
    ("task.episode_timeout_s=3", "task.episode.timeout_s"), ("task.sandbox_isolation=warn", "task.sandbox.isolation"),
    ("task.env_args.num_tasks=3", "task.environment.args"),
])
def test_an_old_flat_key_names_its_new_home(old, new, tmp_path):
    key = old.partition("=")[0].removesuffix(".num_tasks")
    with pytest.raises(ConfigError, match=rf"^config key '{key}' has moved to '{new}'$"):
        load_config(None, [old])
    yaml_file = tmp_path / "old.yaml"
    yaml_file.write_text(f"task:\n  name: temporal_clue\n  {key.removeprefix('task.')}: 1\n")
    with pytest.raises(ConfigError, match=rf"'{key}' has moved to '{new}'"):
        load_config(yaml_file)


def test_clue_ablation_on_a_task_without_clues_is_refused_in_one_line(capsys):
    from sleuth.cli import main

    assert main(["train", "--dry-run", *MATH, "eval.ablate_clues=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["sleuth: error: eval.ablate_clues needs a task with clues (temporal_clue), not math"], err
    check_run(load_config(None, [*TC, "eval.ablate_clues=true"]))  # Temporal Clue has them
