"""User tasks: your own problems and verifier, named in the config as "module:function".

    task:
      name: examples.my_task:problems        # or path/to/my_task.py:problems
      verifier: examples.my_task:verify      # optional: default is `verify` in the same module

`problems(cfg)` receives the TaskConfig and returns either

- an iterable of problem dicts: {"prompt": str} or {"messages": [chat messages]}, plus "answer"
  (anything your verifier understands), and optionally "id" and "split" ("train", the default,
  or "eval"), and "answer_pattern", a regular expression its answers match (for
  rollout.structured_output). Training visits the train problems in epoch-wise permutations seeded by
  cfg.seed; the held-out set is the first cfg.eval_size "eval" problems, or, when none is
  marked "eval", the first cfg.eval_size train problems (then it overlaps training: mark some);
- or a ready sleuth.tasks.base.Task instance, used as is.

An iterable is read whole at start-up up to 100,000 problems; one that yields more (an endless
generator, say) is then read lazily: the held-out set comes from what was read, and training takes
the train problems in the order given, reading more as it needs them. An exception in this code
(or a syntax error in the file) is reported in one line with the user's file and line.

The verifier is called as `verify(answer, completion_text) -> float` (True/False count as 1/0).
It runs under sleuth.rewards.verifier's time limit: one that raises, overruns, or returns anything but a
finite number within [-1e6, 1e6] (a string such as "1.0" included) scores 0 and is counted.
A module that is not importable from sys.path is also looked up in the current directory, and
"path/file.py:function" loads a file directly.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, DataError, UserError, user_code_error
from sleuth.plugins import import_module, load_object
from sleuth.records import Message, Problem
from sleuth.tasks.base import Task
from sleuth.tasks.environments import environment_prefix
from sleuth.tasks.order import stream_index

RolloutFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]
"""An episode function: `async def rollout(client, problem) -> float | {"reward": r, "metrics": {...}}`."""

Verifier = Callable[[Any, str], float]
LAZY_AFTER = 100_000
"""problems() is read whole up to this many problems; beyond it, lazily (it may never end)."""


def user_module(task_spec: str) -> Any:
    """The module of a user task "module:function"."""
    return import_module(task_spec.rpartition(":")[0], "user task")


def _default_verifier_spec(task_spec: str) -> str:
    return task_spec.rpartition(":")[0] + ":verify"


def _to_problem(item: Any, index: int, system_prompt: str | None, source: str) -> tuple[str, Problem]:
    where = f"user task {source} problem {index}"
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a dict with prompt/messages and answer, got {type(item).__name__}")
    if "answer" not in item:
        raise DataError(f"{where}: has no 'answer'")
    messages: list[Message]
    if isinstance(item.get("messages"), list):
        messages = list(item["messages"])
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} dicts")
    elif isinstance(item.get("prompt"), str):
        messages = [{"role": "user", "content": item["prompt"]}]
    else:
        raise DataError(f"{where}: needs a string 'prompt' or a 'messages' list")
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    split = item.get("split", "train")
    if split not in ("train", "eval"):
        raise DataError(f"{where}: 'split' must be 'train' or 'eval', got {split!r}")
    if not isinstance(item.get("answer_pattern", ""), str):
        raise DataError(f"{where}: 'answer_pattern' must be a string (a regular expression)")
    metadata = {k: v for k, v in item.items() if k not in ("id", "prompt", "messages", "answer", "split")}
    return split, Problem(str(item.get("id", f"{split}-{index}")), messages, item["answer"], metadata)


class UserTask(Task):
    """Problems from a user function, scored by a user verifier."""

    def __init__(self, cfg: TaskConfig, items: Iterable[Any], verifier_spec: str | None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.verifier_spec = verifier_spec
        self._verifier: Verifier | None = None
        self._train: list[Problem] = []
        held_out: list[Problem] = []
        self._items = iter(items)
        self._read = 0
        self.lazy = False
        """True when problems() yielded more than LAZY_AFTER problems (an endless generator, say):
        train problems are then taken in the order given, read as needed, never all at once."""
        started = time.monotonic()
        while self._read < LAZY_AFTER:
            item = self._next_item()
            if item is None:
                break
            (held_out if item[0] == "eval" else self._train).append(item[1])
            if self._read % 10_000 == 0 and time.monotonic() - started > 2:
                print(f"sleuth: reading problems from {cfg.name}: {self._read}", file=sys.stderr)
        else:
            self.lazy = True
            print(f"sleuth: {cfg.name} yields more than {LAZY_AFTER} problems; taking them as needed, "
                  "in the order given", file=sys.stderr)
        if not self._train and not held_out:
            raise DataError(f"user task {cfg.name} returned no problems")
        self._eval = (held_out or self._train)[: cfg.eval_size]
        if verifier_spec is not None:
            self.verifier  # noqa: B018 -- resolve now, so a bad verifier fails at start-up

    def _next_item(self) -> tuple[str, Problem] | None:
        """The next (split, problem) from the user's iterable, or None when it is exhausted."""
        try:
            item = next(self._items)
        except StopIteration:
            return None
        except Exception as e:
            raise user_code_error(e, f"user task {self.cfg.name} failed while yielding problem {self._read}") \
                from None
        self._read += 1
        return _to_problem(item, self._read - 1, self.cfg.system_prompt, self.cfg.name)

    @property
    def verifier(self) -> Verifier:
        if self._verifier is None:
            if self.verifier_spec is None:
                raise ConfigError(f"user task {self.cfg.name} is an episode task: its rollout scores it")
            try:
                fn = load_object(self.verifier_spec)
            except UserError:
                raise
            except Exception as e:
                raise user_code_error(e, f"cannot import verifier '{self.verifier_spec}'") from None
            if not callable(fn):
                raise ConfigError(f"verifier '{self.verifier_spec}' is not a function")
            self._verifier = fn
        return self._verifier

    def train_problem(self, index: int) -> Problem:
        if self.lazy:
            while len(self._train) <= index:
                item = self._next_item()
                if item is None:
                    raise DataError(f"user task {self.cfg.name} ran out of problems at {index}")
                if item[0] == "train":
                    self._train.append(item[1])
            return self._train[index]
        if not self._train:
            raise DataError(f"user task {self.cfg.name} has only 'eval' problems, none to train on")
        return self._train[stream_index(len(self._train), self.cfg.seed, index)]

    def eval_problems(self) -> list[Problem]:
        return list(self._eval)

    def answer_pattern(self, problem: Problem) -> str | None:
        """The problem dict's "answer_pattern", if it gave one."""
        return problem.metadata.get("answer_pattern")

    def score(self, problem: Problem, completion: str) -> float:
        # The value as returned: sleuth.rewards.verifier checks it (a string such as "1.0" is an error,
        # not a reward), so no float() here that would accept it.
        return self.verifier(problem.answer, completion)

    def __getstate__(self) -> dict[str, Any]:
        # Verifier workers re-import the verifier by name: functions from a file path or a
        # module that only the parent imported would not unpickle there by reference.
        state = self.__dict__.copy()
        state["_verifier"] = None
        state["_items"] = iter(())  # a generator cannot be pickled; workers only score
        return state


def build(cfg: TaskConfig) -> Task:
    """A task from cfg.name = "module:function" (see the module docstring)."""
    try:
        factory = load_object(cfg.name)
    except UserError:
        raise
    except Exception as e:  # the module's own code failed (a syntax error, an exception at import)
        raise user_code_error(e, f"cannot import user task '{cfg.name}'") from None
    if not callable(factory):
        raise ConfigError(f"user task '{cfg.name}' is not a function")
    try:
        result = factory(cfg)
    except Exception as e:
        raise user_code_error(e, f"user task '{cfg.name}' raised") from None
    if isinstance(result, Task):
        return result
    if isinstance(result, dict | str | bytes) or not isinstance(result, Iterable):
        raise ConfigError(f"user task '{cfg.name}' must return a Task or an iterable of problem dicts")
    verifier_spec: str | None = cfg.verifier or _default_verifier_spec(cfg.name)
    module = user_module(cfg.name)
    if cfg.verifier is None and not hasattr(module, "verify") and (cfg.episode.rollout or hasattr(module, "rollout")):
        verifier_spec = None  # an episode task: its rollout returns the reward
    elif cfg.verifier is None and not hasattr(module, "verify"):
        raise ConfigError(
            f"user task '{cfg.name}' needs a verifier: define verify(answer, text) in its module "
            "or set task.verifier=module:function"
        )
    return UserTask(cfg, result, verifier_spec)


def find_rollout(cfg: TaskConfig, task: Task) -> RolloutFn | None:
    """The task's episode function, or None for a single-turn task."""
    if cfg.episode.rollout:
        fn, where = load_object(cfg.episode.rollout), cfg.episode.rollout
    elif ":" in cfg.name and environment_prefix(cfg.name) is None and hasattr(user_module(cfg.name), "rollout"):
        fn, where = user_module(cfg.name).rollout, f"{cfg.name.rpartition(':')[0]}:rollout"
    elif task.rollout is not None:
        return task.rollout
    else:
        return None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"episode function '{where}' must be `async def rollout(client, problem)`")
    return fn  # type: ignore[no-any-return]
