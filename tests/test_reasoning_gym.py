"""reasoning-gym datasets as sleuth tasks: names, determinism, the held-out set, scoring, training."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym extra not installed")

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, UserError
from sleuth.tasks.reasoning_gym import INSTRUCTION, ReasoningGymTask, build, dataset_names, extract_answer
from sleuth.tasks.registry import build_task


def cfg(**kw: object) -> TaskConfig:
    """A reasoning_gym TaskConfig; dataset and dataset_args go to its task.reasoning_gym section."""
    section = {"dataset": "knights_knaves"} | {k: kw.pop(k) for k in ("dataset", "dataset_args") if k in kw}
    base: dict[str, object] = {"name": "reasoning_gym", "eval_size": 8, "reasoning_gym": section}
    base.update(kw)
    return TaskConfig(**base)


def test_registry_builds_the_named_dataset() -> None:
    task = build_task(cfg())
    assert isinstance(task, ReasoningGymTask) and task.dataset == "knights_knaves"
    assert "knights_knaves" in dataset_names() and len(dataset_names()) > 50


def test_unknown_or_missing_dataset_and_bad_args_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"unknown reasoning-gym dataset task\.reasoning_gym\.dataset='knights_knave'.*"
                                          r"did you mean 'knights_knaves'"):
        build(cfg(dataset="knights_knave"))
    with pytest.raises(ConfigError, match=r"needs task\.reasoning_gym\.dataset"):
        build(cfg(dataset=None))
    with pytest.raises(ConfigError, match="unexpected keyword argument 'n_peeple'"):
        build(cfg(dataset_args={"n_peeple": 3}))
    with pytest.raises(ConfigError, match="'composite' are invalid"):
        build(cfg(dataset="composite"))  # needs its list of datasets
    with pytest.raises(ConfigError, match=r"task\.train_path is not used"):
        build(cfg(train_path="x.jsonl"))


def test_missing_package_is_a_user_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(UserError, match=r"needs the reasoning-gym package: pip install 'sleuth\[reasoning-gym\]'"):
        build(cfg())


def test_training_stream_is_deterministic_endless_and_seeded() -> None:
    a, b = build(cfg()), build(cfg())
    for i in (0, 1, 999, 1000, 2501):  # across chunk boundaries
        pa, pb = a.train_problem(i), b.train_problem(i)
        assert pa.messages == pb.messages and pa.answer == pb.answer and pa.id == f"knights_knaves/train/{i}"
    questions = [a.train_problem(i).messages[-1]["content"] for i in range(20)]
    assert len(set(questions)) == 20
    other = build(cfg(seed=1))
    assert [other.train_problem(i).messages for i in range(5)] != [a.train_problem(i).messages for i in range(5)]


def test_eval_set_is_fixed_across_seeds_and_kept_out_of_training() -> None:
    a, b = build(cfg(seed=0)), build(cfg(seed=7))
    ea, eb = a.eval_problems(), b.eval_problems()
    assert len(ea) == 8 and [p.messages for p in ea] == [p.messages for p in eb]
    held_out = {p.messages[-1]["content"] for p in ea}
    assert all(a.train_problem(i).messages[-1]["content"] not in held_out for i in range(100))
    # A tiny problem space repeats questions often: the raw generated stream hits the held-out
    # set, the task's training stream never does.
    small = build(cfg(dataset="gcd", eval_size=4,
                      dataset_args={"min_value": 1, "max_value": 6, "min_numbers": 2, "max_numbers": 2}))
    held = {p.messages[-1]["content"] for p in small.eval_problems()}
    raw = small._chunk(0, 0)
    assert sum(f"{raw[i]['question']}\n\n{INSTRUCTION}" in held for i in range(200)) > 10
    assert all(small.train_problem(i).messages[-1]["content"] not in held for i in range(200))


def test_score_uses_the_datasets_scorer_on_the_last_answer_tag() -> None:
    task = build(cfg(system_prompt="Be brief."))
    problem = task.eval_problems()[0]
    assert problem.messages[0] == {"role": "system", "content": "Be brief."}
    assert "<answer>" in problem.messages[-1]["content"]
    right = problem.answer
    assert task.score(problem, f"thinking...\n<answer>{right}</answer>") == 1.0
    assert task.score(problem, f"<answer>{right}</answer> no, wait: <answer>nonsense</answer>") == 0.0
    assert task.score(problem, right) == 0.0  # no tags
    # Scoring a problem rebuilt without its entry (only split/index kept) regenerates it.
    from sleuth.records import Problem

    bare = Problem(problem.id, problem.messages, problem.answer, {"split": "eval", "index": 0})
    assert task.score(bare, f"<answer>{right}</answer>") == 1.0
    # Verifier worker processes receive the task pickled.
    clone = pickle.loads(pickle.dumps(task))
    assert clone.score(problem, f"<answer>{right}</answer>") == 1.0
    assert task.answer_key(problem, "<answer> X </answer>") == "X" == extract_answer("<answer>X</answer>")


@pytest.mark.parametrize("name", ["basic_arithmetic", "gcd", "word_sorting", "maze", "countdown"])
def test_other_datasets_score_their_own_reference_answers(name: str) -> None:
    task = build(cfg(dataset=name, eval_size=2))
    for problem in [task.train_problem(0), *task.eval_problems()]:
        assert task.score(problem, f"<answer>{problem.answer}</answer>") == 1.0
        assert task.score(problem, "<answer>definitely not it</answer>") < 1.0


@pytest.mark.slow
def test_two_training_iterations_with_the_tiny_model(tmp_path: Path) -> None:
    loop = pytest.importorskip("sleuth.loop.train", reason="the RL loop (sleuth.loop.train) has not landed yet")
    del loop
    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    code = main(["train", "--out", str(run), "task.name=reasoning_gym", "task.reasoning_gym.dataset=basic_arithmetic",
                 "task.eval_size=2", f"model.path={model}", "model.dtype=float32", "rollout.engine=hf", "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
                 "rollout.samples_per_task=2", "rollout.max_tokens=8", "loop.iterations=2",
                 "loop.tasks_per_iteration=2", "loop.eval_every=0", "eval.k=1", "logging.tensorboard=false"])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["iteration"] for r in trained] == [1, 2]
    # Every completion went through the dataset's scorer without a verifier error. (The random tiny
    # model never writes <answer> tags, so its rewards are 0 and the trainer skips the step; the
    # gradient path is the loop's tests' business, this one checks the task plugs in end to end.)
    assert all(r["rollout/reward_mean"] == 0.0 and r["rollout/verifier_errors"] == 0 for r in trained)
    assert sum(r["rollout/tokens"] for r in trained) > 0
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["problem_id"].startswith("basic_arithmetic/eval/") for s in samples)
