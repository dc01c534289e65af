"""Episode tasks: the user's own agent code, run against sleuth's gateway, is the rollout.

    async def rollout(client, problem) -> float:      # or {"reward": r, "metrics": {"turns": 3}}
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...

The function is `task.episode.rollout=module:function`, else `rollout` in a user task's module (task.name
"module:problems"), else the built-in task's own (math_python). `client` is an
`openai.AsyncOpenAI` bound to one episode of the gateway; `problem` is a dict: id, prompt (the
last user message), messages, answer and the problem's metadata.

`samples_per_task` episodes of a problem form a group. An episode that raises (sys.exit and a stray
asyncio.CancelledError included), returns no finite reward within +-1e6 (records.MAX_ABS_REWARD), or runs past
task.episode.timeout_s scores 0, is counted (rollout/episode_errors, rollout/episode_timeouts) and
never stops the run; synchronous code that holds the event loop past the limit is stopped by the
watchdog (gateway/watchdog.py). (While one episode holds the loop no other advances: episodes
starved that long may time out too.)
task.episode.max_turns and task.episode.max_tokens bound its calls (the gateway refuses a call past them
with a 400, which the episode may handle or raise). A problem whose episodes all ended before their
first model call has no sequence to train on: it scores 0, counts, and its group is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import httpx

from sleuth.gateway.app import Gateway, GatewayServer
from sleuth.gateway.trajectories import EpisodeOutcome, episode_group
from sleuth.gateway.watchdog import EpisodeOverrun, LoopWatchdog
from sleuth.records import MAX_ABS_REWARD, Group, Problem, SamplingParams
from sleuth.rollout.base import RolloutEngine
from sleuth.task_config import EpisodeConfig
from sleuth.tasks.user import RolloutFn

_T = TypeVar("_T")


class EpisodeFailed(Exception):
    """What the episode's code did that ends it with status "error" (a BaseException turned into one)."""


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
                         f"got {str(value)[:100]}")
    if not -MAX_ABS_REWARD <= value <= MAX_ABS_REWARD:  # as for a verifier's (rewards/verifier.py)
        raise ValueError(f"an episode's reward must lie within [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}], "
                         f"got {value:g}")
    if not isinstance(metrics, dict):
        raise ValueError("an episode's 'metrics' must be a dict of numbers")
    return float(value), {str(k): float(v) for k, v in metrics.items()
                          if isinstance(v, int | float) and math.isfinite(v) and abs(v) <= MAX_ABS_REWARD}


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

    def __init__(self, rollout: RolloutFn, engine: RolloutEngine, tokenizer: Any, cfg: EpisodeConfig,
                 sampling: SamplingParams) -> None:
        self.rollout = rollout
        self.cfg = cfg
        self.sampling = sampling
        self.gateway = Gateway(engine, tokenizer, sampling)
        self.server = GatewayServer(self.gateway)  # serves on the episodes' own loop (session())
        self.watchdog = LoopWatchdog()
        self._shared: tuple[asyncio.AbstractEventLoop, SharedHTTP, asyncio.Future[None]] | None = None
        """open_shared(): the loop (on its own thread) holding one session, its HTTP pool, its stop."""
        self._shared_thread: threading.Thread | None = None

    def open_shared(self) -> None:
        """loop.streaming: one session (the gateway served, one HTTP pool) held open on an event loop
        of its own thread until close_shared(); run() from any thread then runs its episodes there,
        concurrently with the others' (each run() would otherwise serve the gateway on a loop of its
        own, and two at once would share one server's port)."""
        if self._shared is not None:
            return
        ready, failed = threading.Event(), []

        async def hold() -> None:
            async with self.session() as http:
                loop = asyncio.get_running_loop()
                self._shared = (loop, http, loop.create_future())
                ready.set()
                await self._shared[2]

        def main() -> None:
            try:
                run_loop(hold())
            except BaseException as e:  # open_shared raises it
                failed.append(e)
            finally:
                ready.set()

        self._shared_thread = threading.Thread(target=main, name="sleuth-episodes", daemon=True)
        self._shared_thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def close_shared(self) -> None:
        """End open_shared()'s session once the episodes under way are done (the caller waited for them)."""
        shared, self._shared = self._shared, None
        if shared is None or self._shared_thread is None:
            return
        loop, _, stop = shared
        loop.call_soon_threadsafe(lambda: stop.done() or stop.set_result(None))
        self._shared_thread.join()

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[SharedHTTP]:
        """The gateway served on the running event loop, and one HTTP pool for a batch of episodes.

        The episodes' calls and the server's answers share the loop: no thread hand-off per call,
        and no GIL contention between a client thread and a server thread (measured in
        docs/benchmarks.md, "agent")."""
        # An environment adapter (verifiers) holds its own serving resources for the batch.
        owner_session = getattr(getattr(self.rollout, "__self__", None), "episode_session", None)
        async with self.watchdog.watching(), self.server.serving(), SharedHTTP.open() as http, \
                (owner_session() if owner_session is not None else contextlib.nullcontext()):
            yield http

    @property
    def token_budget(self) -> int:
        return self.cfg.max_tokens or self.cfg.max_turns * self.sampling.max_tokens

    async def episode(self, problem: Problem, seed: int | None, sampling: SamplingParams | None = None,
                      http: Any = None) -> EpisodeOutcome:
        """One episode; never raises for what the episode function does. Runs inside session(),
        whose SharedHTTP is `http` (one per batch of episodes: each client's own costs ~0.25 s)."""
        import openai

        ep = self.gateway.store.open(replace(sampling or self.sampling, seed=seed), self.cfg.max_turns,
                                     self.token_budget)
        client = openai.AsyncOpenAI(base_url=self.server.url(ep.id), api_key="sleuth", max_retries=0,
                                    timeout=self.cfg.timeout_s, http_client=http)
        limit = self.cfg.timeout_s
        try:
            value = await asyncio.wait_for(self._contained(client, problem), limit)
            reward, metrics = _reward_of(value)
            return EpisodeOutcome(ep, reward, metrics=metrics)
        except TimeoutError:
            return EpisodeOutcome(ep, 0.0, "timeout", f"ran past {limit:g} s")
        except Exception as e:  # the user's code: scored 0 and counted, never the end of the run
            return EpisodeOutcome(ep, 0.0, "error", f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            self.gateway.store.close(ep.id)
            await client.close()

    async def _contained(self, client: Any, problem: Problem) -> Any:
        """The episode function's result. What would end more than the episode becomes an ordinary
        exception here, inside the task that runs it: sys.exit() (asyncio re-raises SystemExit out of
        the event loop), a CancelledError that no cancellation asked for, and the watchdog's stop."""
        with self.watchdog.episode(self.cfg.timeout_s):
            try:
                return await self.rollout(client, problem_payload(problem))
            except EpisodeOverrun:
                self.watchdog.delivered()
                raise TimeoutError from None
            except SystemExit as e:
                raise EpisodeFailed(f"the episode called sys.exit({e.code!r})") from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # a real cancellation: the timeout, or the run
                    raise
                raise EpisodeFailed("the episode raised asyncio.CancelledError") from None

    def run(self, problems: Sequence[Problem], n: int, seed: int,
            on_group: Callable[[], None] | None = None) -> tuple[list[Group], list[list[EpisodeOutcome]]]:
        """n episodes per problem, all concurrently; episode (j, k) is seeded seed + 4096 j + k."""

        async def one_problem(j: int, p: Problem, http: SharedHTTP) -> list[EpisodeOutcome]:
            out = await asyncio.gather(*(self.episode(p, seed + 4096 * j + k, http=http) for k in range(n)))
            if on_group is not None:
                on_group()
            return list(out)

        async def gathered(http: SharedHTTP) -> list[list[EpisodeOutcome]]:
            return list(await asyncio.gather(*(one_problem(j, p, http) for j, p in enumerate(problems))))

        async def everything() -> list[list[EpisodeOutcome]]:
            async with self.session() as http:
                return await gathered(http)

        shared = self._shared
        if shared is not None:  # loop.streaming: on the session held open (open_shared)
            outcomes = asyncio.run_coroutine_threadsafe(gathered(shared[1]), shared[0]).result()
        else:
            outcomes = run_loop(everything())
        failed = [o for per in outcomes for o in per if o.status != "ok"]
        if failed:  # scored 0 and counted; the first reason shown so a broken agent is noticed
            print(f"sleuth: {len(failed)} of {sum(map(len, outcomes))} episodes failed (scored 0); first: "
                  f"{failed[0].status}: {failed[0].error}", file=sys.stderr)
        return [episode_group(p, o) for p, o in zip(problems, outcomes, strict=True)], outcomes
