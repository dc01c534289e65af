"""Environments: what the verifiers and OpenEnv adapters cost per episode over sleuth's native path.

    python bench/environments.py [--episodes 100] [--smoke]

The same environment logic run both ways, one episode at a time through sleuth's gateway with a
scripted engine (replies at no model cost, so the difference is all adapter):
- verifiers: tests/envs/sleuth_vf_sum.py (single turn, two weighted rewards) as
  `verifiers:sleuth_vf_sum` (its Env, the null harness's program run by uv, verifiers'
  interception server relaying a streamed call, its reward functions) against a native episode
  function that makes the same chat call and calls the same reward functions in-process.
- OpenEnv: tests/envs/sleuth_openenv_word.py (reset + two steps) as `openenv:sleuth_openenv_word`
  (its server in a child process, OpenEnv's WebSocket client, a session per episode) against a
  native episode function that makes the same chat calls and drives the same Environment class
  in-process.
Per episode: wall time of `EpisodeRunner.episode` (median and p99 ms); overhead = adapter - native
(medians). `--smoke`: a few episodes, to check the script runs (tests/test_environments.py).
Last line: `name=value` pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _smoke import add_smoke_flag
from sleuth.config import TaskConfig
from sleuth.gateway.runner import EpisodeRunner, run_loop
from sleuth.records import SamplingParams
from sleuth.system.hardware import cpu_description
from sleuth.tasks.registry import build_task
from sleuth.tasks.user import find_rollout
from sleuth.testing.scripted import ScriptedEngine
from sleuth.testing.tiny_model import build_tokenizer

ENVS = Path(__file__).resolve().parents[1] / "tests" / "envs"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_episodes(runner: EpisodeRunner, problems: list[Any], n: int,
                  metrics: list[dict[str, float]] | None = None) -> list[float]:
    """Seconds per episode, one at a time (latency, not throughput), after one warm-up episode;
    each episode's metrics appended to `metrics`."""
    times: list[float] = []

    async def run() -> None:
        async with runner.session() as http:
            for i in range(n + 1):
                t = time.perf_counter()
                outcome = await runner.episode(problems[i % len(problems)], i, http=http)
                if outcome.status != "ok":
                    raise SystemExit(f"episode failed: {outcome.status}: {outcome.error}")
                if i:
                    times.append(time.perf_counter() - t)
                    if metrics is not None:
                        metrics.append(outcome.metrics)

    run_loop(run())
    return times


def runner_for(cfg: TaskConfig, rollout: Any, texts: list[str]) -> EpisodeRunner:
    engine = ScriptedEngine(build_tokenizer(), texts)
    return EpisodeRunner(rollout, engine, engine.tokenizer, cfg.episode, SamplingParams(max_tokens=64))


def verifiers_pair(n: int) -> tuple[list[float], list[float]]:
    from types import SimpleNamespace

    cfg = TaskConfig(name="verifiers:sleuth_vf_sum", environment={"args": {"num_tasks": 20}}, eval_size=10)
    task = build_task(cfg)
    problems = task.eval_problems()

    async def native(client: Any, problem: dict[str, Any]) -> dict[str, Any]:
        """The same call and the same reward functions, without verifiers' machinery."""
        reply = await client.chat.completions.create(model="policy", messages=problem["messages"])
        trace = SimpleNamespace(last_reply=(reply.choices[0].message.content or "").strip(), tool_messages=[])
        vf_task = task.tasks[problem["vf_index"]]  # type: ignore[attr-defined]
        scores = {fn.__name__: (await fn(trace), fn._vf_weight) for fn in vf_task.hooks("reward")}
        return {"reward": sum(s * w for s, w in scores.values()),
                "metrics": {f"reward/{k}": s for k, (s, _) in scores.items()}}

    metrics: list[dict[str, float]] = []
    adapter = time_episodes(runner_for(cfg, find_rollout(cfg, task), ["3"]), problems, n, metrics)
    base = time_episodes(runner_for(cfg, native, ["3"]), problems, n)
    harness = statistics.median(m["harness_s"] for m in metrics) * 1e3
    model = statistics.median(m["model_s"] for m in metrics) * 1e3
    print(f"verifiers    of an adapter episode, by verifiers' own timing (medians): harness program "
          f"{harness:.2f} ms, model calls {model:.2f} ms", flush=True)
    return adapter, base


def openenv_pair(n: int) -> tuple[list[float], list[float]]:
    from sleuth_openenv_word import WordAction, WordEnvironment

    cfg = TaskConfig(name="openenv:sleuth_openenv_word", eval_size=10, episode={"timeout_s": 60})
    task = build_task(cfg)
    problems = task.eval_problems()

    async def native(client: Any, problem: dict[str, Any]) -> dict[str, Any]:
        """The same calls against the same Environment class, in-process."""
        env = WordEnvironment()
        obs = env.reset(seed=problem["seed"])
        messages, total = [{"role": "user", "content": obs.prompt}], 0.0
        while not obs.done:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content or ""
            obs = env.step(WordAction(message=text))
            total += obs.reward or 0.0
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": obs.prompt}]
        return {"reward": total}

    try:
        adapter = time_episodes(runner_for(cfg, find_rollout(cfg, task), ["apple"]), problems, n)
        base = time_episodes(runner_for(cfg, native, ["apple"]), problems, n)
    finally:
        task.close()  # type: ignore[attr-defined]
    return adapter, base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=100)
    add_smoke_flag(parser)  # 3 each
    args = parser.parse_args()
    n = 3 if args.smoke else args.episodes
    sys.path.insert(0, str(ENVS))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ENVS), os.environ.get("PYTHONPATH")]))
    print(f"cpu: {cpu_description()}", flush=True)
    print(f"{'environment':12s} {'path':9s} {'episodes':>8s} {'median ms':>10s} {'p99 ms':>9s}")
    line = []
    for name, pair in (("verifiers", verifiers_pair), ("openenv", openenv_pair)):
        adapter, base = pair(n)
        for path, times in (("adapter", adapter), ("native", base)):
            print(f"{name:12s} {path:9s} {len(times):8d} {statistics.median(times) * 1e3:10.2f} "
                  f"{percentile(times, 0.99) * 1e3:9.2f}", flush=True)
        over = (statistics.median(adapter) - statistics.median(base)) * 1e3
        print(f"{name:12s} overhead (adapter - native, medians): {over:.2f} ms per episode", flush=True)
        line += [f"{name}_median_ms={statistics.median(adapter) * 1e3:.2f}",
                 f"{name}_p99_ms={percentile(adapter, 0.99) * 1e3:.2f}",
                 f"{name}_native_median_ms={statistics.median(base) * 1e3:.2f}",
                 f"{name}_native_p99_ms={percentile(base, 0.99) * 1e3:.2f}", f"{name}_overhead_ms={over:.2f}"]
    print(" ".join(line))


if __name__ == "__main__":
    main()
