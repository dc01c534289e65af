"""verifiers and OpenEnv environments as tasks, on the real libraries (tests/envs/ holds the
environments): rewards equal the environment's own scoring of the same replies, failures are
one-line errors or counted zero-scored episodes, and each trains 2 iterations and evaluates."""

import asyncio
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sleuth.config import TaskConfig, load_config
from sleuth.errors import ConfigError, UserError
from sleuth.gateway.runner import EpisodeRunner
from sleuth.loop.batch import episode_metrics
from sleuth.loop.checks import check_names, check_run
from sleuth.records import SamplingParams
from sleuth.tasks.registry import build_task
from sleuth.tasks.user import find_rollout
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer

pytest.importorskip("verifiers.v1", reason="the `envs` extra (verifiers) is not installed")
pytest.importorskip("openenv.core", reason="the `envs` extra (openenv-core) is not installed")

ENVS = Path(__file__).resolve().parent / "envs"


@pytest.fixture(autouse=True)
def env_modules(monkeypatch):
    """The test environments importable here and in the processes the adapters start."""
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ENVS), os.environ.get("PYTHONPATH")])))


def run_episodes(task_cfg, task, texts, problems, n=1, max_tokens=128):
    engine = ScriptedEngine(build_tokenizer(), texts)
    runner = EpisodeRunner(find_rollout(task_cfg, task), engine, engine.tokenizer, task_cfg.episode,
                           SamplingParams(max_tokens=max_tokens))
    groups, outcomes = runner.run(problems, n=n, seed=0)
    return outcomes, episode_metrics(outcomes, groups)


def own_score(task, vf_index, reply, tool_messages=()):
    """The environment's own reward functions on a reply: {name: score}, and score x weight summed."""
    vf_task = task.tasks[vf_index]
    trace = SimpleNamespace(last_reply=reply, tool_messages=list(tool_messages))
    scores, total = {}, 0.0
    for fn in vf_task.hooks("reward"):
        scores[fn.__name__] = asyncio.run(fn(trace))
        total += scores[fn.__name__] * fn._vf_weight
    return scores, total


def test_verifiers_single_turn_rewards_are_the_environments_own():
    cfg = TaskConfig(name="verifiers:sleuth_vf_sum", environment={"args": {"num_tasks": 6}}, eval_size=2)
    task = build_task(cfg)
    problems = task.eval_problems()
    assert [p.messages for p in problems][1] == [{"role": "user", "content": "What is 1 + 2? Reply with the number."}]
    assert {task.train_problem(i).id for i in range(8)} <= {f"sleuth_vf_sum-{i}" for i in range(2, 6)}
    replies = ["3", "the sum is 3, I think", "nope"]
    outcomes, metrics = run_episodes(cfg, task, replies, problems[1:], n=3)
    for o in outcomes[0]:  # concurrent episodes take the scripted replies in any order
        scores, total = own_score(task, 1, o.episode.turns[-1].text.strip())
        assert o.status == "ok" and o.reward == total
        assert {k: v for k, v in o.metrics.items() if k.startswith("reward/")} == {
            f"reward/{k}": v for k, v in scores.items()}
        assert 0 < o.metrics["model_s"] <= o.metrics["harness_s"]  # verifiers' own timing of the episode
    assert sorted(o.reward for o in outcomes[0]) == [0.5, 1.0, 1.5]
    assert metrics["rollout/reward/correct"] == pytest.approx(2 / 3)
    assert metrics["rollout/reward/brief"] == pytest.approx(2 / 3)


def test_verifiers_multi_turn_with_a_tool():
    cfg = TaskConfig(name="verifiers:sleuth_vf_tool", eval_size=2, episode={"timeout_s": 120})
    task = build_task(cfg)
    call = "<tool_call>" + json.dumps({"name": "calc_multiply", "arguments": {"a": 3, "b": 7}}) + "</tool_call>"
    outcomes, metrics = run_episodes(cfg, task, [call, "It is 21"], task.eval_problems()[:1])
    o = outcomes[0][0]
    assert o.status == "ok" and o.episode.calls == 2
    assert o.reward == own_score(task, 0, "It is 21", [SimpleNamespace(content="21")])[1] == 1.25
    tool_turn = build_tokenizer().decode(o.episode.turns[-1].ids)
    assert "<|im_start|>tool\n21<|im_end|>" in tool_turn  # the tool server's answer, fed back
    assert metrics["rollout/reward/used_tool"] == 1.0
    # token-exact: the harness's second call extends the first, so the episode is one sequence
    assert metrics["rollout/sequences_per_episode"] == 1 and metrics["rollout/template_mismatches"] == 0


def test_verifiers_failures_are_counted_or_one_line():
    cfg = TaskConfig(name="verifiers:sleuth_vf_sum", environment={"args": {"num_tasks": 3, "broken_reward": True}}, eval_size=1)
    task = build_task(cfg)
    outcomes, metrics = run_episodes(cfg, task, ["3"], task.eval_problems(), n=2)
    assert [o.status for o in outcomes[0]] == ["error", "error"] and metrics["rollout/episode_errors"] == 2
    assert "this reward function is broken" in outcomes[0][0].error
    with pytest.raises(UserError, match=r"could not be loaded.*no_such_env"):
        build_task(TaskConfig(name="verifiers:no_such_env"))
    with pytest.raises(UserError, match="could not be loaded"):
        build_task(TaskConfig(name="verifiers:sleuth_vf_sum", environment={"args": {"num_taskz": 3}}))
    with pytest.raises(ConfigError, match="always go to sleuth's gateway"):
        build_task(TaskConfig(name="verifiers:sleuth_vf_sum", environment={"args": {"agent": {"client": {}}}}))
    with pytest.raises(ConfigError, match=r"task\.environment\.args is an environment setting .*; task\.name is math"):
        check_run(load_config(None, ["task.name=math", "task.train_path=aime2024", "rollout.engine=hf",
                                     "task.environment.args={num_tasks: 3}"]))
    with pytest.raises(ConfigError, match="needs an environment after the colon"):
        check_names(load_config(None).model_copy(update={"task": TaskConfig(name="verifiers:")}))
    for name in ("verifiers:", "openenv:"):  # from the command line (YAML would read a mapping there)
        with pytest.raises(ConfigError, match=f"'{name}' needs an environment after the colon"):
            check_names(load_config(None, [f"task.name={name}"]))


def test_unsupported_or_missing_library_is_one_line(monkeypatch):
    import verifiers

    monkeypatch.setattr(verifiers, "__version__", "0.5.1")
    with pytest.raises(UserError, match=r"verifiers 0.5.1 is installed; sleuth supports 0.4.x"):
        build_task(TaskConfig(name="verifiers:sleuth_vf_sum"))
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(UserError, match="the verifiers package is not installed"):
        build_task(TaskConfig(name="verifiers:sleuth_vf_sum"))
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(UserError, match="OpenEnv is not installed"):
        build_task(TaskConfig(name="openenv:http://127.0.0.1:9"))


@pytest.fixture(scope="module")
def word_task():
    """The OpenEnv word game served by sleuth (openenv:MODULE), shared by this module's tests."""
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(ENVS))
    mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ENVS), os.environ.get("PYTHONPATH")])))
    cfg = TaskConfig(name="openenv:sleuth_openenv_word", eval_size=2, episode={"timeout_s": 60})
    task = build_task(cfg)
    yield cfg, task
    task.close()
    mp.undo()


def test_openenv_rewards_are_the_environments_own(word_task):
    from sleuth_openenv_word import WordAction, WordEnvironment

    cfg, task = word_task
    assert build_task(cfg).url == task.url  # built again (a curriculum level): the same server process
    replies = ["apple river stone cloud ember maple tiger lemon", "I will not say it"]
    outcomes, metrics = run_episodes(cfg, task, replies, task.eval_problems(), n=2)
    for problem, per in zip(task.eval_problems(), outcomes, strict=True):
        for o in per:
            env = WordEnvironment()  # the environment's own scoring, in this process, same replies
            env.reset(seed=problem.metadata["seed"])
            texts = [t.text for t in o.episode.turns]
            own = sum(env.step(WordAction(message=t)).reward for t in texts)
            assert o.status == "ok" and o.episode.calls == 2 and o.reward == own
    rewards = [o.reward for per in outcomes for o in per]
    assert set(rewards) <= {0.0, 0.5, 1.0} and max(rewards) > 0  # the scripted replies interleave
    assert metrics["episode/steps"] == 2 and metrics["rollout/episode_errors"] == 0


def test_openenv_server_dying_mid_episode_is_counted_and_unreachable_is_one_line(word_task):
    from sleuth.tasks.openenv_env import step_reward

    with pytest.raises(UserError, match=r"OpenEnv server at http://127\.0\.0\.1:9 is unreachable"):
        build_task(TaskConfig(name="openenv:http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match="unknown key"):
        build_task(TaskConfig(name="openenv:http://127.0.0.1:9", environment={"args": {"actoin_field": "text"}}))
    with pytest.raises(UserError, match="exited"):
        build_task(TaskConfig(name="openenv:sleuth_no_such_server_module"))
    with pytest.raises(ValueError, match="malformed reward"):
        step_reward("1.0")
    assert step_reward(None) == 0.0 and step_reward(True) == 1.0
    with pytest.raises(ValueError, match="malformed reward"):
        step_reward(float("nan"))
    cfg, task = word_task
    outcomes, metrics = run_episodes(cfg, task, ["KILL-SERVER"], task.eval_problems()[:1], n=2)
    assert [o.status for o in outcomes[0]] == ["error", "error"] and metrics["rollout/episode_errors"] == 2


def cli_train_and_eval(tmp_path, name, *extra, tasks=2, k=2):
    from sleuth.cli import main
    from sleuth.testing.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    common = ["rollout.engine=hf", "model.dtype=float32", "rollout.max_tokens=8", "task.eval_size=2", *extra]
    code = main(["train", f"model.path={model}", f"task.name={name}", "algorithm.credit=sequence",
                 "algorithm.format_reward=0", "trainer.mini_batches=1", "model.lora.enabled=false",
                 "rollout.samples_per_task=2", "loop.iterations=2", f"loop.tasks_per_iteration={tasks}", "eval.k=1",
                 "loop.checkpoint_every=0", *common, "--out", str(run)])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(run / "model"), "--task", name, "--k", str(k), "--out", str(out), *common]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == 2 and summary["k"] == k
    return rows, summary


@pytest.mark.slow
def test_train_and_eval_a_verifiers_environment(tmp_path):
    rows, summary = cli_train_and_eval(tmp_path, "verifiers:sleuth_vf_sum", "task.environment.args={num_tasks: 8}")
    for r in rows[1:]:
        assert r["rollout/episodes"] == 4 and r["rollout/episode_errors"] == 0
        assert 0 <= r["rollout/reward/correct"] <= 1 and 0 <= r["rollout/reward/brief"] <= 1
        assert r["rollout/reward_mean"] == pytest.approx(r["rollout/reward/correct"] + 0.5 * r["rollout/reward/brief"])
    assert 0 <= summary["avg"] <= 1.5


@pytest.mark.slow
def test_train_and_eval_a_multi_turn_verifiers_environment_with_a_tool(tmp_path):
    # One problem per iteration, one sample per held-out problem: each episode starts the toolset's
    # server, seconds apiece (the multi-turn path is also covered in-process by
    # test_verifiers_multi_turn_with_a_tool).
    rows, summary = cli_train_and_eval(tmp_path, "verifiers:sleuth_vf_tool", "task.episode.max_turns=3", tasks=1, k=1)
    for r in rows[1:]:
        assert r["rollout/episodes"] == 2 and r["rollout/episode_errors"] == 0
    assert 0 <= summary["avg"] <= 1.25


@pytest.mark.slow
def test_train_and_eval_an_openenv_environment(tmp_path):
    rows, summary = cli_train_and_eval(tmp_path, "openenv:sleuth_openenv_word")
    for r in rows[1:]:
        assert r["rollout/episodes"] == 4 and r["rollout/episode_errors"] == 0 and r["episode/steps"] == 2
    assert 0 <= summary["avg"] <= 1


@pytest.mark.slow
def test_bench_smoke():
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "environments.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    assert set(last) >= {"verifiers_median_ms", "verifiers_overhead_ms", "openenv_median_ms", "openenv_p99_ms"}
    assert all(float(last[k]) > 0 for k in ("verifiers_median_ms", "openenv_median_ms"))


def test_observation_text_and_env_config_mapping():
    from sleuth.tasks.openenv_env import observation_text
    from sleuth.tasks.verifiers_env import env_config_data

    assert observation_text({"n": 3, "prompt": "hi", "other": "x"}, None) == "hi"  # the first string field
    assert observation_text({"prompt": "hi", "board": "X.O"}, "board") == "X.O"
    with pytest.raises(ValueError, match="no text field 'board'"):
        observation_text({"prompt": "hi"}, "board")
    with pytest.raises(ValueError, match="no text field; fields: n"):
        observation_text({"n": 3}, None)
    data = env_config_data("my_env", {"num_tasks": 5, "agent": {"max_turns": 3}, "timeout": {"episode": 9}})
    assert data["taskset"] == {"num_tasks": 5, "id": "my_env"} and data["timeout"] == {"episode": 9}
    assert data["agent"] == {"max_turns": 3, "harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    pinned = env_config_data("my_env", {"agent": {"harness": {"id": "bash"}}})["agent"]
    assert pinned["harness"] == {"id": "bash"}  # what task.environment.args pins is kept
