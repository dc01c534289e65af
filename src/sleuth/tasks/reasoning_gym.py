"""Every reasoning-gym dataset as a sleuth task: `task.name=reasoning_gym task.reasoning_gym.dataset=knights_knaves`.

reasoning-gym (an optional extra: `pip install sleuth[reasoning-gym]`) generates problems
procedurally and ships a scorer per dataset. This adapter uses both as they are:

- problems: `reasoning_gym.create_dataset(name, seed=..., size=CHUNK, **task.reasoning_gym.dataset_args)`.
  Training problem i is item i % CHUNK of chunk i // CHUNK, whose seed is derived from
  (dataset, task.seed, chunk), so the stream is endless and a pure function of i. The held-out
  set is the first task.eval_size items of a dataset with its own fixed seed (independent of
  task.seed, so runs with different seeds evaluate on the same problems), and training skips any
  problem whose question is in it.
- prompt: the dataset's question, followed by an instruction to put the final answer between
  <answer> and </answer> (task.system_prompt, when set, goes first as a system message).
- reward: the dataset's own `score_answer(answer, entry)` on the text inside the last
  <answer>...</answer> of the completion, clipped to [0, 1]; no tags scores 0.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, UserError
from sleuth.plugins import did_you_mean
from sleuth.records import Message, Problem
from sleuth.system.seeds import derive_seed
from sleuth.tasks.base import Task

CHUNK = 1000
"""Problems per generated chunk of the training stream (some datasets refuse indices >= size)."""
EVAL_SEED_TAG = "sleuth-eval"
INSTRUCTION = ("Think it through, then give only your final answer between <answer> and </answer>, "
               "in the format the question asks for.")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MAX_SKIPS = 16
"""Re-draws of a training problem that collides with the held-out set before accepting it
(tiny problem spaces could otherwise loop forever)."""


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "task 'reasoning_gym' needs the reasoning-gym package: pip install 'sleuth[reasoning-gym]' "
            "(or bash install.sh)"
        ) from None
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def extract_answer(completion: str) -> str | None:
    """The stripped text inside the last <answer>...</answer>, or None."""
    matches = _ANSWER.findall(completion)
    return matches[-1].strip() if matches else None


class ReasoningGymTask(Task):
    name = "reasoning_gym"

    def __init__(self, cfg: TaskConfig) -> None:
        _import_reasoning_gym()
        names = dataset_names()
        dataset = (cfg.reasoning_gym.dataset or "").strip()
        if not dataset:
            raise ConfigError("task 'reasoning_gym' needs task.reasoning_gym.dataset, e.g. task.reasoning_gym.dataset=knights_knaves")
        if dataset not in names:
            hint = did_you_mean(dataset, names, n=1, cutoff=0.0)
            raise ConfigError(f"unknown reasoning-gym dataset task.reasoning_gym.dataset='{dataset}'{hint}")
        for key in ("train_path", "eval_path"):
            if getattr(cfg, key):
                raise ConfigError(f"task.{key} is not used by reasoning_gym (it generates problems); unset it")
        self.cfg = cfg
        self.dataset = dataset
        self.name = f"reasoning_gym/{dataset}"
        # Validate dataset_args now, so a typo fails at start-up rather than at the first problem.
        self._eval_ds = self._create(derive_seed(EVAL_SEED_TAG, dataset), max(cfg.eval_size, 1))
        self._eval_entries = [self._eval_ds[i] for i in range(cfg.eval_size)]
        self._eval_questions = {e["question"] for e in self._eval_entries}

    def _create(self, seed: int, size: int) -> Any:
        try:
            # The module is not kept on self: the task is pickled into verifier worker processes.
            return _import_reasoning_gym().create_dataset(self.dataset, seed=seed, size=size, **self.cfg.reasoning_gym.dataset_args)
        except TypeError as e:
            # An unknown keyword names itself in the message: "... got an unexpected keyword argument 'x'".
            raise ConfigError(f"task.reasoning_gym.dataset_args for reasoning-gym dataset '{self.dataset}': {e}") from None
        except (AssertionError, ValueError) as e:
            raise ConfigError(
                f"task.reasoning_gym.dataset_args for reasoning-gym dataset '{self.dataset}' are invalid: {e or 'rejected'}"
            ) from None

    @lru_cache(maxsize=4)  # noqa: B019 - a few chunks per task object, which lives for the whole run
    def _chunk(self, chunk: int, attempt: int) -> Any:
        return self._create(derive_seed("train", self.dataset, self.cfg.seed, chunk, attempt), CHUNK)

    def _problem(self, entry: dict[str, Any], pid: str, split: str, index: int) -> Problem:
        messages: list[Message] = []
        if self.cfg.system_prompt:
            messages.append({"role": "system", "content": self.cfg.system_prompt})
        messages.append({"role": "user", "content": f"{entry['question']}\n\n{INSTRUCTION}"})
        meta = {"dataset": self.dataset, "split": split, "index": index, "entry": entry}
        return Problem(pid, messages, entry["answer"], meta)

    def train_problem(self, index: int) -> Problem:
        if index < 0:
            raise ValueError(f"training index must be >= 0, got {index}")
        chunk, position = divmod(index, CHUNK)
        for attempt in range(_MAX_SKIPS):
            entry = self._chunk(chunk, attempt)[position]
            if entry["question"] not in self._eval_questions:
                break
        return self._problem(entry, f"{self.dataset}/train/{index}", "train", index)

    def eval_problems(self) -> list[Problem]:
        return [self._problem(e, f"{self.dataset}/eval/{i}", "eval", i) for i, e in enumerate(self._eval_entries)]

    def _entry(self, problem: Problem) -> dict[str, Any]:
        entry = problem.metadata.get("entry")
        if isinstance(entry, dict):
            return entry
        # A problem rebuilt from an id alone (metadata not kept): regenerate it; ids are positions.
        split, index = problem.metadata.get("split"), problem.metadata.get("index")
        if split == "eval" and isinstance(index, int):
            return self._eval_entries[index]
        if split == "train" and isinstance(index, int):
            return self.train_problem(index).metadata["entry"]
        raise ValueError(f"problem {problem.id} carries no reasoning-gym entry to score against")

    def score(self, problem: Problem, completion: str) -> float:
        answer = extract_answer(completion)
        if answer is None:
            return 0.0
        reward = float(self._eval_ds.score_answer(answer, entry=self._entry(problem)))
        return min(1.0, max(0.0, reward))

    def answer_key(self, problem: Problem, completion: str) -> str | None:
        """What majority voting compares: the extracted answer."""
        return extract_answer(completion)


def build(cfg: TaskConfig) -> ReasoningGymTask:
    return ReasoningGymTask(cfg)
