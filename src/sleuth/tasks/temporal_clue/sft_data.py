"""Supervised examples for `sleuth sft`: fresh Temporal Clue puzzles posed in `deduce` form, each
with the solver's deduction and answer sheet as its target.

Seeds (disjoint from every held-out set): puzzle i of the stream has generator seed
2**31 + 2 * derive_seed("temporal_clue-sft", sft.seed, i) (even, in [2**31, 2**32)). Generated
held-out puzzles use odd seeds (2j + 1) and RL training puzzles even seeds below 2**31 (task.py);
a puzzle of task.eval_path with the same seed is skipped too (its seed redrawn).

A puzzle's prompt is the task's own with task.temporal_clue.reasoning deduce (reasoning.py: what RL and
`sleuth eval` pose in that mode); its target is `deduce.solution_text` as the chat template writes
an assistant turn, through the end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sleuth.config import Config
from sleuth.records import Problem
from sleuth.system.seeds import derive_seed

SEED_BASE = 2**31
"""SFT puzzle seeds start here (RL training seeds are below it, held-out seeds are odd)."""


def sft_seed(seed: int, index: int, attempt: int = 0) -> int:
    """Generator seed of SFT puzzle `index` (even, in [2**31, 2**32)); `attempt` > 0 redraws it."""
    parts: tuple[object, ...] = ("temporal_clue-sft", seed, index) + ((attempt,) if attempt else ())
    return SEED_BASE + 2 * derive_seed(*parts, bits=30)


@dataclass
class Example:
    problem: Problem
    prompt_ids: list[int]
    target_ids: list[int]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.target_ids)


class PuzzleStream:
    """SFT examples by index: the same index always gives the same example."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        from sleuth.tasks.temporal_clue.generate import check_difficulty
        from sleuth.tasks.temporal_clue.task import TemporalClueTask

        check_difficulty(cfg.sft.difficulty, "sft.difficulty")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.task = TemporalClueTask(cfg.task.model_copy(update={
            "train_path": None, "temporal_clue": cfg.task.temporal_clue.model_copy(update={"reasoning": "deduce"})}))
        eval_puzzles = self.task._eval_puzzles or []
        self.excluded = {p["seed"] for p in eval_puzzles if isinstance(p.get("seed"), int)}

    def seed(self, index: int) -> int:
        attempt, seed = 0, sft_seed(self.cfg.sft.seed, index)
        while seed in self.excluded:
            attempt += 1
            seed = sft_seed(self.cfg.sft.seed, index, attempt)
        return seed

    def example(self, index: int) -> Example:
        from sleuth.system.models import encode_chat
        from sleuth.tasks.temporal_clue.deduce import solution_text
        from sleuth.tasks.temporal_clue.generate import build_puzzle, check_difficulty, puzzle_record

        seed, difficulty = self.seed(index), check_difficulty(self.cfg.sft.difficulty)
        puzzle = build_puzzle(seed, difficulty)
        record = puzzle_record(puzzle, self.cfg.task.temporal_clue.list_choices)
        problem = self.task.problem_from_record(record, f"sft-d{difficulty}-seed{seed}")
        prompt_ids = encode_chat(self.tokenizer, problem.messages)
        return Example(problem, prompt_ids, self._target(problem, prompt_ids, solution_text(puzzle)))

    def _target(self, problem: Problem, prompt_ids: list[int], text: str) -> list[int]:
        """The assistant turn's tokens as the chat template writes them, through its end-of-turn
        token (what follows it, e.g. a newline, is not sampled and is left out)."""
        tok = self.tokenizer
        full = tok.apply_chat_template([*problem.messages, {"role": "assistant", "content": text}],
                                       tokenize=True, return_dict=False)
        if hasattr(full, "keys"):
            full = full["input_ids"]
        full = [int(i) for i in full]
        eos = tok.eos_token_id
        if full[: len(prompt_ids)] == prompt_ids and eos in full[len(prompt_ids):]:
            target = full[len(prompt_ids):]
            return target[: len(target) - target[::-1].index(eos)]
        return [*tok.encode(text, add_special_tokens=False), eos]

    def batch(self, start: int, tokens: int) -> tuple[list[Example], int]:
        """Examples from index `start` on until they hold `tokens` tokens (at least one); the next index."""
        out: list[Example] = []
        index = start
        while not out or sum(e.tokens for e in out) < tokens:
            out.append(self.example(index))
            index += 1
        return out, index
