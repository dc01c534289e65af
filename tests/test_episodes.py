"""Episode tasks: finding the rollout function, failures scored 0 and counted, math with a Python tool."""

import json

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError
from sleuth.records import Problem, SamplingParams
from sleuth.tasks.episodes import EpisodeRunner, episode_metrics, find_rollout, problem_payload
from sleuth.tasks.math_python import MathPythonTask
from sleuth.tasks.registry import build_task
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer

USER_TASK = '''
import asyncio

def problems(cfg):
    return [{"prompt": f"say {i}", "answer": i} for i in range(3)]

async def rollout(client, problem):
    reply = await client.chat.completions.create(model="policy", messages=problem["messages"])
    kind = reply.choices[0].message.content
    if kind == "raise":
        raise RuntimeError("environment broke")
    if kind == "hang":
        await asyncio.sleep(60)
    if kind == "nan":
        return float("nan")
    return {"reward": problem["answer"] / 2, "metrics": {"turns": 1}}

def sync_rollout(client, problem):
    return 1.0
'''


@pytest.fixture
def user_task(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(USER_TASK)
    return path


def runner_for(task_cfg, task, texts, max_tokens=16):
    engine = ScriptedEngine(build_tokenizer(), texts)
    return EpisodeRunner(find_rollout(task_cfg, task), engine, engine.tokenizer, task_cfg,
                         SamplingParams(max_tokens=max_tokens))


def test_rollout_found_in_the_module_or_named(user_task):
    cfg = TaskConfig(name=f"{user_task}:problems")
    task = build_task(cfg)  # no verify needed: the rollout scores
    assert find_rollout(cfg, task).__name__ == "rollout"
    with pytest.raises(ConfigError, match="must be `async def rollout"):
        find_rollout(TaskConfig(name=cfg.name, rollout=f"{user_task}:sync_rollout"), task)
    math_cfg = TaskConfig(name="math", train_path=str(user_task.with_name("m.jsonl")))
    user_task.with_name("m.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": 2}) + "\n")
    assert find_rollout(math_cfg, build_task(math_cfg)) is None
    assert problem_payload(task.train_problem(0))["prompt"].startswith("say ")


def test_failing_episodes_score_zero_and_are_counted(user_task):
    cfg = TaskConfig(name=f"{user_task}:problems", episode_timeout_s=8)
    task = build_task(cfg)
    problems = [Problem("p", [{"role": "user", "content": "x"}], 2)]
    runner = runner_for(cfg, task, ["ok", "raise", "hang", "nan"])
    groups, outcomes = runner.run(problems, n=4, seed=0)
    statuses = sorted(o.status for o in outcomes[0])
    assert statuses == ["error", "error", "ok", "timeout"]
    assert sorted(o.reward for o in outcomes[0]) == [0.0, 0.0, 0.0, 1.0]
    assert any("environment broke" in o.error for o in outcomes[0])
    m = episode_metrics(outcomes, groups)
    assert (m["rollout/episode_errors"], m["rollout/episode_timeouts"], m["rollout/episodes"]) == (2, 1, 4)
    assert m["rollout/reward_mean"] == 0.25 and m["episode/turns"] == 1.0
    assert groups[0].episode_rewards == [o.reward for o in outcomes[0]] and len(groups[0].completions) == 4


def tool_call(code):
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def math_python_episode(tmp_path, texts):
    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "What is 6*7?", "answer": 42}) + "\n")
    cfg = TaskConfig(name="math_python", train_path=str(tmp_path / "m.jsonl"), max_turns=3)
    task = build_task(cfg)
    assert isinstance(task, MathPythonTask)
    runner = runner_for(cfg, task, texts, max_tokens=200)
    groups, outcomes = runner.run([task.train_problem(0)], n=1, seed=0)
    return groups[0], outcomes[0][0]


def test_math_with_a_python_tool_solves(tmp_path):
    group, outcome = math_python_episode(tmp_path, [tool_call("print(6*7)"), "So the answer is \\boxed{42}."])
    assert (outcome.status, outcome.reward) == ("ok", 1.0)
    assert outcome.metrics["sandbox_ok"] == 1.0 and outcome.metrics["sandbox_network"] == 0.0
    [seq] = group.completions
    inserted = build_tokenizer().decode([t for t, m in zip(seq.completion_ids, seq.loss_mask) if not m])
    assert "42" in inserted  # the tool's output went back to the model, without loss


@pytest.mark.parametrize("reason, code", [
    ("network", "import socket; socket.create_connection(('1.1.1.1', 80))"),
    ("filesystem", "open('/etc/sleuth-escape', 'w')"),
    ("process", "import os\nwhile True: os.fork()"),
    ("memory", "x = bytearray(10 * 2**30)"),
    ("output", "print('x' * (100 * 2**20))"),
])
def test_sandbox_violations_score_zero_with_the_reason(tmp_path, reason, code):
    _, outcome = math_python_episode(tmp_path, [tool_call(code), "\\boxed{42}"])
    assert outcome.reward == 0.0 and outcome.metrics[f"sandbox_{reason}"] == 1.0


@pytest.mark.slow
def test_train_two_iterations_on_the_guess_number_example(tmp_path):
    from pathlib import Path

    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    example = Path(__file__).resolve().parents[1] / "examples" / "guess_number.py"
    model = write_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    code = main(["train", f"model.path={model}", f"task.name={example}:problems", "rollout.engine=hf", "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
                 "model.dtype=float32", "model.lora.enabled=false", "rollout.samples_per_task=2",
                 "rollout.max_tokens=4", "loop.iterations=2", "loop.tasks_per_iteration=2", "task.eval_size=1",
                 "eval.k=1", "loop.checkpoint_every=0", "--out", str(run)])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["rollout/episodes"] == 4 and r["rollout/episode_errors"] == 0
        assert r["rollout/episode_calls_mean"] == 4  # MAX_GUESSES turns: a random model never wins
        assert 0 <= r["rollout/reward_mean"] <= 0.5
        assert r["train/sequences"] == 2 * (2 - r["train/groups_dropped"])
    assert "val/reward" in rows[0] and "val/reward" in rows[2]
    assert (run / "model" / "config.json").is_file()


@pytest.mark.slow
def test_eval_on_an_episode_task(tmp_path, capsys):
    from pathlib import Path

    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    example = Path(__file__).resolve().parents[1] / "examples" / "guess_number.py"
    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "eval"
    code = main(["eval", "--model", str(model), "--task", f"{example}:problems", "--k", "2", "--out", str(out),
                 "rollout.engine=hf", "model.dtype=float32", "task.eval_size=2", "rollout.max_tokens=4"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 2 and summary["k"] == 2 and 0 <= summary["avg"] <= 0.5
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["calls"] == 4 and r["status"] == "ok" for r in records)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("avg@2=")


def test_dry_run_checks_the_episode_function(user_task, tmp_path, capsys):
    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    base = ["train", "--dry-run", f"model.path={model}", f"task.name={user_task}:problems", "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1"]
    assert main(base) == 0
    assert "episodes: rollout through the gateway, at most 8 calls each" in capsys.readouterr().out
    assert main([*base, f"task.rollout={user_task}:missing"]) == 2
    assert "has no 'missing'" in capsys.readouterr().err
