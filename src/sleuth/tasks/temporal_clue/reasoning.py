"""Room to reason (`task.temporal_clue.reasoning: deduce`): the prompt asks for a short deduction per question,
citing the clues by number, then the answer sheet; the grader reads only the sheet.

The prompt is changed in two places, which works for generated puzzles and puzzle files alike:
the clue bullets (`- ...`) become numbered (`1. ...`, the numbers `deduce.py` cites), and the
answer-format paragraph first asks for `Deductions:` (one line per question, e.g.
`A: clue 3: the Rope was in the Hall at 11:00 PM => Hall`) and then `Answers:` followed by the
sheet. The answer-format lines themselves are kept, so the choices and the sheet's format are
parsed from the prompt exactly as in `direct` mode.

Grading: only the text after the last `Answers:` line counts, so answers written inside the
deduction ("=> Hall", or a stray "A. Hall") never score; a completion without that line scores 0.
"""

from __future__ import annotations

import re

from sleuth.config import Config
from sleuth.tasks.temporal_clue.deduce import ANSWERS_HEADER, DEDUCTIONS_HEADER

REASONING_MODES = ("direct", "deduce")
_CLUES_HEADER = "The available clues are as follows:"
_FILL_OUT = "Fill out your final answers in the following format:"
DEDUCE_INSTRUCTION = (
    f"Write `{DEDUCTIONS_HEADER}`, one line per question citing its clues by number (e.g. `A: clue 3: the "
    f"Rope was in the Hall at 11:00 PM => Hall`), then `{ANSWERS_HEADER}` and your final answers in the "
    "following format:"
)
ROOM_TOKENS = {"rung": 192, "level": 256}
"""Below these rollout.max_tokens a deduce-mode run is told it leaves no room: a deduction and its
sheet (`deduce.solution_text`) are ~130 SmolLM2 tokens on the ladder's rungs (lookup, elim1, elim2)
and ~190 at difficulty 1."""
_CLUE_BULLET = re.compile(r"^- (.*)$")
# The sheet starts at the last line that is just "Answers:" (markdown around it allowed).
_ANSWERS_LINE = re.compile(r"^[ \t*_#>]*Answers:[ \t*_]*$", re.MULTILINE | re.IGNORECASE)
_DEDUCTION_LINE = re.compile(r"^[ \t*_-]*([A-Za-z])[*_]*:")


def number_clues(prompt: str) -> str:
    """The prompt with the clue bullets after the clue header numbered 1, 2, ... (other lines kept)."""
    head, sep, tail = prompt.partition(_CLUES_HEADER)
    if not sep:
        return prompt
    lines = tail.split("\n")
    n = 0
    for i, line in enumerate(lines):
        m = _CLUE_BULLET.match(line)
        if m:
            n += 1
            lines[i] = f"{n}. {m.group(1)}"
        elif n and line.strip():
            break  # the clue list has ended
    return head + sep + "\n".join(lines)


def deduce_prompt(prompt: str) -> str:
    """The `deduce` form of a puzzle prompt (numbered clues, deduction then sheet); a prompt without
    the standard answer-format sentence keeps its own wording and gets only the numbering."""
    numbered = number_clues(prompt)
    head, sep, tail = numbered.rpartition(_FILL_OUT)
    return head + DEDUCE_INSTRUCTION + tail if sep else numbered


def sheet_start(completion: str) -> int:
    """Where a `deduce` completion's sheet starts: just after its last `Answers:` line (the text's
    end when it has none)."""
    matches = list(_ANSWERS_LINE.finditer(completion))
    return matches[-1].end() if matches else len(completion)


def sheet_part(completion: str) -> str:
    """What a `deduce` completion offers for grading: the text after its last `Answers:` line
    (empty when it has none)."""
    return completion[sheet_start(completion):]


def deduction_lines(completion: str, letters: set[str]) -> list[tuple[str, int, int]]:
    """The deduction lines before a `deduce` completion's sheet: (letter, start, end) of each line
    that opens with one of `letters` and a colon (`C: clue 2: ... => Lounge`), newline excluded."""
    out, start, head = [], 0, completion[:sheet_start(completion)]
    for line in head.splitlines(keepends=True):
        m = _DEDUCTION_LINE.match(line)
        if m and m.group(1).upper() in letters:
            out.append((m.group(1).upper(), start, start + len(line.rstrip("\r\n"))))
        start += len(line)
    return out


def room_note(cfg: Config) -> str | None:
    """A start-up note when task.temporal_clue.reasoning=deduce leaves the completion too few tokens for the
    hardest level the run trains or evaluates at."""
    from sleuth.tasks.curriculum import parse_level, parse_schedule

    tc = cfg.task.temporal_clue
    if cfg.task.name != "temporal_clue" or tc.reasoning != "deduce":
        return None
    levels = [stage.level for stage in parse_schedule(tc.difficulty)]
    if tc.eval_difficulty is not None:
        levels.append(parse_level(tc.eval_difficulty))
    kind = "level" if max(levels) >= 1 else "rung"
    if cfg.rollout.max_tokens >= ROOM_TOKENS[kind]:
        return None
    where, size = ("at difficulty 1 and above", 190) if kind == "level" else ("on the ladder's rungs", 130)
    return (f"task.temporal_clue.reasoning=deduce with rollout.max_tokens={cfg.rollout.max_tokens}: a deduction and the answer "
            f"sheet take ~{size} tokens {where} and a cut completion scores 0 "
            f"(set rollout.max_tokens={2 * ROOM_TOKENS[kind]})")
