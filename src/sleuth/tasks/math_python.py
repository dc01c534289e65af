"""Math with a Python tool: an episode task on the math task's problems and verifier.

    sleuth train task.name=math_python task.train_path=aime2024.jsonl task.episode.max_turns=4

The model may call `python` (OpenAI tool format; the chat template renders the tool and the model
answers in its tool-call format, see sleuth.gateway.tools) any number of times within
task.episode.max_turns calls; each call's code runs in a fresh sandbox (sleuth.tasks.sandbox) and its output
(or traceback) comes back as the tool message. The first reply without a tool call is the answer,
scored like `math` (last \\boxed{} or Answer: line). Code that hits a sandbox limit or does
something forbidden (timeout, memory, output, network, filesystem, process, killed) ends the
episode with reward 0; every episode reports how many of its runs ended for each reason
(episode/sandbox_<reason> in the metrics).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sleuth.config import TaskConfig
from sleuth.records import Problem
from sleuth.tasks.math import MathTask
from sleuth.tasks.sandbox import REASONS, SandboxLimits, check_isolation, run_python

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 script in a sandbox (no network, no files outside its own folder, "
                       "10 s of CPU) and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "the script"}},
                       "required": ["code"]},
    },
}
ENDING = tuple(r for r in REASONS if r not in ("ok", "error"))
"""Sandbox reasons that end an episode with reward 0."""


class MathPythonTask(MathTask):
    name = "math_python"

    def __init__(self, cfg: TaskConfig, limits: SandboxLimits | None = None) -> None:
        super().__init__(cfg)
        self.limits = limits or SandboxLimits(isolation=cfg.sandbox.isolation)

    async def rollout(self, client: Any, problem: dict[str, Any]) -> dict[str, Any]:
        """One episode: tool calls until a plain answer, max_turns calls or a sandbox violation."""
        messages = list(problem["messages"])
        counts = {f"sandbox_{r}": 0.0 for r in REASONS}
        for _ in range(self.cfg.episode.max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON_TOOL])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                reward = await asyncio.to_thread(self.score, Problem(problem["id"], [], problem["answer"]),
                                                 message.content or "")
                return {"reward": reward, "metrics": counts}
            for call in message.tool_calls:
                result = await asyncio.to_thread(run_python, _code_of(call.function), self.limits)
                counts[f"sandbox_{result.reason}"] += 1
                if result.reason in ENDING:
                    return {"reward": 0.0, "metrics": counts}
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output()})
        return {"reward": 0.0, "metrics": counts}


def _code_of(function: Any) -> str:
    """The `code` argument of a python call (a bare string argument counts as the code)."""
    try:
        args = json.loads(function.arguments)
    except json.JSONDecodeError:
        return str(function.arguments)
    return str(args.get("code", "")) if isinstance(args, dict) else str(args)


def build(cfg: TaskConfig) -> MathPythonTask:
    check_isolation(cfg.sandbox.isolation)  # refuses (strict) or warns once, before any episode
    return MathPythonTask(cfg)
