"""The Temporal Clue task: puzzles as problems, the grader as verifier.

Training problems come either from the generator, one puzzle per index with its own derived seed
(an endless stream), or from a data file (cfg.train_path, published JSON or our JSONL) visited in
epoch-wise permutations seeded by cfg.seed. Held-out problems are the first cfg.eval_size puzzles
of cfg.eval_path, or a fixed generated set.

Generated seeds: training index i uses 2 * derive_seed(cfg.seed, i) (even), held-out puzzle j uses
2 * j + 1 (odd), so the two never share a puzzle, and the held-out set is the same whatever the
training seed (runs with different seeds are compared on the same puzzles).

The message list is the puzzle prompt as one user message (after cfg.system_prompt when set); the
prompt itself ends with the answer format. With cfg.temporal_clue.list_choices every question line ends with
` (choose from: X, Y, Z)`, which gives a small model a learnable start. With cfg.temporal_clue.reasoning "deduce"
the prompt numbers the clues and asks for a short deduction before the sheet, and every verifier
method reads only the sheet after the last `Answers:` line (reasoning.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import DataError
from sleuth.records import AnswerPart, Message, Problem
from sleuth.system.seeds import derive_seed
from sleuth.tasks.base import Task
from sleuth.tasks.curriculum import level_name, parse_level
from sleuth.tasks.order import stream_index
from sleuth.tasks.patterns import one_of, regex_literal
from sleuth.tasks.temporal_clue.dataset import add_choices, load_puzzles, parse_choices, question_kinds
from sleuth.tasks.temporal_clue.grade import answer_parts, answer_sheet_key, grade, valid_fraction
from sleuth.tasks.temporal_clue.reasoning import deduce_prompt, deduction_lines, sheet_part, sheet_start

EVAL_SEED_OFFSET = 1
"""Held-out puzzle j is generated with seed 2 * j + EVAL_SEED_OFFSET (odd)."""


def train_seed(seed: int, index: int) -> int:
    """Generator seed of training puzzle `index` (always even, so never a held-out seed)."""
    return 2 * derive_seed("temporal_clue-train", seed, index, bits=30)


def _name(level: int | str) -> str:
    return level_name(parse_level(level))


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

        return generate_puzzle(seed, self.cfg.temporal_clue.difficulty, list_choices=self.cfg.temporal_clue.list_choices)

    def _generate_held_out(self, seed: int) -> dict[str, Any]:
        from sleuth.tasks.temporal_clue.generate import generate_puzzle

        return generate_puzzle(seed, self.eval_level, list_choices=self.cfg.temporal_clue.list_choices)

    @property
    def held_out_difficulty(self) -> str | None:
        """The generated held-out puzzles' level by name ("elim1", "1"); None for a held-out file."""
        return None if self._eval_puzzles is not None else _name(self.eval_level)

    @property
    def eval_level(self) -> int | str:
        """The level of the generated held-out puzzles: task.temporal_clue.eval_difficulty, else the training level."""
        return self.cfg.temporal_clue.difficulty if self.cfg.temporal_clue.eval_difficulty is None else self.cfg.temporal_clue.eval_difficulty

    def _from_file(self, puzzle: dict[str, Any], problem_id: str) -> Problem:
        prompt = puzzle["prompt"]
        choices = puzzle["choices"]
        if self.cfg.temporal_clue.list_choices:
            prompt = add_choices(prompt, choices)
        metadata = {k: v for k, v in puzzle.items() if k not in ("prompt", "solution")}
        metadata["choices"] = choices
        return Problem(problem_id, self._messages(prompt), dict(puzzle["solution"]), metadata)

    def _from_generator(self, seed: int, problem_id: str, held_out: bool = False) -> Problem:
        puzzle = self._generate_held_out(seed) if held_out else self._generated(seed)
        return self.problem_from_record(puzzle, problem_id)

    def problem_from_record(self, puzzle: dict[str, Any], problem_id: str) -> Problem:
        """A generated puzzle record (`generate.puzzle_record`) as this task poses it."""
        metadata = {k: v for k, v in puzzle.items() if k not in ("prompt", "solution")}
        return Problem(problem_id, self._messages(puzzle["prompt"]), dict(puzzle["solution"]), metadata)

    def _messages(self, prompt: str) -> list[Message]:
        if self.cfg.temporal_clue.reasoning == "deduce":
            prompt = deduce_prompt(prompt)
        return _messages(prompt, self.cfg.system_prompt)

    def _graded(self, completion: str) -> str:
        """The part of a completion the verifier reads: all of it, or in deduce mode the sheet."""
        return sheet_part(completion) if self.cfg.temporal_clue.reasoning == "deduce" else completion

    def train_problem(self, index: int) -> Problem:
        if self._train is not None:
            k = stream_index(len(self._train), self.cfg.seed, index)
            return self._from_file(self._train[k], f"{self.cfg.train_path}#{k}")
        seed = train_seed(self.cfg.seed, index)
        return self._from_generator(seed, f"tc-d{_name(self.cfg.temporal_clue.difficulty)}-seed{seed}")

    def eval_problems(self) -> list[Problem]:
        if self._eval_problems is None:
            if self._eval_puzzles is not None:
                self._eval_problems = [
                    self._from_file(p, f"{self.cfg.eval_path}#{j}") for j, p in enumerate(self._eval_puzzles)
                ]
            else:
                level = _name(self.eval_level)
                self._eval_problems = [
                    self._from_generator(eval_seed(j), f"tc-d{level}-seed{eval_seed(j)}", held_out=True)
                    for j in range(self.cfg.eval_size)
                ]
        return list(self._eval_problems)

    # ------------------------------------------------------------- verifier

    def score(self, problem: Problem, completion: str) -> float:
        return grade(problem.answer, self._graded(completion))

    def answer_parts(self, problem: Problem, completion: str) -> list[AnswerPart] | None:
        """Each answer on a line of its own, with its own reward (per-answer credit) and, when the
        puzzle lists its choices, its own format score (a listed choice or not)."""
        choices = problem.metadata.get("choices")
        if self.cfg.temporal_clue.reasoning != "deduce":
            return answer_parts(problem.answer, completion, choices)
        at = sheet_start(completion)  # spans stay positions in the whole completion (credit.py)
        sheet = [replace(p, start=p.start + at, end=p.end + at,
                         value_start=None if p.value_start is None else p.value_start + at)
                 for p in answer_parts(problem.answer, completion[at:], choices)]
        if not self.cfg.temporal_clue.deduction_credit:
            return sheet
        # Each deduction line takes its question's sheet reward (0: not on the sheet), so both
        # lines of a question share that question's advantage (credit.py reads the first part).
        graded = {p.key: p for p in sheet}
        letters = {str(q).upper() for q in problem.answer if len(str(q)) == 1}
        lines = [AnswerPart(letter, begin, end, graded[letter].reward if letter in graded else 0.0,
                            format_score=graded[letter].format_score if letter in graded else
                            (None if choices is None else 0.0))
                 for letter, begin, end in deduction_lines(completion, letters)]
        return sorted(lines + sheet, key=lambda p: p.start)

    def answer_key(self, problem: Problem, completion: str) -> tuple[tuple[str, str], ...] | None:
        """maj@k votes on the whole answer sheet (every question's answer), not on the raw text."""
        return answer_sheet_key(problem.answer, self._graded(completion))

    def format_score(self, problem: Problem, completion: str) -> float | None:
        """The fraction of questions answered with one of their listed choices (None without choices)."""
        choices = problem.metadata.get("choices")
        if not choices:
            return None
        return valid_fraction({q: choices[q] for q in problem.answer if q in choices}, self._graded(completion))

    def stop_strings(self, problem: Problem) -> list[str]:
        """With task.temporal_clue.stop_after_sheet: the start of the line of the question after the last one."""
        letters = [q for q in problem.answer if len(q) == 1 and "A" <= q < "Z"]
        if not self.cfg.temporal_clue.stop_after_sheet or not letters:
            return []
        return [f"\n{chr(ord(max(letters)) + 1)}."]

    def answer_pattern(self, problem: Problem) -> str | None:
        """The answer sheet: one line per question, in order, `A. <one of its choices>` (None without
        choices, and in deduce mode, where free text comes first)."""
        choices = problem.metadata.get("choices")
        if self.cfg.temporal_clue.reasoning == "deduce" or not choices or any(not choices.get(q) for q in problem.answer):
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
        prefix = "Answers:\n" if self.cfg.temporal_clue.reasoning == "deduce" else ""
        return {name: self.score(problem, prefix + "\n".join(f"{q}. {pick(choices[q])}" for q in problem.answer))
                for name, pick in CONSTANT_ANSWERS.items()}

    def kind_scores(self, problem: Problem, completion: str) -> dict[str, tuple[float, float]] | None:
        """Per kind (who / weapon / where / when / why / bonus, read from the prompt's question
        lines): (fraction of that kind's questions answered right, its chance level: the mean of
        1 / number of choices, 0 where the choices are unknown)."""
        kinds = question_kinds(str(problem.messages[-1]["content"]))
        choices = problem.metadata.get("choices") or {}
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for letter, truth in problem.answer.items():
            right = grade({letter: truth}, completion)
            chance = 1.0 / len(choices[letter]) if choices.get(letter) else 0.0
            by_kind.setdefault(kinds.get(letter, "bonus"), []).append((right, chance))
        return {k: (sum(r for r, _ in v) / len(v), sum(c for _, c in v) / len(v)) for k, v in by_kind.items()}

    def first_choice_share(self, problem: Problem, completion: str) -> float | None:
        choices = problem.metadata.get("choices")
        if not choices:
            return None
        return valid_fraction({q: choices[q][:1] for q in problem.answer if choices.get(q)}, completion)

    def diagnostic_problems(self, name: str, problems: list[Problem], seed: int = 0) -> list[Problem]:
        """The held-out problems with their clues removed (ablate_clues) or their listed choices
        moved (permute_options): sleuth eval's diagnostics (temporal_clue/diagnostics.py)."""
        from sleuth.tasks.temporal_clue.diagnostics import diagnostic_problems

        return diagnostic_problems(name, problems, seed)

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
