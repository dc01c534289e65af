"""The Temporal Clue task: puzzles as problems, the grader as verifier.

Training problems come either from the generator, one puzzle per index with its own derived seed
(an endless stream), or from a data file (cfg.train_path, published JSON or our JSONL) visited in
epoch-wise permutations seeded by cfg.seed. Held-out problems are the first cfg.eval_size puzzles
of cfg.eval_path, or a fixed generated set.

Generated seeds: training index i uses 2 * derive_seed(cfg.seed, i) (even), held-out puzzle j uses
2 * j + 1 (odd), so the two never share a puzzle, and the held-out set is the same whatever the
training seed (runs with different seeds are compared on the same puzzles).

The message list is the puzzle prompt as one user message (after cfg.system_prompt when set); the
prompt itself ends with the answer format. With cfg.list_choices every question line ends with
` (choose from: X, Y, Z)`, which gives a small model a learnable start.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import DataError
from sleuth.records import AnswerPart, Message, Problem
from sleuth.seeds import derive_seed
from sleuth.structured import one_of, regex_literal
from sleuth.tasks.base import Task
from sleuth.tasks.order import stream_index
from sleuth.tasks.temporal_clue.dataset import add_choices, load_puzzles, parse_choices
from sleuth.tasks.temporal_clue.grade import answer_parts, answer_sheet_key, grade, valid_fraction

EVAL_SEED_OFFSET = 1
"""Held-out puzzle j is generated with seed 2 * j + EVAL_SEED_OFFSET (odd)."""


def train_seed(seed: int, index: int) -> int:
    """Generator seed of training puzzle `index` (always even, so never a held-out seed)."""
    return 2 * derive_seed("temporal_clue-train", seed, index, bits=30)


def eval_seed(j: int) -> int:
    """Generator seed of the j-th generated held-out puzzle (always odd)."""
    return 2 * j + EVAL_SEED_OFFSET


CONSTANT_ANSWERS: dict[str, Callable[[list[str]], str]] = {
    "first": lambda options: options[0],
    "second": lambda options: options[min(1, len(options) - 1)],
    "last": lambda options: options[-1],
}
"""Answers that ignore the puzzle: a position among each question's listed choices."""


def chance_reward_of(choices: dict[str, list[str]], letters: list[str] | None = None) -> float:
    """Expected reward of answering every question uniformly at random among its valid answers:
    the mean over questions of 1 / (number of choices)."""
    letters = list(choices) if letters is None else letters
    if not letters:
        return 0.0
    return sum(1.0 / len(choices[q]) if choices.get(q) else 0.0 for q in letters) / len(letters)


def expected_random_reward(problems: list[Problem]) -> float:
    """Mean chance reward over problems: what uniformly random valid answers would score."""
    if not problems:
        return 0.0
    return sum(chance_reward_of(p.metadata["choices"], list(p.answer)) for p in problems) / len(problems)


def _with_choices(puzzles: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """Each puzzle with its valid answers per question (its own "choices" field, else parsed from
    its prompt), checked up front so a bad file fails at start-up, naming the puzzle."""
    out = []
    for i, puzzle in enumerate(puzzles):
        choices = puzzle.get("choices")
        if not choices:
            try:
                choices = parse_choices(puzzle["prompt"])
            except DataError as e:
                raise DataError(f"puzzle file {path} item {i}: {e}") from None
        missing = [q for q in puzzle["solution"] if q not in choices]
        if missing:
            raise DataError(f"puzzle file {path} item {i}: no choices for question(s) {', '.join(missing)}")
        out.append({**puzzle, "choices": choices})
    return out


def _messages(prompt: str, system_prompt: str | None) -> list[Message]:
    messages: list[Message] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": prompt})
    return messages


class TemporalClueTask(Task):
    name = "temporal_clue"

    def __init__(self, cfg: TaskConfig) -> None:
        self.cfg = cfg
        self._train = _with_choices(load_puzzles(cfg.train_path), cfg.train_path) if cfg.train_path else None
        self._eval_puzzles = (
            _with_choices(load_puzzles(cfg.eval_path)[: cfg.eval_size], cfg.eval_path) if cfg.eval_path else None
        )
        self._eval_problems: list[Problem] | None = None
        # Generated puzzles are cached: the loop may ask for the same index twice (e.g. on resume).
        self._generated = lru_cache(maxsize=256)(self._generate)

    # ------------------------------------------------------------- problems

    def _generate(self, seed: int) -> dict[str, Any]:
        from sleuth.tasks.temporal_clue.generate import generate_puzzle

        return generate_puzzle(seed, self.cfg.difficulty, list_choices=self.cfg.list_choices)

    def _from_file(self, puzzle: dict[str, Any], problem_id: str) -> Problem:
        prompt = puzzle["prompt"]
        choices = puzzle["choices"]
        if self.cfg.list_choices:
            prompt = add_choices(prompt, choices)
        metadata = {k: v for k, v in puzzle.items() if k not in ("prompt", "solution")}
        metadata["choices"] = choices
        return Problem(problem_id, _messages(prompt, self.cfg.system_prompt), dict(puzzle["solution"]), metadata)

    def _from_generator(self, seed: int, problem_id: str) -> Problem:
        puzzle = self._generated(seed)
        metadata = {k: v for k, v in puzzle.items() if k not in ("prompt", "solution")}
        return Problem(
            problem_id, _messages(puzzle["prompt"], self.cfg.system_prompt), dict(puzzle["solution"]), metadata
        )

    def train_problem(self, index: int) -> Problem:
        if self._train is not None:
            k = stream_index(len(self._train), self.cfg.seed, index)
            return self._from_file(self._train[k], f"{self.cfg.train_path}#{k}")
        seed = train_seed(self.cfg.seed, index)
        return self._from_generator(seed, f"tc-d{self.cfg.difficulty}-seed{seed}")

    def eval_problems(self) -> list[Problem]:
        if self._eval_problems is None:
            if self._eval_puzzles is not None:
                self._eval_problems = [
                    self._from_file(p, f"{self.cfg.eval_path}#{j}") for j, p in enumerate(self._eval_puzzles)
                ]
            else:
                self._eval_problems = [
                    self._from_generator(eval_seed(j), f"tc-d{self.cfg.difficulty}-seed{eval_seed(j)}")
                    for j in range(self.cfg.eval_size)
                ]
        return list(self._eval_problems)

    # ------------------------------------------------------------- verifier

    def score(self, problem: Problem, completion: str) -> float:
        return grade(problem.answer, completion)

    def answer_parts(self, problem: Problem, completion: str) -> list[AnswerPart] | None:
        """Each answer on a line of its own, with its own reward (per-answer credit) and, when the
        puzzle lists its choices, its own format score (a listed choice or not)."""
        return answer_parts(problem.answer, completion, problem.metadata.get("choices"))

    def answer_key(self, problem: Problem, completion: str) -> tuple[tuple[str, str], ...] | None:
        """maj@k votes on the whole answer sheet (every question's answer), not on the raw text."""
        return answer_sheet_key(problem.answer, completion)

    def format_score(self, problem: Problem, completion: str) -> float | None:
        """The fraction of questions answered with one of their listed choices (None without choices)."""
        choices = problem.metadata.get("choices")
        if not choices:
            return None
        return valid_fraction({q: choices[q] for q in problem.answer if q in choices}, completion)

    def stop_strings(self, problem: Problem) -> list[str]:
        """With task.stop_after_sheet: the start of the line of the question after the last one."""
        letters = [q for q in problem.answer if len(q) == 1 and "A" <= q < "Z"]
        if not self.cfg.stop_after_sheet or not letters:
            return []
        return [f"\n{chr(ord(max(letters)) + 1)}."]

    def answer_pattern(self, problem: Problem) -> str | None:
        """The answer sheet: one line per question, in order, `A. <one of its choices>` (None without choices)."""
        choices = problem.metadata.get("choices")
        if not choices or any(not choices.get(q) for q in problem.answer):
            return None
        return "\n".join(regex_literal(f"{q}. ") + one_of(choices[q]) for q in problem.answer)

    def chance_reward(self, problem: Problem) -> float | None:
        choices = problem.metadata.get("choices")
        if not choices:
            return None
        return chance_reward_of(choices, list(problem.answer))

    def constant_rewards(self, problem: Problem) -> dict[str, float] | None:
        """The sheet naming the first, second or last listed choice on every line, scored."""
        choices = problem.metadata.get("choices")
        if not choices or any(not choices.get(q) for q in problem.answer):
            return None
        return {name: self.score(problem, "\n".join(f"{q}. {pick(choices[q])}" for q in problem.answer))
                for name, pick in CONSTANT_ANSWERS.items()}

    def __getstate__(self) -> dict[str, Any]:
        # The lru_cache wrapper is not picklable (verifier workers receive the task pickled).
        state = self.__dict__.copy()
        del state["_generated"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._generated = lru_cache(maxsize=256)(self._generate)


def build(cfg: TaskConfig) -> TemporalClueTask:
    return TemporalClueTask(cfg)
