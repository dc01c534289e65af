"""Episode tasks: finding the rollout function, failures scored 0 and counted, math with a Python tool."""

import json

import pytest

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError
from sleuth.gateway.runner import EpisodeRunner, problem_payload
from sleuth.loop.batch import episode_metrics
from sleuth.records import Problem, SamplingParams
from sleuth.tasks.math_python import MathPythonTask
from sleuth.tasks.registry import build_task
from sleuth.tasks.user import find_rollout
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
    return EpisodeRunner(find_rollout(task_cfg, task), engine, engine.tokenizer, task_cfg.episode,
                         SamplingParams(max_tokens=max_tokens))


def test_rollout_found_in_the_module_or_named(user_task):
    cfg = TaskConfig(name=f"{user_task}:problems")
    task = build_task(cfg)  # no verify needed: the rollout scores
    assert find_rollout(cfg, task).__name__ == "rollout"
    with pytest.raises(ConfigError, match="must be `async def rollout"):
        find_rollout(TaskConfig(name=cfg.name, episode={"rollout": f"{user_task}:sync_rollout"}), task)
    math_cfg = TaskConfig(name="math", train_path=str(user_task.with_name("m.jsonl")))
    user_task.with_name("m.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": 2}) + "\n")
    assert find_rollout(math_cfg, build_task(math_cfg)) is None
    assert problem_payload(task.train_problem(0))["prompt"].startswith("say ")


def test_failing_episodes_score_zero_and_are_counted(user_task):
    cfg = TaskConfig(name=f"{user_task}:problems", episode={"timeout_s": 8})
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
    cfg = TaskConfig(name="math_python", train_path=str(tmp_path / "m.jsonl"), episode={"max_turns": 3})
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


def test_streaming_an_episode_task_runs_each_groups_episodes_on_one_held_session(tmp_path):
    """loop.streaming on the guess-number example: each group's episodes run as the stream draws
    its problem (EpisodeRunner.open_shared), their metrics count episodes, the staleness bound holds
    and every drawn position is accounted for."""
    from pathlib import Path

    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    example = Path(__file__).resolve().parents[1] / "examples" / "guess_number.py"
    model = write_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    code = main(["train", f"model.path={model}", f"task.name={example}:problems", "rollout.engine=hf",
                 "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
                 "model.dtype=float32", "model.lora.enabled=false", "rollout.samples_per_task=2",
                 "rollout.max_tokens=4", "loop.iterations=3", "loop.tasks_per_iteration=2", "loop.evaluate=false",
                 "loop.streaming=true", "loop.max_staleness=2", "algorithm.drop_zero_advantage=false",
                 "loop.checkpoint_every=0", "--out", str(run)])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert len(r["rollout/positions"]) == 2 and r["rollout/staleness_max"] <= 2
        assert r["rollout/episodes"] == 2 * (2 + len(r["rollout/skipped_positions"]))
        assert r["rollout/episode_errors"] == 0 and r["rollout/episode_calls_mean"] == 4
        assert r["train/sequences"] == 2 * 2  # 2 groups x 2 episodes (an episode's turns are one sequence)
    consumed = [p for r in rows for p in r["rollout/positions"] + r["rollout/skipped_positions"]]
    state = json.loads((run / "checkpoints" / "iter-000003" / "state.json").read_text())
    assert len(consumed) == len(set(consumed))
    assert sorted(consumed + state["stream_pending"]) == list(range(state["data_position"]))


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
    assert main([*base, f"task.episode.rollout={user_task}:missing"]) == 2
    assert "has no 'missing'" in capsys.readouterr().err


HOSTILE_TASK = '''
import asyncio, sys, time

def problems(cfg):
    return [{"prompt": f"say {i}", "answer": i} for i in range(3)]

async def rollout(client, problem):
    kind = problem["prompt"] if problem["prompt"] in KINDS else None
    if kind is None:
        reply = await client.chat.completions.create(model="policy", messages=problem["messages"])
        kind = reply.choices[0].message.content
    return await KINDS.get(kind, ok)(client, problem)

async def ok(client, problem):
    return 1.0

async def sleeps(client, problem):      # blocking: holds the event loop, then returns a reward
    time.sleep(2.5)
    return 1.0

async def spins(client, problem):       # CPU-bound for good, swallowing ordinary exceptions
    while True:
        try:
            pass
        except Exception:
            pass

async def exits(client, problem):
    sys.exit(0)

async def cancels(client, problem):
    raise asyncio.CancelledError()

async def keyerror(client, problem):
    return problem["no such key"]

async def huge(client, problem):
    return 1e154

async def huge_negative(client, problem):
    return {"reward": -1e300, "metrics": {"x": 1}}

async def no_model(client, problem):    # answers without the model
    return 1.0

KINDS = {"ok": ok, "sleeps": sleeps, "spins": spins, "exits": exits, "cancels": cancels, "keyerror": keyerror,
         "huge": huge, "huge_negative": huge_negative, "no_model": no_model}
'''


@pytest.fixture
def hostile_task(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE_TASK)
    return path


def test_episode_code_cannot_escape_its_limit_or_end_the_run(hostile_task):
    """Blocking and CPU-bound code past task.episode.timeout_s scores 0 as a timeout (the watchdog
    frees the loop: the batch ends); sys.exit, a stray CancelledError and huge rewards are errors."""
    import time

    cfg = TaskConfig(name=f"{hostile_task}:problems", episode={"timeout_s": 1.5})
    task = build_task(cfg)
    kinds = ["exits", "cancels", "huge", "huge_negative", "keyerror", "sleeps", "spins"]
    problems = [Problem(k, [{"role": "user", "content": k}], 0) for k in kinds]
    runner = runner_for(cfg, task, ["ok"])
    t = time.monotonic()
    groups, outcomes = runner.run(problems, n=1, seed=0)
    assert time.monotonic() - t < 15
    status = {k: (o[0].status, o[0].reward) for k, o in zip(kinds, outcomes, strict=True)}
    assert status == {"exits": ("error", 0.0), "cancels": ("error", 0.0), "huge": ("error", 0.0),
                      "huge_negative": ("error", 0.0), "keyerror": ("error", 0.0), "sleeps": ("timeout", 0.0),
                      "spins": ("timeout", 0.0)}
    errors = " | ".join(o[0].error for o in outcomes)
    assert "sys.exit(0)" in errors and "CancelledError" in errors and "within [-1e+06, 1e+06]" in errors
    m = episode_metrics(outcomes, groups)
    assert (m["rollout/episode_errors"], m["rollout/episode_timeouts"]) == (5, 2)
    # the runner is usable again afterwards (the watchdog stopped with the batch), and calls work
    ok = runner.run([Problem("p", [{"role": "user", "content": "x"}], 2)], n=2, seed=1)[1][0]
    assert [o.status for o in ok] == ["ok", "ok"] and ok[0].episode.calls == 1


def test_a_problem_whose_episodes_all_fail_before_the_first_call_is_dropped(hostile_task):
    """The sampler of a training run: such a group scores 0, counts, and is dropped (not a crash)."""
    from sleuth.config import load_config
    from sleuth.loop.batch import Sampler
    from sleuth.run.progress import Progress

    cfg = load_config(None, [f"task.name={hostile_task}:problems", "rollout.samples_per_task=2",
                             "loop.tasks_per_iteration=3", "algorithm.format_reward=0", "algorithm.credit=sequence",
                             "task.episode.timeout_s=5"])
    task = build_task(cfg.task)
    for first in ("keyerror", "no_model", "exits", "ok"):  # every problem's prompt names what its episodes do
        problems = {0: first, 1: "say 1", 2: "say 2"}

        class Task3:
            def train_problem(self, i, _p=problems):
                return Problem(f"p{i}", [{"role": "user", "content": _p[i % 3]}], i)

            def __getattr__(self, name):
                return getattr(task, name)

        runner = runner_for(cfg.task, task, ["ok", "ok"])
        sampler = Sampler(cfg, runner.gateway.tokenizer, runner.gateway.engine, None, lambda _: Task3(),
                          Progress(enabled=False), runner)
        batch = sampler.collect(1, 0, 1, 0)
        called = first not in ("keyerror", "no_model", "exits")
        assert len(batch.groups) + batch.metrics["train/groups_dropped"] == 3
        assert batch.metrics["rollout/episodes"] == 6
        assert batch.metrics["rollout/episode_errors"] == (0 if called or first == "no_model" else 2)
        if not called:
            assert batch.positions == [1, 2] or batch.groups == []
            assert batch.metrics["train/groups_dropped"] >= 1


STUBBORN = '''
from sleuth.task_config import EpisodeConfig
from sleuth.records import Problem, SamplingParams
from sleuth.gateway.runner import EpisodeRunner
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer

async def rollout(client, problem):  # swallows even the watchdog's BaseException, for good
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass

engine = ScriptedEngine(build_tokenizer(), ["ok"])
runner = EpisodeRunner(rollout, engine, engine.tokenizer, EpisodeConfig(timeout_s=0.5),
                       SamplingParams(max_tokens=4))
runner.run([Problem("p", [{"role": "user", "content": "x"}], 0)], n=1, seed=0)
'''


def test_episode_code_that_swallows_being_stopped_ends_the_process_with_one_line(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sleuth: error: episode code has held the event loop for ")
    assert "ignores being stopped" in lines[0] and "--resume" in lines[0]


SPINNING_AGENT = '''
def problems(cfg):
    return [{"prompt": f"say {i}", "answer": i} for i in range(8)]

async def rollout(client, problem):
    await client.chat.completions.create(model="policy", messages=problem["messages"], max_tokens=2)
    if problem["answer"] % 2:
        while True:  # CPU-bound for good, on the event loop every episode and the gateway share
            pass
    return float(problem["answer"] % 4 == 0)
'''


@pytest.mark.slow
def test_a_spinning_agent_neither_hangs_training_nor_blocks_sigterms_checkpoint(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from sleuth.testing.tiny_model import write_tiny_model

    agent = tmp_path / "spinning.py"
    agent.write_text(SPINNING_AGENT)
    model = write_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "sleuth", "train", f"model.path={model}", f"task.name={agent}:problems",
            "rollout.engine=hf", "algorithm.credit=sequence", "algorithm.format_reward=0", "trainer.mini_batches=1",
            "model.dtype=float32", "model.lora.enabled=false", "rollout.samples_per_task=2", "rollout.max_tokens=4",
            "loop.iterations=50", "loop.tasks_per_iteration=2", "loop.evaluate=false", "loop.checkpoint_every=0",
            "task.episode.timeout_s=1", "--out", str(run)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)  # very likely while an agent spins: the watchdog frees the loop
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "checkpoint saved" in err and "Traceback" not in err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout/episodes" in r]
    assert rows and all(r["rollout/episode_timeouts"] >= 2 and r["rollout/episodes"] == 4 for r in rows)
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir())
