"""Episode tasks: the user's own agent code, run against sleuth's gateway, is the rollout.

    async def rollout(client, problem) -> float:      # or {"reward": r, "metrics": {"turns": 3}}
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...

The function is `task.rollout=module:function`, else `rollout` in a user task's module (task.name
"module:problems"), else the built-in task's own (math_python). `client` is an
`openai.AsyncOpenAI` bound to one episode of the gateway; `problem` is a dict: id, prompt (the
last user message), messages, answer and the problem's metadata.

`samples_per_task` episodes of a problem form a group. An episode that raises or runs past
task.episode_timeout_s scores 0, is counted (rollout/episode_errors, rollout/episode_timeouts) and
never stops the run; task.max_turns and task.episode_max_tokens bound its calls (the gateway
refuses a call past them with a 400, which the episode may handle or raise).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import httpx

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError
from sleuth.gateway.app import Gateway, GatewayServer
from sleuth.gateway.trajectories import EpisodeOutcome, episode_group
from sleuth.metrics import prefixed
from sleuth.records import Group, Problem, SamplingParams
from sleuth.rollout.base import RolloutEngine
from sleuth.scoring import mean_se
from sleuth.tasks.base import Task

RolloutFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]
_T = TypeVar("_T")


def find_rollout(cfg: TaskConfig, task: Task) -> RolloutFn | None:
    """The task's episode function, or None for a single-turn task."""
    from sleuth.tasks.user import load_object, user_module

    if cfg.rollout:
        fn, where = load_object(cfg.rollout), cfg.rollout
    elif ":" in cfg.name and hasattr(user_module(cfg.name), "rollout"):
        fn, where = user_module(cfg.name).rollout, f"{cfg.name.rpartition(':')[0]}:rollout"
    elif callable(getattr(task, "rollout", None)):
        return task.rollout  # type: ignore[attr-defined,no-any-return]
    else:
        return None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"episode function '{where}' must be `async def rollout(client, problem)`")
    return fn  # type: ignore[no-any-return]


def problem_payload(problem: Problem) -> dict[str, Any]:
    """What an episode function receives (a plain dict it may not change for other episodes)."""
    users = [m["content"] for m in problem.messages if m.get("role") == "user"]
    return {"id": problem.id, "prompt": users[-1] if users else "", "messages": [dict(m) for m in problem.messages],
            "answer": problem.answer, **problem.metadata}


def _reward_of(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from what an episode returned; ValueError naming what is wrong."""
    metrics: dict[str, Any] = {}
    if isinstance(value, dict):
        metrics = value.get("metrics") or {}
        value = value.get("reward")
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"an episode must return a finite number or {{'reward': r, 'metrics': {{...}}}}, "
                         f"got {value!r}")
    if not isinstance(metrics, dict):
        raise ValueError("an episode's 'metrics' must be a dict of numbers")
    return float(value), {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}


def run_loop(main: Awaitable[_T]) -> _T:
    """Run a batch of episodes (and the gateway serving them, EpisodeRunner.session) to completion
    on a fresh event loop: uvloop where installed (its sockets and callbacks cost less per gateway
    call; docs/benchmarks.md, "agent"), else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)  # type: ignore[arg-type]
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)  # type: ignore[arg-type]


class SharedHTTP(httpx.AsyncClient):
    """One HTTP connection pool for a batch of episodes' clients; a client's close() leaves it open."""

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls) -> AsyncIterator[SharedHTTP]:
        http = cls(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256), verify=False)
        try:
            yield http
        finally:
            await httpx.AsyncClient.aclose(http)

    async def aclose(self) -> None:
        """Kept open for the other episodes (closed by `open`'s exit)."""


class EpisodeRunner:
    """Runs episodes of a task through a gateway on the rollout engine (served on 127.0.0.1 by session())."""

    def __init__(self, rollout: RolloutFn, engine: RolloutEngine, tokenizer: Any, cfg: TaskConfig,
                 sampling: SamplingParams) -> None:
        self.rollout = rollout
        self.cfg = cfg
        self.sampling = sampling
        self.gateway = Gateway(engine, tokenizer, sampling)
        self.server = GatewayServer(self.gateway)  # serves on the episodes' own loop (session())

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[SharedHTTP]:
        """The gateway served on the running event loop, and one HTTP pool for a batch of episodes.

        The episodes' calls and the server's answers share the loop: no thread hand-off per call,
        and no GIL contention between a client thread and a server thread (measured in
        docs/benchmarks.md, "agent")."""
        async with self.server.serving(), SharedHTTP.open() as http:
            yield http

    @property
    def token_budget(self) -> int:
        return self.cfg.episode_max_tokens or self.cfg.max_turns * self.sampling.max_tokens

    async def episode(self, problem: Problem, seed: int | None, sampling: SamplingParams | None = None,
                      http: Any = None) -> EpisodeOutcome:
        """One episode; never raises for what the episode function does. Runs inside session(),
        whose SharedHTTP is `http` (one per batch of episodes: each client's own costs ~0.25 s)."""
        import openai

        ep = self.gateway.store.open(replace(sampling or self.sampling, seed=seed), self.cfg.max_turns,
                                     self.token_budget)
        client = openai.AsyncOpenAI(base_url=self.server.url(ep.id), api_key="sleuth", max_retries=0,
                                    timeout=self.cfg.episode_timeout_s, http_client=http)
        try:
            value = await asyncio.wait_for(self.rollout(client, problem_payload(problem)), self.cfg.episode_timeout_s)
            reward, metrics = _reward_of(value)
            return EpisodeOutcome(ep, reward, metrics=metrics)
        except TimeoutError:
            return EpisodeOutcome(ep, 0.0, "timeout", f"ran past {self.cfg.episode_timeout_s:g} s")
        except Exception as e:  # the user's code: scored 0 and counted, never the end of the run
            return EpisodeOutcome(ep, 0.0, "error", f"{type(e).__name__}: {e}")
        finally:
            self.gateway.store.close(ep.id)
            await client.close()

    def run(self, problems: Sequence[Problem], n: int, seed: int,
            on_group: Callable[[], None] | None = None) -> tuple[list[Group], list[list[EpisodeOutcome]]]:
        """n episodes per problem, all concurrently; episode (j, k) is seeded seed + 4096 j + k."""

        async def one_problem(j: int, p: Problem, http: SharedHTTP) -> list[EpisodeOutcome]:
            out = await asyncio.gather(*(self.episode(p, seed + 4096 * j + k, http=http) for k in range(n)))
            if on_group is not None:
                on_group()
            return list(out)

        async def everything() -> list[list[EpisodeOutcome]]:
            async with self.session() as http:
                return list(await asyncio.gather(*(one_problem(j, p, http) for j, p in enumerate(problems))))

        outcomes = run_loop(everything())
        failed = [o for per in outcomes for o in per if o.status != "ok"]
        if failed:  # scored 0 and counted; the first reason shown so a broken agent is noticed
            print(f"sleuth: {len(failed)} of {sum(map(len, outcomes))} episodes failed (scored 0); first: "
                  f"{failed[0].status}: {failed[0].error}", file=sys.stderr)
        return [episode_group(p, o) for p, o in zip(problems, outcomes, strict=True)], outcomes


def episode_metrics(outcomes: Sequence[Sequence[EpisodeOutcome]], groups: Sequence[Group]) -> dict[str, float]:
    """rollout/* over episodes (not sequences), failures counted; the user's metrics averaged as
    episode/*."""
    flat = [o for per in outcomes for o in per]
    n = max(len(flat), 1)
    seqs = [c for g in groups for c in g.completions]
    sampled = [sum(c.loss_mask or [1] * len(c.completion_ids)) for c in seqs]
    rewards = [o.reward for o in flat]
    out = prefixed("rollout", {
        "reward_mean": mean_se(rewards)[0], "reward_se": mean_se(rewards)[1],
        "reward_max": max(rewards, default=0.0),
        "episodes": float(len(flat)),
        "episode_errors": float(sum(o.status == "error" for o in flat)),
        "episode_timeouts": float(sum(o.status == "timeout" for o in flat)),
        "episode_calls_mean": sum(o.episode.calls for o in flat) / n,
        "sequences_per_episode": len(seqs) / n,
        "template_mismatches": float(sum(o.episode.counts["template_mismatch"] for o in flat)),
        "bad_tool_calls": float(sum(o.episode.counts["bad_tool_calls"] for o in flat)),
        "completion_tokens_mean": sum(sampled) / max(len(seqs), 1),
        "tokens": float(sum(sampled)),
        "truncated_frac": sum(c.finish_reason == "length" for c in seqs) / max(len(seqs), 1),
    })
    keys = sorted({k for o in flat for k in o.metrics})
    for k in keys:
        values = [o.metrics[k] for o in flat if k in o.metrics]
        out[f"episode/{k}"] = sum(values) / len(values)
    return out
