"""Temporal Clue data files and prompts: load puzzles, derive each question's valid answers.

Two file shapes are read, told apart by their first character:

- the published one: a JSON list of {"num_clues": int, "prompt": str, "solution": {"A": str, ...}};
- ours (`sleuth puzzles generate`): JSON Lines, one such object a line, plus extra metadata
  fields (seed, difficulty, clue_kinds, choices), which are kept.

A file that cannot be read or does not have that shape raises DataError naming the file and the
offending line (JSONL) or list index (JSON).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sleuth.errors import DataError
from sleuth.system.datafiles import jsonl_objects, read_text_file

ANSWER_TYPES = ("SUSPECT", "WEAPON", "ROOM", "TIME", "MOTIVE")
"""The placeholders of the answer-format section, one per kind of answer."""

_FORMAT_HEADER = "following format:"
_FORMAT_LINE = re.compile(r"^\s*([A-Z])\.\s+([A-Z]+)\s*$")
_DESCRIBED_LINE = re.compile(r"^\s*([A-Z])\.\s+(<[^>]*>)\s*$")

DESCRIBED = {kind: f"<name of the {kind.lower()}>" for kind in ("SUSPECT", "WEAPON", "ROOM")}
DESCRIBED |= {"TIME": "<the time>", "MOTIVE": "<the motive>"}
"""What list_choices writes on the answer sheet instead of each bare placeholder. Measured on
SmolLM2-135M-Instruct (16 difficulty-1 puzzles x 8 samples, temperature 0.7): with the bare
placeholders it copies them (`A. SUSPECT`) and scores 0.035; with these it names people, weapons
and rooms (often of the wrong kind) and scores 0.071, which gives GRPO a signal in 13 of 16 groups."""
_KIND_OF_DESCRIPTION = {text: kind for kind, text in DESCRIBED.items()}
_QUESTION_LINE = re.compile(r"^([A-Z])\.\s+\S")
_BULLET = re.compile(r"^\s*(?:[•\-*]|\d+\.)\s+(.+?)\s*$")
_MOTIVE_COUNT = re.compile(r"\s*\(\d+\s+suspects?\)$")
_CHOOSE_FROM = " (choose from: "


def _check_puzzle(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with prompt and solution, got {type(obj).__name__}")
    prompt, solution = obj.get("prompt"), obj.get("solution")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: 'prompt' must be a non-empty string")
    if (
        not isinstance(solution, dict)
        or not solution
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in solution.items())
    ):
        raise DataError(f"{where}: 'solution' must be a non-empty object of letter -> answer strings")
    if "num_clues" in obj and not isinstance(obj["num_clues"], int):
        raise DataError(f"{where}: 'num_clues' must be an integer")
    return obj


def load_puzzles(path: str | Path) -> list[dict[str, Any]]:
    """Every puzzle of a published JSON list or a JSONL file, in file order."""
    p = Path(path)
    text = read_text_file(p, "puzzle file")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"puzzle file {p} line {e.lineno}: not valid JSON ({e.msg})") from None
        puzzles = [_check_puzzle(obj, f"puzzle file {p} item {i}") for i, obj in enumerate(items)]
    else:
        puzzles = [_check_puzzle(obj, f"puzzle file {p} line {lineno}")
                   for lineno, obj in jsonl_objects(text, f"puzzle file {p}")]
    if not puzzles:
        raise DataError(f"puzzle file {p} holds no puzzles")
    return puzzles


def _section_kind(header: str) -> str | None:
    """Which list a header line introduces. Only the words after its last "following" count
    (the opening paragraph mentions "rooms" before "...identified as suspects:"), and the order
    of the checks matters: the motive header mentions "suspect"."""
    h = header.lower().rpartition("following")[2]
    if "clue" in h or "question" in h or "format" in h:
        return None
    for word, kind in (("motive", "MOTIVE"), ("time", "TIME"), ("weapon", "WEAPON"), ("room", "ROOM")):
        if word in h:
            return kind
    if "suspect" in h:
        return "SUSPECT"
    return None


def parse_lists(prompt: str) -> dict[str, list[str]]:
    """The suspects, weapons, rooms, times and motives a prompt lists, keyed by ANSWER_TYPES."""
    lists: dict[str, list[str]] = {}
    kind: str | None = None
    for line in prompt.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        bullet = _BULLET.match(line)
        if bullet and kind is not None:
            name = _MOTIVE_COUNT.sub("", bullet.group(1)) if kind == "MOTIVE" else bullet.group(1)
            if name not in lists.setdefault(kind, []):
                lists[kind].append(name)
        elif stripped.endswith(":"):
            kind = _section_kind(stripped)
        elif not bullet:
            kind = None  # prose or the room map ends a list
    return lists


def answer_format(prompt: str) -> dict[str, str]:
    """The answer-format section: question letter -> placeholder ("A" -> "SUSPECT")."""
    _, sep, tail = prompt.rpartition(_FORMAT_HEADER)
    if not sep:
        return {}
    out: dict[str, str] = {}
    for line in tail.splitlines():
        m = _FORMAT_LINE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
        elif (m := _DESCRIBED_LINE.match(line)) and m.group(2) in _KIND_OF_DESCRIPTION:
            out[m.group(1)] = _KIND_OF_DESCRIPTION[m.group(2)]
    return out


def describe_answer_sheet(prompt: str) -> str:
    """The prompt with each bare answer-sheet placeholder (`A. SUSPECT`) replaced by its
    description (`A. <name of the suspect>`); other lines are kept as they are."""
    head, sep, tail = prompt.rpartition(_FORMAT_HEADER)
    if not sep:
        return prompt
    lines = []
    for line in tail.split("\n"):
        m = _FORMAT_LINE.match(line)
        if m and m.group(2) in DESCRIBED:
            line = f"{m.group(1)}. {DESCRIBED[m.group(2)]}"
        lines.append(line)
    return head + sep + "\n".join(lines)


def parse_choices(prompt: str) -> dict[str, list[str]]:
    """Each question's valid answers, from a prompt in the published shape.

    The answer-format section gives each letter's placeholder (SUSPECT, WEAPON, ROOM, TIME,
    MOTIVE); the answers are the list of that kind in the prompt. Raises DataError when the
    prompt has no answer-format section or a placeholder whose list is missing.
    """
    fmt = answer_format(prompt)
    if not fmt:
        raise DataError("puzzle prompt has no answer-format section ('... in the following format:')")
    lists = parse_lists(prompt)
    choices: dict[str, list[str]] = {}
    for letter, kind in fmt.items():
        if kind not in lists:
            raise DataError(f"puzzle prompt asks question {letter} for a {kind} but lists no {kind.lower()}s")
        choices[letter] = list(lists[kind])
    return choices


def add_choices(prompt: str, choices: dict[str, list[str]]) -> str:
    """The prompt with ` (choose from: X, Y, Z)` after each question line whose letter has choices,
    and the answer sheet's placeholders described (see DESCRIBED).

    Question lines are those between the question header and the answer-format section. Lines
    that already list choices are kept.
    """
    prompt = describe_answer_sheet(prompt)
    head, sep, tail = prompt.rpartition(_FORMAT_HEADER)
    body = head if sep else prompt
    start = body.find("following question")
    if start < 0:
        start = 0
    out_lines = []
    for line in body[start:].split("\n"):
        m = _QUESTION_LINE.match(line)
        if m and m.group(1) in choices and _CHOOSE_FROM not in line:
            line = f"{line.rstrip()}{_CHOOSE_FROM}{', '.join(choices[m.group(1)])})"
        out_lines.append(line)
    return body[:start] + "\n".join(out_lines) + (sep + tail if sep else "")


def answer_sheet(solution: dict[str, str]) -> str:
    """The solution written in the answer format, one `A. ANSWER` line per question."""
    return "\n".join(f"{letter}. {answer}" for letter, answer in sorted(solution.items()))


QUESTION_KINDS = {"Who murdered Mr. Boddy?": "who", "What weapon did the murderer use?": "weapon",
                  "Where was the murder committed?": "where", "When did the murder occur?": "when",
                  "Why did the murderer do it?": "why"}
"""The main questions' text (generated and published alike) -> their kind; every other is "bonus"."""
KINDS = ("who", "weapon", "where", "when", "why", "bonus")


def question_kinds(prompt: str) -> dict[str, str]:
    """Each question letter's kind, read from the prompt's question lines (after its question header)."""
    body = prompt.rpartition(_FORMAT_HEADER)[0] or prompt
    start = body.find("following question")
    out: dict[str, str] = {}
    for line in body[max(start, 0):].split("\n"):
        m = _QUESTION_LINE.match(line)
        if m and "?" in line:
            text = line[2:].split(_CHOOSE_FROM)[0].strip()
            out.setdefault(m.group(1), QUESTION_KINDS.get(text, "bonus"))
    return out
