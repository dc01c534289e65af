"""OpenEnv environments as sleuth tasks: `task.name=openenv:http://HOST:PORT` or `openenv:MODULE`.

    sleuth train task.name=openenv:http://127.0.0.1:8000 rollout.engine=hf
    sleuth train task.name=openenv:my_env.server.app        # sleuth serves MODULE's `app` itself

A URL names a running server; a module (optionally "MODULE:ATTR", default attribute `app`, the
ASGI app OpenEnv's `create_app` returns) is served by sleuth with uvicorn on 127.0.0.1 in a
process of its own (one per module and sleuth process), stopped when sleuth exits. Either way the environment is reached with
OpenEnv's own client (`openenv.core.GenericEnvClient`, WebSocket at /ws, one environment instance
per session and so per episode).

An episode: `reset(seed=...)`, its observation's text as the first user message, then up to
task.episode.max_turns times: the model's reply through the episode's gateway client, `step({field: reply})`
(field: task.environment.args.action_field, default "message", plus the fixed fields of
task.environment.args.action), the next observation as the next user message, until the environment says
done. The episode's reward is the sum of its step rewards (a None reward counts 0); a non-numeric
or non-finite one, a server that closes the session or dies, or an episode past
task.episode.timeout_s scores 0 and is counted, like any failed episode. The observation's text is
its task.environment.args.observation_field, else its first string field.

Environments bring no dataset: problem i is a reset seed. Held-out problems are seeds
0..task.eval_size-1; training problem i uses seed 1e6 (task.seed + 1) + i, so they never overlap.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, UserError
from sleuth.records import Problem
from sleuth.tasks.base import Task

SUPPORTED_CORE = "0.3"
"""openenv-core releases this adapter is written against (pyproject.toml's `envs` extra)."""
STARTUP_TIMEOUT_S = 120.0
"""How long a server that sleuth starts (openenv:MODULE) may take to accept connections."""
TRAIN_SEED_BASE = 1_000_000


def import_openenv() -> Any:
    """OpenEnv's generic client class, or UserError naming what to install."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        core = version("openenv-core")
    except PackageNotFoundError:
        core = None
    if core is not None and not core.startswith(SUPPORTED_CORE + "."):
        raise UserError(f"task.name=openenv:...: openenv-core {core} is installed; sleuth supports "
                        f"{SUPPORTED_CORE}.x (pip install 'openenv-core=={SUPPORTED_CORE}.*')")
    try:
        from openenv.core import GenericEnvClient
    except ImportError:
        raise UserError("task.name=openenv:...: OpenEnv is not installed (pip install 'sleuth[envs]', or the "
                        "`openenv` distribution that provides openenv.core.GenericEnvClient)") from None
    return GenericEnvClient


def step_reward(value: Any) -> float:
    """A step's reward as a number (None: 0); ValueError for anything else."""
    if value is None:
        return 0.0
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"the environment returned a malformed reward {value!r} (a finite number or null)")
    return float(value)


def observation_text(observation: Any, field: str | None) -> str:
    """The text an observation shows the model."""
    if not isinstance(observation, dict):
        raise ValueError(f"the environment returned an observation that is not an object: {observation!r:.80}")
    if field is not None:
        if not isinstance(observation.get(field), str):
            raise ValueError(f"the observation has no text field '{field}' (task.environment.args.observation_field); "
                             f"fields: {', '.join(observation) or 'none'}")
        return observation[field]
    for value in observation.values():
        if isinstance(value, str):
            return value
    raise ValueError(f"the observation has no text field; fields: {', '.join(observation) or 'none'} "
                     "(name one with task.environment.args.observation_field)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """An OpenEnv server module served by uvicorn in a child process on 127.0.0.1."""

    def __init__(self, spec: str) -> None:
        module, _, attr = spec.partition(":")
        self.spec = f"{module}:{attr or 'app'}"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="sleuth-openenv-", suffix=".log")[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", self.spec, "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        atexit.register(self.stop)

    def wait(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until the server accepts connections; UserError with its last log line if it exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
                raise UserError(f"OpenEnv server {self.spec} exited (code {self.process.returncode}): "
                                f"{lines[-1] if lines else 'no output'}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.1)
        self.stop()
        raise UserError(f"OpenEnv server {self.spec} did not start within {timeout_s:g} s (log: {self.log})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_SERVERS: dict[str, LocalServer] = {}
"""Servers this process started, by module spec: a task built again (training builds its task per
curriculum level) reuses the running one instead of starting another."""


def local_server(spec: str) -> LocalServer:
    """The running server of `spec`, started (and waited for) if there is none."""
    server = _SERVERS.get(spec)
    if server is None or server.process.poll() is not None:
        server = LocalServer(spec)
        server.wait()
        _SERVERS[spec] = server
    return server


async def _check_reachable(client_cls: Any, url: str) -> None:
    client = client_cls(base_url=url, connect_timeout_s=10.0)
    try:
        await client.connect()
    finally:
        await client.close()


class OpenEnvTask(Task):
    """Episodes of an OpenEnv environment: reset(seed), then the model's replies as actions."""

    def __init__(self, cfg: TaskConfig) -> None:
        self.client_cls = import_openenv()
        self.cfg, self.name = cfg, cfg.name
        target = cfg.name.strip().partition(":")[2].strip()
        args = dict(cfg.environment.args)
        self.action_field = str(args.pop("action_field", "message"))
        self.observation_field = args.pop("observation_field", None)
        self.action = dict(args.pop("action", {}) or {})
        self.reset_args = dict(args.pop("reset", {}) or {})
        if args:
            raise ConfigError(f"task.environment.args: unknown key(s) for an OpenEnv task: {', '.join(sorted(args))} "
                              "(known: action_field, observation_field, action, reset)")
        self.server: LocalServer | None = None
        if target.startswith(("http://", "https://", "ws://", "wss://")):
            self.url = target.rstrip("/")
        else:
            self.server = local_server(target)
            self.url = self.server.url
        try:
            asyncio.run(_check_reachable(self.client_cls, self.url))
        except Exception as e:
            self.close()
            raise UserError(f"OpenEnv server at {self.url} is unreachable: {str(e).splitlines()[0] if str(e) else e}") \
                from None

    def close(self) -> None:
        """Stop the server sleuth started, if any."""
        if self.server is not None:
            self.server.stop()
            _SERVERS.pop(next((k for k, v in _SERVERS.items() if v is self.server), ""), None)

    @staticmethod
    def _problem(kind: str, seed: int) -> Problem:
        return Problem(f"{kind}-seed-{seed}", [{"role": "user", "content": f"(OpenEnv reset, seed {seed})"}], None,
                       {"seed": seed})

    def train_problem(self, index: int) -> Problem:
        return self._problem("train", TRAIN_SEED_BASE * (self.cfg.seed + 1) + index)

    def eval_problems(self) -> list[Problem]:
        return [self._problem("eval", j) for j in range(self.cfg.eval_size)]

    def score(self, problem: Problem, completion: str) -> float:
        raise ConfigError(f"{self.name} is an episode task: the environment scores its episodes")

    async def rollout(self, client: Any, problem: dict[str, Any]) -> dict[str, Any]:
        """One episode against a fresh environment session."""
        env = self.client_cls(base_url=self.url, connect_timeout_s=10.0, message_timeout_s=self.cfg.episode.timeout_s)
        try:
            result = await env.reset(seed=problem["seed"], **self.reset_args)
            messages = [{"role": "user", "content": observation_text(result.observation, self.observation_field)}]
            if self.cfg.system_prompt:
                messages.insert(0, {"role": "system", "content": self.cfg.system_prompt})
            total, steps = 0.0, 0
            while not result.done and steps < self.cfg.episode.max_turns:
                reply = await client.chat.completions.create(model="policy", messages=messages)
                text = reply.choices[0].message.content or ""
                result = await env.step({**self.action, self.action_field: text})
                total, steps = total + step_reward(result.reward), steps + 1
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": observation_text(result.observation, self.observation_field)}]
            return {"reward": total, "metrics": {"steps": float(steps), "done": float(bool(result.done))}}
        finally:
            with contextlib.suppress(Exception):
                await env.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an OpenEnv task runs in the process that built it")


def build(cfg: TaskConfig) -> Task:
    return OpenEnvTask(cfg)
