"""The Temporal Clue grader: the fraction of questions a completion answers correctly.

    grade({"A": "Mrs. White", "B": "11:45 PM"}, "...\\nA. Mrs. White\\nB. 11:45 pm") == 1.0

How a completion is read:

- An answer starts at a *marker*: a question letter followed by `.`, `)`, `:`, `]`, `=` or a dash
  (`A. X`, `A) X`, `(A) X`, `A: X`, `A - X`), at the start of a line (after any markdown
  decoration: `**A.**`, `- A.`, `# A.`) or after whitespace inside a line, so that several answers
  on one line (`A. Mrs. White B. Lounge`) are split. Only letters that the solution asks about
  are markers, which is why the periods inside names ("Mrs. White", "Sgt. Gray", "John Q. Boddy")
  never cut an answer short. Lower-case markers (`a) X`) count only at the start of a line, so
  ordinary prose ("a: ...") does not override an answer.
- The answer runs to the next marker on its line or the line's end. The LAST answer given for
  each letter counts (a model that revises itself is graded on its final word).
- An answer is right when, ignoring case, all whitespace, periods ("Mrs White"), markdown
  (asterisks, underscores, backticks), surrounding quotes or brackets, a leading "the", a
  repeated question ("Who murdered Mr. Boddy? Mrs. White") or a placeholder prefix ("SUSPECT:
  Mrs. White"), it equals the true answer, or starts with it followed by punctuation that does
  not start a list ("Mrs. White. She had the Rope" and "Mrs. White (motivated by Fear)" count;
  "Mrs. White, Miss Peach" and "Mrs. White/Miss Peach" do not), so copying the list of choices
  earns nothing. Times match with or without a leading zero and with "A.M."/"am" spellings.
- Anything else, including answers that are not among the puzzle's choices, is simply wrong.

Cost: the text is read backwards in blocks (4 kB, then doubling) looking only for letters that
have no answer yet, so a completion ending in its answer sheet costs one small block, and any
text at most one regex pass plus bounded work per answer: linear in its length. bench/grade.py
measures 100 kB completions, realistic and adversarial. It never raises on any text.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from sleuth.records import AnswerPart

# What may stand right before a marker's letter: whitespace (or the text's start), an opening
# bracket or quote, or markdown, so that "Mrs." and "U.S." are never markers.
_BEFORE_MARKER = frozenset(" \t\n\r\f\v([{|>\"'*_`#-+")
# What may stand between a line's start and a lower-case marker ("- a) ...", "**a.**").
_LINE_DECOR = frozenset(" \t>#-+|*_`([")
_MAX_DECOR = 40
# After the letter: optional markdown ("**A**."), up to two spaces, a separator. Bounded
# repetitions keep every match attempt O(1).
_AFTER_LETTER = r"[*_`]{0,3}[ \t]{0,2}(?:[.):\]=]|[-–—](?=\s))"
# "A.M." / "p. m." (written-out times) are not markers for questions A or P.
_AM_PM_TAIL = re.compile(r"[ \t]?[Mm]\.?(?![A-Za-z])")
_MARKDOWN = str.maketrans("", "", "*_`")
_OPENERS = "\"'“”‘’«»([{<"
_PLACEHOLDER = re.compile(r"(?:suspect|weapon|room|time|motive)\s*[:=\-–—]\s*", re.IGNORECASE)
_THE = re.compile(r"the\s+", re.IGNORECASE)
# After a correct answer, only these may follow for it still to count: no letter or digit, and
# no list separator ("," ";" "/" "&" "+"), so that copying the list of choices earns nothing.
_BOUNDARY = set(".:!?)]}>([{-–—\"'“”‘’«»")
_FIRST_BLOCK = 4096
"""The first look reads only this much of the completion's end."""
_MARKER_REACH = 8
"""A marker's longest extent past its letter: markdown, spaces, separator, look-ahead."""
_MAX_ANSWER_CHARS = 400
"""Longer answers are cut before normalizing: the true answers are a few words each."""


def _strip_markdown(text: str) -> str:
    return text.translate(_MARKDOWN) if ("*" in text or "_" in text or "`" in text) else text


def answer_key(text: str) -> str:
    """The comparison form of an answer: NFKC, case-folded, no whitespace, no markdown,
    times without a leading zero ("08:00 PM" -> "8:00pm")."""
    if not text.isascii():
        text = unicodedata.normalize("NFKC", text)
    key = "".join(_strip_markdown(text).casefold().split())
    if len(key) >= 5 and key[0] == "0" and key[1].isdigit() and key[2] == ":":
        key = key[1:]
    return key


def _clean(value: str) -> str:
    """Strip what surrounds an answer: quotes, a repeated question, a placeholder, "the"."""
    value = _strip_markdown(value[:_MAX_ANSWER_CHARS]).strip()
    if "?" in value:  # "Who murdered Mr. Boddy? Mrs. White": the answer follows the question
        tail = value.rsplit("?", 1)[1].strip()
        if tail:
            value = tail
    value = value.lstrip(_OPENERS + " \t").strip()
    m = _PLACEHOLDER.match(value)
    if m:
        value = value[m.end() :]
    m = _THE.match(value)
    if m:
        value = value[m.end() :]
    return value.strip()


@lru_cache(maxsize=4096)
def _truth_key(truth: str) -> str:
    return answer_key(truth)


def answer_matches(given: str, truth: str) -> bool:
    """True when an extracted answer `given` names `truth` (see the module docstring)."""
    want = _truth_key(truth)
    if not want:
        return False
    got = answer_key(_clean(given))
    # Second form without periods, so "Mrs White" names "Mrs. White"; the first keeps them so that
    # "Mrs. White. She ..." still ends the answer at its period.
    for g, w in ((got, want), (got.replace(".", ""), want.replace(".", ""))):
        if g == w or (w and g.startswith(w) and g[len(w)] in _BOUNDARY):
            return True
    return False


@lru_cache(maxsize=256)
def _marker_patterns(letters: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Markers for these question letters: upper case after an allowed character (checked by a
    look-behind, in the regex engine), lower case at a line's start. The first pattern starts
    with the letter itself, so the engine skips quickly from one candidate letter to the next."""
    before = re.escape("".join(sorted(_BEFORE_MARKER)))
    upper = re.compile(f"[{letters}](?<![^{before}][{letters}]){_AFTER_LETTER}")
    decor = re.escape("".join(sorted(_LINE_DECOR)))
    lower = re.compile(f"^[{decor}]{{0,{_MAX_DECOR}}}([{letters.lower()}]){_AFTER_LETTER}", re.MULTILINE)
    return upper, lower


def _markers(text: str, letters: str, pos: int, endpos: int) -> list[tuple[int, int]]:
    """(start, answer start) of every marker for `letters` whose letter lies in text[pos:endpos],
    in order. The regexes see a little past both ends, so a marker that straddles a block edge is
    found once, by the block holding its letter."""
    upper, lower = _marker_patterns(letters)
    reach = min(len(text), endpos + _MARKER_REACH)
    spans = [
        m.span() for m in upper.finditer(text, pos, reach) if m.start() < endpos and not _spelled_time(text, m.end())
    ]
    for m in lower.finditer(text, max(0, pos - _MAX_DECOR - 1), reach):
        if pos <= m.start(1) < endpos and not _spelled_time(text, m.end()):
            spans.append((m.start(1), m.end()))
    spans.sort()
    return spans


def _spelled_time(text: str, end: int) -> bool:
    """Whether the marker ending at `end` is really the "A." of "A.M." (or "P. M.")."""
    return text[end - 1] == "." and _AM_PM_TAIL.match(text, end) is not None


def _answer_at(text: str, answer_start: int, letters: str) -> str:
    """The answer text from `answer_start` to the line's end or the next marker on the line (a
    bounded look: answers are cut at _MAX_ANSWER_CHARS anyway)."""
    limit = min(len(text), answer_start + _MAX_ANSWER_CHARS)
    newline = text.find("\n", answer_start, limit)
    end = newline if newline >= 0 else limit
    later = _markers(text, letters, answer_start, end)
    return text[answer_start : later[0][0] if later else end]


def extract_answers(completion: str, letters: set[str] | frozenset[str]) -> dict[str, str]:
    """The last answer text given for each question letter (upper-case letters), raw."""
    wanted = "".join(sorted({c.upper() for c in letters if isinstance(c, str) and len(c) == 1 and c.isascii() and c.isalpha()}))
    if not completion or not wanted:
        return {}
    text = _normalized(completion)
    found: dict[str, str] = {}
    # Blocks from the end backwards (4 kB, then doubling), looking only for the letters still
    # without an answer: the answer sheet is usually at the end, so one small block suffices;
    # otherwise every character is scanned once, and markers of letters already answered are
    # never enumerated (so "A. A. A. ..." or a long run of old answers cost no Python work each).
    block_end, block = len(text), _FIRST_BLOCK
    while block_end > 0 and len(found) < len(wanted):
        block_start = max(0, block_end - block)
        missing = "".join(c for c in wanted if c not in found)
        for start, answer_start in reversed(_markers(text, missing, block_start, block_end)):
            letter = text[start].upper()
            if letter not in found:
                found[letter] = _answer_at(text, answer_start, wanted)
        block_end, block = block_start, block * 2
    return found


_FULL_WIDTH = re.compile("[\uff01-\uff5e\u3000]")


def _normalized(text: str) -> str:
    # NFKC, when full-width forms occur, so that "Ａ．" is a marker too (NFKC of a long non-ASCII
    # text costs more than the rest of the scan, so only then).
    return unicodedata.normalize("NFKC", text) if not text.isascii() and _FULL_WIDTH.search(text) else text


def grade(solution: Mapping[str, str], completion: str) -> float:
    """Fraction of the solution's questions that the completion answers correctly, in [0, 1].

    `solution` maps question letters to true answers ({"A": "Mrs. White", ...}); an empty
    solution scores 0. Never raises for any completion text (non-text scores 0).
    """
    return _fraction_answered(((letter, (truth,)) for letter, truth in solution.items()), completion)


def valid_fraction(choices: Mapping[str, Sequence[str]], completion: str) -> float:
    """Fraction of the questions in `choices` (letter -> its listed answers) that the completion
    answers with one of that question's listed answers, right or wrong, in [0, 1]. The format
    reward of a run with algorithm.format_reward: it tells a suspect line from a room line, which
    the correctness reward alone barely does for a small model. Never raises."""
    return _fraction_answered(choices.items(), completion)


def _fraction_answered(accepted: Iterable[tuple[str, Sequence[str]]], completion: str) -> float:
    """Fraction of the questions (letter, accepted answers) whose answer in the completion names
    one of its accepted answers; 0 for no questions or a completion that is not text."""
    items = list(accepted)
    if not items or not isinstance(completion, str):
        return 0.0
    letters = {str(letter).upper(): [str(a) for a in answers] for letter, answers in items}
    given = extract_answers(completion, set(letters))
    hits = sum(1 for letter, answers in letters.items()
               if letter in given and any(answer_matches(given[letter], a) for a in answers))
    return hits / len(items)


def answer_parts(solution: Mapping[str, str], completion: str,
                 choices: Mapping[str, Sequence[str]] | None = None) -> list[AnswerPart]:
    """Each answer the grader reads from a line of its own (`C. Library`), with that line's span and
    its own reward (1.0 right, 0.0 wrong): per-answer credit (credit.py). With `choices` (letter ->
    its listed answers) each part's format_score is 1.0 when it names one of them, else 0.0. An
    answer the grader reads from a line holding several markers, or not from its last line of its
    own, has no part (its tokens keep the completion's advantage). Never raises."""
    if not isinstance(completion, str) or not solution:
        return []
    truths = {str(letter).upper(): str(truth) for letter, truth in solution.items()}
    letters = "".join(sorted(c for c in truths if len(c) == 1 and c.isascii() and c.isalpha()))
    if not letters:
        return []
    given = extract_answers(completion, set(letters))
    lines: dict[str, tuple[int, int, int]] = {}  # letter -> its last line of its own: start, answer, end
    start = 0
    for line in completion.splitlines(keepends=True):
        end = start + len(line.rstrip("\r\n"))
        markers = _markers(completion, letters, start, end)
        if len(markers) == 1:
            at, answer_start = markers[0]
            lines[completion[at].upper()] = (start, answer_start, end)
        start += len(line)
    parts = []
    for letter, (begin, value_start, end) in lines.items():
        answer = completion[value_start:end]
        if letter in given and given[letter].rstrip() == answer.rstrip():
            reward = 1.0 if answer_matches(answer, truths[letter]) else 0.0
            listed = None if choices is None else [str(c) for c in choices.get(letter, ())]
            fmt = None if listed is None else float(any(answer_matches(answer, c) for c in listed))
            parts.append(AnswerPart(letter, begin, end, reward, value_start=value_start, format_score=fmt))
    return sorted(parts, key=lambda p: p.start)


def answer_sheet_key(letters: Iterable[str], completion: str) -> tuple[tuple[str, str], ...] | None:
    """The answers a completion gives, in a form for majority votes: (letter, comparison form) per
    question it answers, sorted by letter, periods dropped ("Mrs White" votes with "Mrs. White");
    None when it answers none of `letters`."""
    if not isinstance(completion, str):
        return None
    given = extract_answers(completion, {str(c).upper() for c in letters})
    key = tuple(sorted((letter, answer_key(_clean(text)).replace(".", "")) for letter, text in given.items()))
    return key or None
