"""verifiers environments as sleuth tasks: `task.name=verifiers:ENV_ID`, the environment unchanged.

    sleuth train task.name=verifiers:my_env 'task.environment.args={num_tasks: 200}' rollout.engine=hf

ENV_ID is what `vf-eval ENV_ID` takes: a verifiers v1 taskset, an installed package or a module
importable from sys.path or the current directory, exporting its `vf.Taskset` subclass in
`__all__` (its `Env` too, when it brings one).
`task.environment.args` are the taskset config's fields; its keys `agent` (the seat: harness, runtime,
max_turns, ...), `timeout` and `retries` go to the env config instead. Unless task.environment.args pins them the
seat plays through the `null` harness (a chat loop over the task's tools) in the `subprocess`
runtime: verifiers' defaults are a bash agent in a hosted sandbox.

Each episode is the environment's own `Env.run_episode`: its harness program (a PEP 723 script
run by uv) calls verifiers' interception server, which relays every call, streaming, to the
episode's URL on sleuth's gateway with the key named by the client's `api_key_var`; the gateway
records the tokens exactly as sampled. The episode's reward is the environment's weighted reward
(the sum of score x weight over its named rewards; the mean over traces when an env plays several
agents); each named reward's score is logged as rollout/reward/<name>, and verifiers' own timing
of the episode as episode/model_s (the model's calls) and episode/harness_s (the harness program). An episode whose env, task
or harness failed (a raising reward, a dead program, a provider error) scores 0 and is counted.

The taskset's first task.eval_size tasks are the held-out problems; the rest are trained on, in
epoch-wise permutations seeded by task.seed.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, UserError, user_code_error
from sleuth.records import Message, Problem
from sleuth.tasks.base import Task
from sleuth.tasks.order import stream_index

SUPPORTED = "0.4"
"""verifiers releases this adapter is written against: 0.4.x (pyproject.toml's `envs` extra)."""
API_KEY_VAR = "SLEUTH_GATEWAY_API_KEY"
"""The environment variable the harness's client reads its API key from (the gateway takes any)."""
ENV_KEYS = ("agent", "timeout", "retries", "id", "max_concurrent_agents")
"""task.environment.args keys that configure the env rather than its taskset."""
DEFAULT_AGENT = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}


def import_verifiers() -> Any:
    """`verifiers.v1`, or UserError naming what to install."""
    try:
        import verifiers
    except ImportError:
        raise UserError("task.name=verifiers:...: the verifiers package is not installed "
                        "(pip install 'sleuth[envs]', or bash install.sh envs)") from None
    version = getattr(verifiers, "__version__", "")
    if not version.startswith(SUPPORTED + "."):
        raise UserError(f"task.name=verifiers:...: verifiers {version} is installed; sleuth supports "
                        f"{SUPPORTED}.x (pip install 'verifiers=={SUPPORTED}.*')")
    import verifiers.v1 as vf

    return vf


def env_config_data(env_id: str, env_args: dict[str, Any]) -> dict[str, Any]:
    """The raw verifiers env config for ENV_ID and task.environment.args."""
    taskset = {k: v for k, v in env_args.items() if k not in ENV_KEYS}
    data: dict[str, Any] = {k: v for k, v in env_args.items() if k in ENV_KEYS}
    agent = dict(data.get("agent") or {})
    for key, value in DEFAULT_AGENT.items():
        agent.setdefault(key, value)
    if "client" in agent:
        raise ConfigError("task.environment.args.agent.client: the policy's calls always go to sleuth's gateway")
    return {**data, "agent": agent, "taskset": {**taskset, "id": env_id}}


def task_messages(data: Any) -> list[Message]:
    """The chat messages of a verifiers TaskData (system prompt, then the prompt)."""
    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            text = m.content if isinstance(m.content, str) else data.prompt_text
            messages.append({"role": str(m.role), "content": text})
    return messages or [{"role": "user", "content": ""}]


class VerifiersTask(Task):
    """A verifiers environment's tasks as problems, its episodes as rollouts."""

    def __init__(self, cfg: TaskConfig) -> None:
        vf = import_verifiers()
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        self.cfg, self.name = cfg, cfg.name
        self.env_id = cfg.name.strip().partition(":")[2].strip()
        self._vf = vf
        if os.getcwd() not in sys.path:  # a module in the current directory, as for user tasks
            sys.path.append(os.getcwd())
        where = f"verifiers environment '{self.env_id}'"
        try:
            self.env = load_environment(resolve_env_config(env_config_data(self.env_id, cfg.environment.args)))
            self.tasks = list(self.env.taskset) if self.env.taskset.bounded else None
        except UserError:
            raise
        except Exception as e:  # the environment's own code, or a config it refuses
            raise user_code_error(e, f"{where} could not be loaded") from None
        if self.tasks is None:
            raise ConfigError(f"{where} is endless (Taskset.INFINITE); bound it in task.environment.args")
        if not self.tasks:
            raise ConfigError(f"{where} has no tasks")
        self._eval = self.tasks[: cfg.eval_size]
        self._train = self.tasks[cfg.eval_size:]
        if not self._train:
            self._train = self.tasks
            print(f"sleuth: {where} has only {len(self.tasks)} tasks: training on the held-out ones too",
                  file=sys.stderr)
        os.environ.setdefault(API_KEY_VAR, "sleuth")
        # The harness runs its program with uv: the one the `envs` extra installed next to this python.
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join(filter(None, [bindir, os.environ.get("PATH")]))

    def _problem(self, task: Any) -> Problem:
        data = task.data
        return Problem(str(data.id or f"{self.env_id}-{data.idx}"), task_messages(data), None, {"vf_index": data.idx})

    def train_problem(self, index: int) -> Problem:
        return self._problem(self._train[stream_index(len(self._train), self.cfg.seed, index)])

    def eval_problems(self) -> list[Problem]:
        return [self._problem(t) for t in self._eval]

    def score(self, problem: Problem, completion: str) -> float:
        raise ConfigError(f"{self.name} is an episode task: the environment scores its episodes")

    @contextlib.asynccontextmanager
    async def episode_session(self) -> AsyncIterator[None]:
        """The env's serving resources (interception server, shared tool servers) for a batch."""
        async with self.env.serving():
            yield

    async def rollout(self, client: Any, problem: dict[str, Any]) -> dict[str, Any]:
        """One episode of the environment, its model calls sent to `client`'s gateway episode."""
        ctx = self._vf.ModelContext(model="policy", client=self._vf.EvalClientConfig(
            base_url=str(client.base_url).rstrip("/"), api_key_var=API_KEY_VAR))
        episode = await self.env.run_episode(self.tasks[problem["vf_index"]], ctx)
        return episode_reward(episode)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a verifiers task runs in the process that built it")


def episode_reward(episode: Any) -> dict[str, Any]:
    """{"reward", "metrics"} of a finished verifiers Episode; RuntimeError (a counted, zero-scored
    episode) when it failed."""
    failed = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if failed or not episode.ok or not episode.traces:
        first = failed[0] if failed else None
        raise RuntimeError(f"{first.type}: {first.message}" if first else "the episode did not finish")
    metrics: dict[str, float] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is not None:
                metrics[f"reward/{name}"] = metrics.get(f"reward/{name}", 0.0) + reward.score / len(episode.traces)
        for name, value in trace.metrics.items():
            if value is not None:
                metrics[name] = metrics.get(name, 0.0) + value / len(episode.traces)
    # Where the episode's time went, by verifiers' own timing: the model's calls, the harness program.
    agents = [t.timing.agent for t in episode.traces if t.timing.agent is not None]
    metrics["model_s"] = sum(a.model.duration for a in agents)
    metrics["harness_s"] = sum(a.harness.duration for a in agents)
    reward = sum(t.reward for t in episode.traces) / len(episode.traces)
    return {"reward": reward, "metrics": metrics}


def build(cfg: TaskConfig) -> Task:
    return VerifiersTask(cfg)
