"""The math task: competition problems with a final answer, e.g. AIME 2024.

Data: a JSONL file, one object a line with `problem` (text) and `answer` (string or number), and
optionally `id`. Training problems come from cfg.train_path in epoch-wise permutations seeded by
cfg.seed; held-out problems are the first cfg.eval_size of cfg.eval_path (or of train_path).

Verifier: the model's final answer is the last `\\boxed{...}` (braces balanced; `\\fbox` too) or
`Answer: ...` line, whichever comes last in the completion. Integer answers compare as numbers
("025" equals 25, "1,000" equals 1000); anything else goes through math-verify (symbolic and
numeric equivalence: "\\frac{1}{2}" equals "0.5"), with a time limit on each of its steps.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from sleuth.config import TaskConfig
from sleuth.errors import ConfigError, DataError
from sleuth.records import Message, Problem
from sleuth.system.datafiles import jsonl_objects, read_text_file
from sleuth.tasks.base import Task
from sleuth.tasks.order import stream_index

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to every problem: the answer format the verifier reads."""

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_MAX_BOXES_TRIED = 32
"""Unbalanced boxes tried from the end before giving up (keeps extraction linear in practice)."""
_MAX_ANSWER_CHARS = 2000
_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:：]", re.IGNORECASE)
_INTEGER = re.compile(r"[+-]?\d+")
_GROUPED_INTEGER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")


def load_math_problems(path: str | Path) -> list[dict[str, Any]]:
    """Every {problem, answer, id} of a JSONL file; DataError naming the file and line otherwise."""
    p = Path(path)
    text = read_text_file(p, "math problem file")
    items = []
    for lineno, obj in jsonl_objects(text, f"math problem file {p}"):
        if not isinstance(obj, dict) or not isinstance(obj.get("problem"), str):
            raise DataError(f"math problem file {p} line {lineno}: needs a string 'problem'")
        answer = obj.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or str(answer).strip() == "":
            raise DataError(f"math problem file {p} line {lineno}: needs an 'answer' (string or number)")
        items.append({"id": str(obj.get("id", f"{p.name}#{lineno}")), "problem": obj["problem"], "answer": str(answer)})
    if not items:
        raise DataError(f"math problem file {p} holds no problems")
    return items


def _balanced(text: str, start: int) -> str | None:
    """The contents of the brace group opened just before `start`, or None if never closed."""
    depth = 1
    end = min(len(text), start + _MAX_ANSWER_CHARS)
    for i in range(start, end):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(position, contents) of the last balanced \\boxed{...} or \\fbox{...}."""
    end = len(text)
    for _ in range(_MAX_BOXES_TRIED):
        pos, opener = max((text.rfind(o, 0, end), o) for o in _BOX_OPENERS)
        if pos < 0:
            return None
        inner = _balanced(text, pos + len(opener))
        if inner is not None:
            return pos, inner
        end = pos
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: the last \\boxed{} or `Answer:` line, cleaned."""
    if not completion:
        return None
    boxed = _last_boxed(completion)
    line_match = None
    for m in _ANSWER_LINE.finditer(completion):
        line_match = m
    candidates = []
    if boxed is not None:
        candidates.append(boxed)
    if line_match is not None:
        rest = completion[line_match.end() : line_match.end() + _MAX_ANSWER_CHARS].split("\n", 1)[0]
        candidates.append((line_match.start(), rest))
    if not candidates:
        return None
    _, answer = max(candidates)
    inner_box = _last_boxed(answer)  # "Answer: \boxed{25}"
    if inner_box is not None:
        answer = inner_box[1]
    # Markdown and math delimiters around the answer, and a sentence's final period (a leading
    # period stays: ".5").
    answer = answer.replace("**", "").strip().lstrip("$ \t").rstrip("$. \t")
    return answer or None


def _integer_text(answer: str) -> str | None:
    """The canonical digits of an integer answer ("025" -> "25", "-0" -> "0"), else None."""
    s = answer.replace("\\!", "").replace("\\,", "").replace("{,}", ",").replace(" ", "")
    s = s.removeprefix("\\text{").removesuffix("}") if s.startswith("\\text{") else s
    if _GROUPED_INTEGER.fullmatch(s):
        s = s.replace(",", "")
    if not _INTEGER.fullmatch(s):
        return None
    sign = "-" if s.startswith("-") else ""
    digits = s.lstrip("+-").lstrip("0") or "0"
    return ("" if digits == "0" else sign) + digits


def answers_equal(gold: str, given: str, timeout_s: float = 5.0) -> bool:
    """Whether `given` is the same answer as `gold`: as integers when both are, else math-verify."""
    gold_int, given_int = _integer_text(gold), _integer_text(given)
    if gold_int is not None and given_int is not None:
        return gold_int == given_int
    from math_verify import parse, verify

    # math-verify limits itself with SIGALRM, which only works in the main thread; elsewhere the
    # caller's limit (sleuth.rewards.verifier) is the only one.
    limit = max(1, int(timeout_s / 3)) if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=limit)  # type: ignore[arg-type]
    given_parsed = parse(f"\\boxed{{{given}}}", parsing_timeout=limit)  # type: ignore[arg-type]
    if not gold_parsed or not given_parsed:
        return False
    return bool(verify(gold_parsed, given_parsed, timeout_seconds=limit))


class MathTask(Task):
    name = "math"

    def __init__(self, cfg: TaskConfig) -> None:
        if not cfg.train_path and not cfg.eval_path:
            raise ConfigError("task 'math' needs task.train_path (a JSONL of problem/answer), e.g. aime2024.jsonl")
        self.cfg = cfg
        self._train = load_math_problems(cfg.train_path) if cfg.train_path else None
        held_out = load_math_problems(cfg.eval_path) if cfg.eval_path else self._train
        assert held_out is not None
        self._eval = held_out[: cfg.eval_size]

    def _problem(self, item: dict[str, Any]) -> Problem:
        messages: list[Message] = []
        if self.cfg.system_prompt:
            messages.append({"role": "system", "content": self.cfg.system_prompt})
        messages.append({"role": "user", "content": f"{item['problem']}\n\n{INSTRUCTION}"})
        return Problem(item["id"], messages, item["answer"], {})

    def train_problem(self, index: int) -> Problem:
        if self._train is None:
            raise ConfigError("task 'math' has no task.train_path to train on (only eval_path is set)")
        return self._problem(self._train[stream_index(len(self._train), self.cfg.seed, index)])

    def eval_problems(self) -> list[Problem]:
        return [self._problem(item) for item in self._eval]

    def score(self, problem: Problem, completion: str) -> float:
        given = extract_answer(completion)
        if given is None:
            return 0.0
        return 1.0 if answers_equal(str(problem.answer), given, self.cfg.verifier_timeout_s) else 0.0


def build(cfg: TaskConfig) -> MathTask:
    return MathTask(cfg)
